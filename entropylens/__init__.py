"""entropylens: per-token training dynamics of GRPO-family RL, recorded to Parquet, queried with DuckDB.

Heavy modules (torch, pyarrow, duckdb) load on first use, so ``import entropylens`` is cheap.
"""

from __future__ import annotations

from ._source_layout import install as _source_layout
from .schema import SCHEMA_VERSION

_source_layout()  # a source checkout on sys.path (python in the repo root): entropylens.cli / .analyses too

__version__ = "0.1.0"
__all__ = [
    "SCHEMA_VERSION",
    "Recorder",
    "policy_loss",
    "logprobs_and_entropy",
    "connect",
    "run_analysis",
    "open",
    "write_report",
]

_LAZY = {
    "Recorder": ("entropylens.record.recorder", "Recorder"),
    "policy_loss": ("entropylens.rl.losses", "policy_loss"),
    "logprobs_and_entropy": ("entropylens.rl.stats", "logprobs_and_entropy"),
    "connect": ("entropylens.read.query", "connect"),
    "run_analysis": ("entropylens.read.query", "run_analysis"),
    "open": ("entropylens.read.query", "open"),  # entropylens.open(path).sql(...) / .analysis(...): pandas or polars
    "write_report": ("entropylens.report.build", "write_report"),
}
_SUBMODULES = ("rl", "record", "read", "report", "demo", "integrations")  # the stages, trainers, demo


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        mod, attr = _LAZY[name]
        return getattr(importlib.import_module(mod), attr)
    if name in _SUBMODULES:  # `import entropylens; entropylens.rl.losses.policy_loss(...)` works
        import importlib

        return importlib.import_module(f"entropylens.{name}")
    raise AttributeError(f"module 'entropylens' has no attribute {name!r}")
