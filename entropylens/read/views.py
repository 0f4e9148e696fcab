"""The views of a query connection: which files each table reads (from a catalog snapshot), the runs
table from run.json, derived and missing columns, and the materialized tables (steps, probes).

Below query.py (which opens connections and runs analyses) and lockdown.py (which re-plans a view whose
files a compaction replaced): both build views with :func:`_views`.
"""

from __future__ import annotations

import json
import re
import time
import warnings
import weakref
from datetime import datetime, timezone
from pathlib import Path

from ..schema import TABLES, changed_meaning
from ..storage import location, register
from . import catalog as cat
from .catalog import QueryError

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
    """A file under the path cannot be read or breaks the schema contract; it was skipped (``entropylens
    verify`` lists them)."""


class FileNoteWarning(UnreadableFileWarning):
    """Something about a run's files a reader should know, with every file read: files of an older
    version (NULL in the columns they lack), a folder that is not a table (ignored), a step whose token
    rows disagree with its n_tokens. A subclass of UnreadableFileWarning so the CLI prints it too."""


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
    return {
        "int8": "TINYINT",
        "int16": "SMALLINT",
        "int32": "INTEGER",
        "int64": "BIGINT",
        "float32": "FLOAT",
        "float64": "DOUBLE",
        "bool": "BOOLEAN",
        "string": "VARCHAR",
        "dict8": "VARCHAR",
    }[dtype]


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
    return "".join(
        f", CAST(NULL AS {_duck_type(c.dtype)}) AS {c.name}"
        for c in TABLES.get(table, [])
        if not c.derived and c.name not in have and c.name not in ("step", "rank")
    )


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


_FILE_COL = "_entropylens_file"  # read_parquet's filename column, where step and rank come from the path


def ident(name: str) -> str:
    """``name`` as a SQL identifier (double quotes doubled)."""
    return '"' + str(name).replace('"', '""') + '"'


def _hive_safe(run: cat.RunFiles) -> bool:
    """Whether DuckDB's hive_partitioning gives exactly the recorder's step and rank for this run's files:
    it reads every ``key=value`` segment of a file's whole path as a column (a folder above the run such
    as ``step=7/`` or ``entropy=0/`` would replace the file's own values), so only where no segment of
    the run folder's path holds a ``=``. Elsewhere step and rank are cut from the file name's last
    ``/step=S/``, ``/rank=R/`` (the recorder's own segments): the same values; a filter on step still
    prunes files, but is planned ~3x slower (docs/performance.md), so the fast path stays the default."""
    return "=" not in run.dir.url()


def _keys_sql(run: cat.RunFiles) -> tuple[str, str]:
    """(the step / rank columns of a Hive source, the read_parquet options that give them)."""
    if _hive_safe(run):
        return "rank, step", "hive_partitioning = true, hive_types = {'step': INTEGER, 'rank': SMALLINT}"
    f = ident(_FILE_COL)
    return (
        f"CAST(split_part(split_part({f}, '/rank=', -1), '/', 1) AS SMALLINT) AS rank, "
        f"CAST(split_part(split_part({f}, '/step=', -1), '/', 1) AS INTEGER) AS step",
        f"hive_partitioning = false, filename = {sql_str(_FILE_COL)}",
    )


def _groups(run: cat.RunFiles, files: list[str], table: str, chunk: int | None) -> list[tuple[list[str], list[str]]]:
    """(files, their columns) per read_parquet call: files of one column list together (a file of an older
    or newer version reads its own columns, NULL elsewhere), in listing order; ``chunk`` (materialized
    tables): at most that many files per call, unioned by name inside it."""
    if chunk:
        out = []
        for i in range(0, len(files), chunk):
            part, cols = files[i : i + chunk], {}
            for f in part:
                cols.update(dict.fromkeys(n for n, _ in run.footers[f].columns) if f in run.footers else {})
            out.append((part, list(cols)))
        return out
    by_cols: dict[tuple, list[str]] = {}
    for f in files:
        by_cols.setdefault(run.footers[f].columns if f in run.footers else (), []).append(f)
    return [(fs, [n for n, _ in cols]) for cols, fs in by_cols.items()]


def _selects(run: cat.RunFiles, table: str, chunk: int | None = None) -> list[str]:
    """SELECTs over one run's files of ``table``: its committed Hive files (step and rank from the
    recorder's path segments, :func:`_keys_sql`) and its compacted files (step and rank stored), each
    with the run id, its files' own columns (by name, from the catalog's footers: no DESCRIBE), the
    derived columns and the contract columns those files lack as NULL. The catalog already applied the
    commit rule, left out bad and foreign files and chose compacted files over the originals."""
    out = []
    keys, opts = _keys_sql(run)
    hive = run.files.get(table) or []
    for files, cols in _groups(run, hive, table, chunk):
        union = "true" if chunk else "false"
        have = set(cols) | {"step", "rank"}
        body = "".join(f"{ident(c)}, " for c in cols)
        out.append(
            f"SELECT {sql_str(run.id)} AS run, {body}{keys}{_extra_sql(table, have)} FROM "
            f"read_parquet({_sql_list(files)}, {opts}, union_by_name = {union})"
        )
    comp = run.compacted.get(table) or []
    for files, cols in _groups(run, comp, table, chunk or max(len(comp), 1)):
        body = ", ".join(ident(c) for c in cols) or "*"
        out.append(
            f"SELECT {sql_str(run.id)} AS run, {body}{_extra_sql(table, set(cols))} FROM "
            f"read_parquet({_sql_list(files)}, union_by_name = true)"
        )
    return out


def _extra_sql(table: str, have: set[str]) -> str:
    """The derived columns and the missing stored ones of a source holding ``have`` (sequences and tokens;
    the materialized tables get theirs in :func:`_complete_table`)."""
    if table in MATERIALIZED:
        return ""
    return _derived_sql(table, have) + _missing_sql(table, have)


def _empty_view(table: str) -> str:
    cols = ", ".join(f'CAST(NULL AS {_duck_type(c.dtype)}) AS "{c.name}"' for c in TABLES.get(table, []))
    return f"SELECT CAST(NULL AS VARCHAR) AS run{', ' + cols if cols else ''} WHERE false"


def _views(snap: cat.Catalog, con, only: set[str] | None = None):
    """Create the views of a catalog snapshot on ``con`` (``only``: just these tables; lockdown.replan)."""
    import pandas as pd

    if only is None:
        register(con, snap.root)
        info = pd.DataFrame(
            [run_row(r.info, r.id, str(r.dir)) for r in snap.runs], columns=[c.name for c in TABLES["runs"]] + ["path"]
        )
        con.register("_runs_df", info)
        casts = ", ".join(f"CAST({c.name} AS {_duck_type(c.dtype)}) AS {c.name}" for c in TABLES["runs"])
        con.execute(f"CREATE VIEW runs AS SELECT {casts}, path FROM _runs_df")
    files = _VIEW_FILES.setdefault(con, {}) if only is None else _VIEW_FILES.get(con, {})
    for table in sorted(set(PARTITIONED) | set(snap.tables())):
        if only is not None and table not in only:
            continue
        if table not in MATERIALIZED:
            files[table] = [
                (r.dir, f) for r in snap.runs for f in (*r.files.get(table, ()), *r.compacted.get(table, ()))
            ]
        if table in MATERIALIZED:
            _materialize(con, snap, table)
            continue
        selects = [sel for r in snap.runs for sel in _selects(r, table)]
        body = " UNION ALL BY NAME ".join(selects) if selects else _empty_view(table)
        con.execute(f"CREATE VIEW {ident(table)} AS {body}")
    if only is None:
        snap.notes.extend(_row_count_notes(con, snap))
        for f, why in snap.info:
            warnings.warn(f"{f}: {why}", FileNoteWarning, stacklevel=3)
        for _, why in snap.notes:  # each names its files
            warnings.warn(why, FileNoteWarning, stacklevel=3)
    return con


def _materialize(con, snap: cat.Catalog, table: str) -> None:
    """A materialized table (steps, probes) read into a temporary table, MATERIALIZE_FILES files per
    statement (bounded memory). A file whose pages DuckDB cannot read (its footer was whole) is found
    with pyarrow, moved to the catalog's bad files (its step and rank are then not committed) and the
    table read again without it: one damaged steps file never stops a connection."""
    import duckdb

    for _ in range(3):
        try:
            return _create_materialized(con, snap, table)
        except duckdb.Error as e:
            for (name,) in con.execute("SELECT table_name FROM duckdb_tables() WHERE temporary").fetchall():
                if name.startswith(f"_{table}_part"):  # the parts read before the failure
                    con.execute(f"DROP TABLE {ident(name)}")
            if not set_aside_unreadable(
                snap, table, [f for r in snap.runs for f in (*r.files.get(table, ()), *r.compacted.get(table, ()))]
            ):
                raise e from None
    _create_materialized(con, snap, table)


def _create_materialized(con, snap: cat.Catalog, table: str) -> None:
    selects = [sel for r in snap.runs for sel in _selects(r, table, MATERIALIZE_FILES)]
    if len(selects) > 1:  # each part read by its own statement (bounded memory)
        parts = [f"_{table}_part{i}" for i in range(len(selects))]
        for part, sel in zip(parts, selects):
            con.execute(f"CREATE TEMP TABLE {part} AS {sel}")
        union = " UNION ALL BY NAME ".join(f"SELECT * FROM {part}" for part in parts)
        cols = [row[0] for row in con.execute(f"DESCRIBE {union}").fetchall()]
        hive = [c for c in ("rank", "step") if c in cols]  # last, as one read_parquet puts them
        order = ", ".join(ident(c) for c in [c for c in cols if c not in hive] + hive)
        con.execute(f"CREATE TEMP TABLE {ident(table)} AS SELECT {order} FROM ({union})")
        for part in parts:
            con.execute(f"DROP TABLE {part}")
    elif selects:
        con.execute(f"CREATE TEMP TABLE {ident(table)} AS {selects[0]}")
    else:
        con.execute(f"CREATE VIEW {ident(table)} AS {_empty_view(table)}")
        return
    _complete_table(con, table, snap.runs)


def set_aside_unreadable(snap: cat.Catalog, table: str, files: list[str]) -> list[str]:
    """The ``files`` (of ``table``) that pyarrow cannot read to their last page: taken out of the
    snapshot's runs (and, for a steps file, its step and rank's other files: the step is no longer
    committed) and added to ``snap.bad``. A file gone meanwhile is not one of them (a compaction removed
    it: the caller lists again)."""
    bad = []
    for r in snap.runs:
        mine = [f for f in files if f in set(r.files.get(table, ())) | set(r.compacted.get(table, ()))]
        for f in mine:
            why = cat.read_problem(r.dir, f.split("://", 1)[-1])
            if why and why != cat._GONE:
                bad.append(f)
                snap.bad.append(
                    (f, why + "; left out (move it out of the run folder; `entropylens verify` lists every such file)")
                )
                for t in (r.files, r.compacted):
                    if f in t.get(table, ()):
                        t[table] = [u for u in t[table] if u != f]
                if table == "steps" and f in r.sizes and cat._HIVE.search(f):
                    key = cat.step_rank(f)
                    for name, urls in r.files.items():
                        gone = [u for u in urls if cat._HIVE.search(u) and cat.step_rank(u) == key]
                        r.hidden.extend(gone)
                        r.files[name] = [u for u in urls if u not in gone]
    return bad


def _row_count_notes(con, snap: cat.Catalog) -> list[tuple[str, str]]:
    """Steps whose token files hold more rows than their steps rows' ``n_tokens`` (its sum over the
    step's updates, per rank): a copied or foreign token file, rows counted twice. Counted from the
    footers of the original files. Fewer rows (a lost file, or ``sample`` < 1) is ``entropylens verify``'s
    to name (:func:`row_count_problems` with ``fewer=True``): hand-built runs may record any n_tokens."""
    if not any(r.files.get("tokens") for r in snap.runs):
        return []
    recorded = {
        (run, step, rank): n
        for run, step, rank, n in con.execute(
            "SELECT run, step, rank, sum(n_tokens) FROM steps WHERE n_tokens IS NOT NULL GROUP BY ALL"
        ).fetchall()
    }
    out = []
    for r in snap.runs:
        out.extend(cat.row_count_problems(r, {(s, k): n for (run, s, k), n in recorded.items() if run == r.id}))
    return out


_VIEW_FILES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # con -> table -> [(run dir, file)] of its views
# errors that are the query's own (its text, names, types, limits): no file is to blame
_QUERY_ERRORS = (
    "ParserException",
    "SyntaxException",
    "BinderException",
    "CatalogException",
    "ConversionException",
    "InterruptException",
    "OutOfMemoryException",
    "PermissionException",
    "ConstraintException",
    "NotImplementedException",
    "OutOfRangeException",
)
_SCAN_LIMIT = 3  # unreadable files named at most (the first found; `verify` lists them all)
_SCAN_S = 20.0  # seconds of reading files after a failed query, at most (a runtime error of the query itself
# on a big run must not turn into minutes of reading)


def read_error_hint(con, e: BaseException) -> str:
    """For a DuckDB error while reading ``con``'s views: the view files that pyarrow cannot read to their
    last page (a damaged page behind an intact footer: DuckDB says e.g. ``Out of buffer`` or ``don't know
    what type``, naming no file), as a sentence to append to the error, with what to do; "" where no file
    is to blame (errors of the query itself; every file readable). The files the error names are checked
    first, then every view file until a few bad ones are found or ``_SCAN_S`` seconds have passed."""
    from .sql_guard import unguarded

    con = unguarded(con)  # the views were built on DuckDB's own connection, under the read-only one
    if type(e).__name__ in _QUERY_ERRORS or con not in _VIEW_FILES:
        return ""
    msg = str(e)
    every = [rf for fs in _VIEW_FILES[con].values() for rf in fs]
    named = [rf for rf in every if rf[1] in msg]
    bad: list[str] = []
    seen: set[str] = set()
    stop = time.monotonic() + _SCAN_S
    for d, f in named + every:
        if f in seen:
            continue
        if time.monotonic() > stop:  # a big run: verify reads the rest
            return "" if not bad else _hint(bad) + f" (checked {len(seen)} of {len(every)} files)"
        seen.add(f)
        why = cat.read_problem(d, f.split("://", 1)[-1])
        if why and why != cat._GONE:
            bad.append(f"{f} ({why})")
            if len(bad) >= _SCAN_LIMIT:
                break
    return _hint(bad) if bad else ""


def _hint(bad: list[str]) -> str:
    return (
        f"; reading {'; '.join(bad)} fails: move {'it' if len(bad) == 1 else 'them'} out of the run folder "
        "and query again (`entropylens verify PATH` lists every damaged file)"
    )
