"""entropylens: per-token training dynamics of GRPO-family RL, recorded to Parquet, queried with DuckDB.

Heavy modules (torch, pyarrow, duckdb) load on first use, so ``import entropylens`` is cheap.
"""

from __future__ import annotations

from .schema import SCHEMA_VERSION
from ._source_layout import install as _source_layout

_source_layout()  # a source checkout on sys.path (python in the repo root): entropylens.cli / .analyses too

__version__ = "0.1.0"
__all__ = ["SCHEMA_VERSION", "Recorder", "policy_loss", "logprobs_and_entropy", "connect", "run_analysis", "open"]

_LAZY = {
    "Recorder": ("entropylens.recorder", "Recorder"),
    "policy_loss": ("entropylens.losses", "policy_loss"),
    "logprobs_and_entropy": ("entropylens.stats", "logprobs_and_entropy"),
    "connect": ("entropylens.query", "connect"),
    "run_analysis": ("entropylens.query", "run_analysis"),
    "open": ("entropylens.query", "open"),  # entropylens.open(path).sql(...) / .analysis(...): pandas or polars
}
_SUBMODULES = ("report", "query", "stats", "losses", "recorder", "toy", "integrations")  # entropylens.report etc.


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        mod, attr = _LAZY[name]
        return getattr(importlib.import_module(mod), attr)
    if name in _SUBMODULES:  # `import entropylens; entropylens.report.write_report(...)` works as documented
        import importlib

        return importlib.import_module(f"entropylens.{name}")
    raise AttributeError(f"module 'entropylens' has no attribute {name!r}")
