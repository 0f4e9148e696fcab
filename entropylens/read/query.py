"""DuckDB over recorded runs: views ``runs``, ``steps``, ``sequences``, ``tokens``.

PATH may be a run directory, a directory of runs, or any directory above them, locally or on object
storage (``s3://bucket/prefix``): runs are found by their run.json. Which files a view reads is
decided by catalog.py (bad files skipped, a step shown once its steps file exists, compacted files
preferred). Each run contributes ``read_parquet`` calls over explicit file lists (step=/rank= from
the Hive path, or stored in compacted files) and a ``run`` column; runs are glued with
``UNION ALL BY NAME`` (older runs that lack a newer column read as NULL). Analyses are the
``*.sql`` files in ``entropylens.analyses``.
"""

from __future__ import annotations

import re
import warnings
from importlib import resources

from . import catalog as cat
from .catalog import QueryError
from .params import check as check_params

from .views import (  # noqa: F401 - the readers' public names, re-exported
    DEFAULT_HEARTBEAT_S, MATERIALIZED, PARTITIONED, STALE_INTERVALS, FileNoteWarning, UnreadableFileWarning, _views,
    find_runs, read_error_hint, run_ids, run_row, run_status,
)

def connect(path, *, runs: list[str] | None = None, database: str = ":memory:",
            storage_options: dict | None = None, lock: bool = True, settings: dict | None = None):
    """A DuckDB connection with views runs / steps / sequences / tokens over the runs under ``path``
    (a directory or an object-store URL such as ``s3://bucket/runs``).

    The views are a snapshot of the files present at connect time (catalog.py): reconnect to see
    later steps. ``steps`` and ``probes`` (a row per update and rank) are read once, at connect, into
    temporary tables; ``sequences`` and ``tokens`` stay views over the files. Unreadable files are skipped with one UnreadableFileWarning each.

    ``lock`` (default): once the views exist the connection is locked down (entropylens/read/lockdown.py:
    no file access beyond the runs' own files, no network, no extensions, configuration locked).
    A query through :func:`run_sql` / :func:`run_analysis` whose files a compaction removed is
    re-planned once onto the compacted files (lockdown.replan). ``settings``: DuckDB settings to apply
    before the lock (e.g. ``{"memory_limit": "4GB", "threads": 2, "temp_directory": DIR}``; a
    temp_directory given here is where a locked connection spills, in place of a private one)."""
    import duckdb

    from . import lockdown

    for attempt in range(3):
        snap = cat.scan(path, runs, storage_options=storage_options)
        try:
            con = duckdb.connect(database)
            con.execute("SET parquet_metadata_cache = true")  # footers parsed once, not by every query
            con = _views(snap, con)
            break
        except duckdb.IOException:  # a file vanished since the listing (compaction): list again
            if attempt == 2:
                raise
    lockdown.remember(con, path, runs, storage_options, snap)
    settings = dict(settings or {})
    for key, value in settings.items():
        if not str(key).replace("_", "").isalnum():
            raise QueryError(f"settings: {key!r} is not a DuckDB setting name")
        con.execute(f"SET {key} = ?", [value])
    if lock:
        lockdown.lock_down(con, snap, temp_directory=settings.get("temp_directory"))
    for f, why in snap.bad:
        warnings.warn(f"skipped {f}: {why}", UnreadableFileWarning, stacklevel=2)
    return con


# ---------------------------------------------------------------- analyses
_PARAM = re.compile(r"\$([a-z_][a-z0-9_]*)")


def _analysis_files() -> dict[str, str]:
    files = resources.files("entropylens.analyses")
    return {p.name[:-4]: p.read_text() for p in files.iterdir() if p.name.endswith(".sql")}


def parse_header(sql: str) -> dict:
    """The ``-- key: value`` lines at the top of an analysis file."""
    head: dict = {"notes": ""}
    for line in sql.splitlines():
        if not line.startswith("--"):
            break
        text = line[2:].strip()
        m = re.match(r"(title|columns|figure|params):\s*(.*)", text)
        if m:
            head[m.group(1)] = m.group(2)
        elif text:
            head["notes"] = (head["notes"] + " " + text).strip()
    params = {}
    for item in filter(None, (s.strip() for s in head.get("params", "").split(","))):
        if item == "none":
            continue
        name, _, default = item.partition("=")
        params[name.strip()] = default.strip()
    head["params"] = params
    return head


def analysis_info() -> dict[str, dict]:
    """name -> header (title, columns, figure, params, notes), sorted by name."""
    return {name: parse_header(sql) for name, sql in sorted(_analysis_files().items())}


def list_analyses() -> list[tuple[str, str]]:
    """(name, title) of every analysis, sorted by name."""
    return sorted((name, parse_header(sql).get("title", "")) for name, sql in _analysis_files().items())


def _literal(value) -> str:
    if isinstance(value, bool):
        return "TRUE" if value else "FALSE"
    if isinstance(value, (int, float)):
        return repr(value)
    s = str(value)
    if re.fullmatch(r"-?\d+", s):
        return s
    if re.fullmatch(r"-?(\d+\.\d*|\.\d+|\d+)([eE][-+]?\d+)?", s):
        return s
    if re.fullmatch(r"\[\s*-?[\d.eE+-]+(\s*,\s*-?[\d.eE+-]+)*\s*\]", s):
        return s  # a numeric list, e.g. bins
    raise QueryError(f"parameter value {s!r} is not a number or a list of numbers")


def render_analysis(name: str, **params) -> str:
    files = _analysis_files()
    if name not in files:
        raise QueryError(f"unknown analysis {name!r}; analyses: {', '.join(sorted(files))}")
    sql = files[name]
    declared = parse_header(sql)["params"]
    unknown = set(params) - set(declared)
    if unknown:
        raise QueryError(
            f"analysis {name!r} has no parameter {', '.join(sorted(unknown))}; "
            f"parameters: {', '.join(declared) or 'none'}"
        )
    values = {**declared, **params}
    try:
        check_params(values)  # ranges (bins >= 1, probabilities in [0, 1], ...), before any SQL runs
    except ValueError as e:
        raise QueryError(str(e)) from None
    return _PARAM.sub(lambda m: _literal(values[m.group(1)]) if m.group(1) in values else m.group(0), sql)


def _frame(cursor):
    """The result as a DataFrame; integer sums (DuckDB HUGEINT, which pandas receives as float64)
    come back as integers, so 1966080 never prints as 1.96608e+06."""
    df = cursor.df()
    for col, (_, typ, *_rest) in zip(df.columns, cursor.description or ()):
        if str(typ) == "HUGEINT" and df[col].dtype.kind == "f":
            df[col] = df[col].astype("Int64") if df[col].isna().any() else df[col].astype("int64")
    return df


def run_analysis(con, name: str, **params):
    """Run analyses/<name>.sql on ``con`` (from :func:`connect`) and return a pandas DataFrame."""
    import duckdb

    from .lockdown import run_replanning

    sql = render_analysis(name, **params)
    try:
        return run_replanning(con, lambda: _frame(con.execute(sql)))
    except duckdb.Error as e:
        raise QueryError(f"analysis {name!r} failed: {str(e).splitlines()[0]}{read_error_hint(con, e)}") from None


def run_sql(con, sql: str):
    """A user's SQL; errors become one-line QueryErrors (an empty statement too)."""
    import duckdb

    if not sql.strip().strip(";").strip():
        raise QueryError("SQL error: the query is empty")
    from .lockdown import run_replanning

    def once():
        cursor = con.execute(sql)
        return None if cursor is None else _frame(cursor)

    try:
        df = run_replanning(con, once)
        if df is None:  # DuckDB runs nothing (e.g. only comments)
            raise QueryError("SQL error: the query has no statement")
        return df
    except duckdb.Error as e:
        raise QueryError(f"SQL error: {str(e).splitlines()[0]}{read_error_hint(con, e)}") from None


__all__ = ["connect", "find_runs", "list_analyses", "run_analysis", "run_sql", "QueryError", "Runs", "open"]


class Runs:
    """The runs under ``path`` for Python: ``entropylens.open(path)``.

        runs = entropylens.open("runs")
        runs.sql("SELECT run, avg(entropy) FROM tokens GROUP BY run")          # pandas
        runs.sql("SELECT ...", polars=True)                                     # polars (from DuckDB's Arrow)
        runs.analysis("clip_by_quadrant", polars=True)                          # an analysis, either kind

    ``runs.con`` is the DuckDB connection (:func:`connect`, locked the same way). polars is optional
    (``pip install polars``); DuckDB hands its result over as an Arrow table, which polars takes without
    copying (no detour through pandas)."""

    def __init__(self, path, *, runs: list[str] | None = None, **connect_kwargs):
        self.path = path
        self.con = connect(path, runs=runs, **connect_kwargs)

    def sql(self, query: str, *, polars: bool = False):
        """A read-only query's result: a pandas DataFrame, or a polars one with ``polars=True``."""
        return _result(self.con, query, polars, lambda: run_sql(self.con, query))

    def analysis(self, name: str, *, polars: bool = False, **params):
        """Analysis ``name`` (analyses/<name>.sql) with its parameters: pandas, or polars."""
        return _result(self.con, render_analysis(name, **params), polars,
                       lambda: run_analysis(self.con, name, **params), what=f"analysis {name!r}")

    def __repr__(self) -> str:
        return f"entropylens.open({self.path!r})"


def _result(con, sql: str, polars: bool, as_pandas, what: str = "SQL"):
    if not polars:
        return as_pandas()
    try:
        import polars as pl
    except ImportError:
        raise QueryError("polars=True needs polars: pip install polars") from None
    import duckdb

    from .lockdown import run_replanning

    if not sql.strip().strip(";").strip():
        raise QueryError("SQL error: the query is empty")
    try:
        return run_replanning(con, lambda: pl.from_arrow(con.sql(sql).to_arrow_table()))
    except duckdb.Error as e:
        prefix = "SQL error" if what == "SQL" else f"{what} failed"
        raise QueryError(f"{prefix}: {str(e).splitlines()[0]}{read_error_hint(con, e)}") from None


def open(path, *, runs: list[str] | None = None, **connect_kwargs) -> Runs:  # noqa: A001 - entropylens.open
    """The runs under ``path`` (see :class:`Runs`): ``.sql(...)`` and ``.analysis(...)`` as pandas or polars."""
    return Runs(path, runs=runs, **connect_kwargs)
