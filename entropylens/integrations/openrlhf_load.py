"""OpenRLHF's policy-loss module without its heavy dependencies.

``openrlhf.models.loss`` imports ``.utils.masked_mean``; ``openrlhf/models/utils.py`` imports deepspeed at
the top, and ``openrlhf/models/__init__.py`` imports the actor (flash-attn, transformers' heavy paths).
Where the real package imports, it is used as it is. Otherwise the two files are loaded one by one, from
the installed package (``pip install --no-deps openrlhf==0.11.2``), into a private package
``_entropylens_openrlhf``: utils.py with an empty ``deepspeed`` module in ``sys.modules`` for the import
only (masked_mean does not touch it), then loss.py, whose ``from .utils import masked_mean`` finds it.
Nothing of OpenRLHF's code is changed or copied.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from pathlib import Path

PRIVATE = "_entropylens_openrlhf"


def _load_file(name: str, path: Path) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None  # a .py file always has a spec with a source loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module


def load_loss_module() -> types.ModuleType:
    """``openrlhf.models.loss`` (the real one where it imports, else loaded file by file, see the module
    docstring). ImportError with one line saying how to install it where the package is absent."""
    if f"{PRIVATE}.loss" in sys.modules:
        return sys.modules[f"{PRIVATE}.loss"]
    try:
        return importlib.import_module("openrlhf.models.loss")
    except ImportError:
        pass
    spec = importlib.util.find_spec("openrlhf")  # a top-level find_spec runs no code of the package
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("openrlhf is not installed: pip install --no-deps openrlhf==0.11.2")
    models = Path(list(spec.submodule_search_locations)[0]) / "models"
    package = types.ModuleType(PRIVATE)
    package.__path__ = [str(models)]
    sys.modules[PRIVATE] = package
    stubbed = "deepspeed" not in sys.modules and importlib.util.find_spec("deepspeed") is None
    if stubbed:
        sys.modules["deepspeed"] = types.ModuleType("deepspeed")  # for utils.py's import line only
    try:
        _load_file(f"{PRIVATE}.utils", models / "utils.py")
        return _load_file(f"{PRIVATE}.loss", models / "loss.py")
    except Exception as err:  # another layout or version: say so as an import failure
        sys.modules.pop(PRIVATE, None)
        raise ImportError(
            f"openrlhf {openrlhf_version()}: its loss module did not load ({type(err).__name__}: "
            f"{err}); entropylens supports OpenRLHF 0.11.2"
        ) from err
    finally:
        if stubbed:
            sys.modules.pop("deepspeed", None)


def openrlhf_version() -> str | None:
    """The installed OpenRLHF's version (its distribution metadata), or None."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("openrlhf")
    except PackageNotFoundError:
        return None


__all__ = ["load_loss_module", "openrlhf_version"]
