"""The verl releases this plug-in was tested with, and the check that refuses any other.

It plugs into verl's policy-loss registry, actor loss function and v1 trainer, whose interfaces move
between releases; ``ENTROPYLENS_VERL_UNSAFE=1`` skips the check.
"""

from __future__ import annotations

from .._version import require_tested

VERL_TESTED = ("0.9",)  # major.minor releases whose loss / trainer / engine interfaces this was tested with


def check_verl_version(version: str | None = None) -> str:
    """Raise a clear error on a verl release this plug-in was not tested with
    (ENTROPYLENS_VERL_UNSAFE=1 skips the check)."""
    if version is None:
        import verl

        version = verl.__version__
    return require_tested(
        "verl",
        version,
        VERL_TESTED,
        "ENTROPYLENS_VERL_UNSAFE",
        "It plugs into verl's policy-loss registry, actor loss function and v1 trainer, whose "
        "interfaces move between releases.",
    )
