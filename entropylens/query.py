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

import json
import re
import warnings
from datetime import datetime, timezone
from importlib import resources
from pathlib import Path

from . import catalog as cat
from .catalog import QueryError
from .params import check as check_params
from .schema import TABLES, changed_meaning
from .storage import location, register

PARTITIONED = ("steps", "sequences", "tokens", "probes")
UNIFORM = ("sequences", "tokens")  # one writer, one schema per run: no union_by_name, so a filtered
# query opens only the files its step/rank filter keeps (union_by_name reads every footer first)
MATERIALIZED = ("steps", "probes")  # a row per update and rank: read once at connect into a table, not
# once per query (an uncompacted 100M-row run has 24k steps files, each parsed again by every query)
MATERIALIZE_FILES = 512  # files per read_parquet when materializing: DuckDB held ~0.45 MB per small file
# until one read_parquet over them all finished (24k steps files: >13 GB); 512 at a time stays < 0.5 GB
STALE_INTERVALS = 3  # a running run whose heartbeat is older than this many intervals is `stale`
DEFAULT_HEARTBEAT_S = 10.0


class UnreadableFileWarning(UserWarning):
    """A file under the path cannot be read; it was skipped (``entropylens verify`` lists them)."""


def run_ids(dirs, base) -> list[str]:
    """A run's id is its directory name, or its path relative to ``base`` where names collide."""
    return cat.run_ids([location(d) for d in dirs], location(base))


def find_runs(path, runs: list[str] | None = None, storage_options: dict | None = None) -> list:
    """Run directories at or under ``path`` (a directory holding run.json), sorted by path: a Path
    for local runs, a storage.Location for object storage. ``runs`` selects by run id or name."""
    return [Path(d.path) if not d.remote else d for d in cat.find_runs(path, runs, storage_options)]


def _sql_str(s: str) -> str:
    return "'" + s.replace("'", "''") + "'"


def _sql_list(files: list[str]) -> str:
    return "[" + ", ".join(_sql_str(f) for f in files) + "]"


def _duck_type(dtype: str) -> str:
    return {"int8": "TINYINT", "int16": "SMALLINT", "int32": "INTEGER", "int64": "BIGINT", "float32": "FLOAT",
            "float64": "DOUBLE", "bool": "BOOLEAN", "string": "VARCHAR", "dict8": "VARCHAR"}[dtype]


def run_status(info: dict, now: datetime | None = None) -> str | None:
    """run.json's status, except that a ``running`` run whose heartbeat is older than
    STALE_INTERVALS x its heartbeat interval (run.json ``heartbeat_s``, default 10 s) is ``stale``:
    its process died without closing (kill -9, node loss)."""
    status = info.get("status")
    beat = info.get("heartbeat_at") or info.get("started_at")
    if status != "running" or not beat:
        return status
    try:
        t = datetime.fromisoformat(str(beat))
        if t.tzinfo is None:
            t = t.replace(tzinfo=timezone.utc)
        interval = float(info.get("heartbeat_s") or DEFAULT_HEARTBEAT_S)
    except (TypeError, ValueError):
        return status
    age = ((now or datetime.now(timezone.utc)) - t).total_seconds()
    return "stale" if age > STALE_INTERVALS * interval + 1.0 else status  # +1 s: seconds resolution


def run_row(info: dict, run_id: str, path: str) -> dict:
    """The ``runs`` view row of one run.json."""
    cfg = info.get("config") or {}
    return {
        "run": run_id,
        "method": info.get("method") or cfg.get("method"),
        "config": json.dumps(cfg, sort_keys=True, default=str),
        "model": info.get("model"),
        "seed": info.get("seed"),
        "world_size": info.get("world_size"),
        "eps_low": info.get("eps_low"),
        "eps_high": info.get("eps_high"),
        "tau": info.get("tau"),
        "sample": info.get("sample"),
        "status": run_status(info),
        "started_at": info.get("started_at"),
        "heartbeat_at": info.get("heartbeat_at"),
        "schema_version": info.get("schema_version"),
        "resumes": len(info.get("resumed") or []),
        "path": path,
    }


def _read_run_json(d, run_id: str) -> dict:
    """The ``runs`` row of run directory ``d`` (a path or URL)."""
    loc = location(d)
    try:
        info = json.loads((loc / "run.json").read_text())
    except (OSError, ValueError) as e:
        raise QueryError(f"unreadable run.json in {loc}: {e}") from None
    return run_row(info, run_id, str(d))


def _derived_sql(table: str, have: set[str]) -> str:
    """Derived columns (schema.Column.derived) the files lack; NULL where an input is missing too."""
    out = []
    for c in TABLES.get(table, []):
        if not c.derived or c.name in have:
            continue
        inputs = set(re.findall(r"[a-z_]+", c.derived)) - {"exp", "e"}
        expr = c.derived if inputs <= have else "NULL"
        out.append(f", CAST({expr} AS {_duck_type(c.dtype)}) AS {c.name}")
    return "".join(out)


def _missing_sql(table: str, have: set[str]) -> str:
    """Stored schema columns the files lack (a run written before they existed): NULL of their type."""
    return "".join(f", CAST(NULL AS {_duck_type(c.dtype)}) AS {c.name}" for c in TABLES.get(table, [])
                   if not c.derived and c.name not in have and c.name not in ("step", "rank"))


def _complete_table(con, table: str, runs) -> None:
    """A materialized table after its runs were read: the schema columns no run has are added as NULL
    (a directory of runs all written before a column existed still answers a query naming it), and the
    columns whose meaning changed (schema.CHANGED_MEANING) are nulled in the runs written before."""
    have = {row[0] for row in con.execute(f"DESCRIBE {table}").fetchall()}
    for c in TABLES.get(table, []):
        if c.name not in have:
            con.execute(f'ALTER TABLE {table} ADD COLUMN "{c.name}" {_duck_type(c.dtype)}')
    old: dict[str, list[str]] = {}
    for r in runs:
        for col in changed_meaning(table, r.info.get("schema_version")):
            old.setdefault(col, []).append(r.id)
    for col, ids in old.items():
        if col in have:
            con.execute(f'UPDATE {table} SET "{col}" = NULL WHERE run IN ({", ".join(map(_sql_str, ids))})')


def _sources(run: cat.RunFiles, table: str, chunk: int | None = None) -> list[str]:
    """read_parquet() calls over one run's files of ``table``: its committed Hive files (step and
    rank from the path) and its compacted files (step and rank stored); ``chunk``: at most that many
    files per call. The catalog already applied the commit rule (tokens/sequences of a step only
    once its steps file exists), dropped bad files and chose compacted files over the originals they
    replace."""
    out = []
    files = run.files.get(table)
    step = chunk or max(len(files or ()), 1)
    for i in range(0, len(files or ()), step):
        union = "false" if table in UNIFORM else "true"
        out.append(f"read_parquet({_sql_list(files[i:i + step])}, hive_partitioning = true, "
                   f"union_by_name = {union}, hive_types = {{'step': INTEGER, 'rank': SMALLINT}})")
    files = run.compacted.get(table)
    if files:
        out.append(f"read_parquet({_sql_list(files)}, union_by_name = true)")
    return out


def _empty_view(table: str) -> str:
    cols = ", ".join(f"CAST(NULL AS {_duck_type(c.dtype)}) AS \"{c.name}\"" for c in TABLES.get(table, []))
    return f"SELECT CAST(NULL AS VARCHAR) AS run{', ' + cols if cols else ''} WHERE false"


def connect(path, *, runs: list[str] | None = None, database: str = ":memory:",
            storage_options: dict | None = None, lock: bool = True, settings: dict | None = None):
    """A DuckDB connection with views runs / steps / sequences / tokens over the runs under ``path``
    (a directory or an object-store URL such as ``s3://bucket/runs``).

    The views are a snapshot of the files present at connect time (catalog.py): reconnect to see
    later steps. ``steps`` and ``probes`` (a row per update and rank) are read once, at connect, into
    temporary tables; ``sequences`` and ``tokens`` stay views over the files. Unreadable files are skipped with one UnreadableFileWarning each.

    ``lock`` (default): once the views exist the connection is locked down (entropylens/lockdown.py:
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


def _views(snap: cat.Catalog, con, only: set[str] | None = None):
    """Create the views of a catalog snapshot on ``con`` (``only``: just these tables; lockdown.replan)."""
    import pandas as pd

    if only is None:
        register(con, snap.root)
        info = pd.DataFrame([run_row(r.info, r.id, str(r.dir)) for r in snap.runs],
                            columns=[c.name for c in TABLES["runs"]] + ["path"])
        con.register("_runs_df", info)
        casts = ", ".join(f"CAST({c.name} AS {_duck_type(c.dtype)}) AS {c.name}" for c in TABLES["runs"])
        con.execute(f"CREATE VIEW runs AS SELECT {casts}, path FROM _runs_df")
    for table in sorted(set(PARTITIONED) | set(snap.tables())):
        if only is not None and table not in only:
            continue
        selects = []
        derived = any(c.derived for c in TABLES.get(table, []))
        chunk = MATERIALIZE_FILES if table in MATERIALIZED else None
        for r in snap.runs:
            for src in _sources(r, table, chunk):
                have = {row[0] for row in con.execute(f"DESCRIBE SELECT * FROM {src}").fetchall()} if derived else set()
                extra = _derived_sql(table, have) + _missing_sql(table, have) if derived else ""
                selects.append(f"SELECT {_sql_str(r.id)} AS run, *{extra} FROM {src}")
        if table in MATERIALIZED and len(selects) > 1:  # each part read by its own statement (bounded memory)
            parts = [f"_{table}_part{i}" for i in range(len(selects))]
            for part, sel in zip(parts, selects):
                con.execute(f"CREATE TEMP TABLE {part} AS {sel}")
            union = " UNION ALL BY NAME ".join(f"SELECT * FROM {part}" for part in parts)
            cols = [row[0] for row in con.execute(f"DESCRIBE {union}").fetchall()]
            hive = [c for c in ("rank", "step") if c in cols]  # last, as one read_parquet puts them
            order = ", ".join(f'"{c}"' for c in [c for c in cols if c not in hive] + hive)
            con.execute(f"CREATE TEMP TABLE {table} AS SELECT {order} FROM ({union})")
            for part in parts:
                con.execute(f"DROP TABLE {part}")
            _complete_table(con, table, snap.runs)
            continue
        body = " UNION ALL BY NAME ".join(selects) if selects else _empty_view(table)
        kind = "TEMP TABLE" if table in MATERIALIZED and selects else "VIEW"
        con.execute(f"CREATE {kind} {table} AS {body}")
        if kind == "TEMP TABLE":
            _complete_table(con, table, snap.runs)
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
        raise QueryError(f"analysis {name!r} failed: {str(e).splitlines()[0]}") from None


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
        raise QueryError(f"SQL error: {str(e).splitlines()[0]}") from None


__all__ = ["connect", "find_runs", "list_analyses", "run_analysis", "run_sql", "QueryError"]
