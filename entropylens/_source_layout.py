"""``entropylens.cli`` and ``entropylens.analyses`` when entropylens is imported from a source checkout.

pyproject.toml maps the checkout's top-level ``cli/`` and ``analyses/`` into the package
(``package-dir``): an install (regular or editable) has them as ``entropylens.cli`` /
``entropylens.analyses``. Python started in the repository root imports ``entropylens/`` from the
checkout itself (the current directory comes first on sys.path), which has neither: the CLI module
and every SQL analysis were missing (``No module named 'entropylens.analyses'``). In that layout
alone, a finder placed after the standard ones resolves exactly these two names to the checkout's
folders; an install never sees it.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from pathlib import Path

_PACKAGE = Path(__file__).resolve().parent
_ROOT = _PACKAGE.parent
_MAPPED = {"entropylens.cli": _ROOT / "cli", "entropylens.analyses": _ROOT / "analyses"}


class _CheckoutFinder(importlib.abc.MetaPathFinder):
    """Finds entropylens.cli / entropylens.analyses in the checkout's top-level folders."""

    def find_spec(self, fullname, path=None, target=None):
        folder = _MAPPED.get(fullname)
        if folder is None:
            return None
        return importlib.util.spec_from_file_location(
            fullname, folder / "__init__.py", submodule_search_locations=[str(folder)]
        )


def is_checkout() -> bool:
    """The package is the ``entropylens/`` folder of a source checkout (not an install)."""
    return (
        not (_PACKAGE / "cli").is_dir()
        and (_ROOT / "pyproject.toml").is_file()
        and all((folder / "__init__.py").is_file() for folder in _MAPPED.values())
    )


def install() -> None:
    """Add the finder once, after the standard ones, when imported from a checkout."""
    if is_checkout() and not any(isinstance(f, _CheckoutFinder) for f in sys.meta_path):
        sys.meta_path.append(_CheckoutFinder())
