"""The views of a query connection: which files each table reads (from a catalog snapshot), the runs
table from run.json, derived and missing columns, and the materialized tables (steps, probes).

Below query.py (which opens connections and runs analyses) and lockdown.py (which re-plans a view whose
files a compaction replaced): both build views with :func:`_views`.
"""

from __future__ import annotations

import json
import re
from datetime import datetime, timezone
from pathlib import Path

from . import catalog as cat
from .catalog import QueryError
from ..schema import TABLES, changed_meaning
from ..storage import location, register

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


def sql_str(s) -> str:
    """``s`` as a SQL string literal (single quotes doubled)."""
    return "'" + str(s).replace("'", "''") + "'"


def _sql_list(files: list[str]) -> str:
    return "[" + ", ".join(sql_str(f) for f in files) + "]"


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
            con.execute(f'UPDATE {table} SET "{col}" = NULL WHERE run IN ({", ".join(map(sql_str, ids))})')


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
                selects.append(f"SELECT {sql_str(r.id)} AS run, *{extra} FROM {src}")
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
