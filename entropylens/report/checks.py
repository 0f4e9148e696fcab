"""`entropylens check`: every recorded run under a path through the alarm rules (entropylens/alarms.py)."""

from __future__ import annotations

import duckdb

from ..alarms import Finding, Thresholds, evaluate
from ..read.query import QueryError, connect, render_analysis
from .run_findings import run_findings


def check(path, thresholds: Thresholds | None = None, *, runs: list[str] | None = None, con=None) -> list[Finding]:
    """Every run under ``path`` through the rules (analysis ``step_health`` over the steps table, read as
    Python values so that NULL (not measured) stays None and NaN stays NaN). ``con``: a DuckDB connection of
    those runs at their own tau (``connect(path, runs=runs)``) to use in place of opening one."""
    con = connect(path, runs=runs) if con is None else con
    try:
        cur = con.execute(render_analysis("step_health"))
        names = [d[0] for d in cur.description]
        rows = [dict(zip(names, r)) for r in cur.fetchall()]
    except duckdb.Error as e:
        raise QueryError(f"analysis 'step_health' failed: {str(e).splitlines()[0]}") from None
    return evaluate(rows, thresholds)


def notes(path, *, runs: list[str] | None = None, tau: float | None = None, con=None) -> list[Finding]:
    """The run-level findings over the token rows (run_findings.py: thin_quadrant, on_policy; ``tau``: the
    quadrants split at it): what limits what a run's figures can show, not an alarm (no exit 1). ``con``: a
    DuckDB connection of those runs split at ``tau`` (``connect(path, runs=runs, tau=tau)``) to use in place
    of opening one."""
    con = connect(path, runs=runs, tau=tau) if con is None else con
    try:
        return run_findings(con)
    except duckdb.Error as e:
        raise QueryError(f"run-level checks failed: {str(e).splitlines()[0]}") from None
