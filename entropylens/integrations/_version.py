"""The version gate shared by the framework integrations (they patch interfaces that move between releases)."""

from __future__ import annotations

import os


def require_tested(framework: str, version: str, tested: tuple[str, ...], env_var: str, why: str) -> str:
    """Return ``version`` if its major.minor is in ``tested`` (or ``env_var`` = 1); else raise RuntimeError
    naming the supported releases, the reason (``why``) and the override."""
    mm = ".".join(str(version).split(".")[:2])
    if mm not in tested and os.environ.get(env_var) != "1":
        module = f"entropylens.integrations.{framework.lower()}"
        raise RuntimeError(
            f"{module} supports {framework} {', '.join(v + '.x' for v in tested)}; found {version}. {why} "
            f"Install a supported {framework}, or set {env_var}=1 to try anyway."
        )
    return version
