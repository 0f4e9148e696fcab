"""What a query connection may do once its views are built, and how it survives a compaction.

**Lockdown**. Every connection checks its SQL with DuckDB's parser (entropylens/read/sql_guard.py), but
a parser check alone can miss a statement that writes (``EXPLAIN ANALYZE COPY ... TO`` did). So
:func:`entropylens.read.query.connect` also locks the connection with DuckDB's own settings, after the
views are built:

- ``allowed_paths``: exactly the data files the views read (the Hive files of ``sequences``,
  ``tokens`` and the other non-materialized tables; ``steps`` and ``probes`` were already read into
  tables), and ``allowed_directories``: each run's ``compacted/`` folder (so a view can be re-planned
  onto the compacted files after a compaction, below) and a private, fresh temporary folder for
  DuckDB's spill files (DuckDB's default, ``.tmp`` in the working directory, would be allowed too);
- ``enable_external_access = false``: no other file, local or remote, can be read or written, no
  database attached, no extension installed or loaded; no network (object-storage runs are read
  through the fsspec filesystem registered on the connection, restricted to the same paths);
- ``autoinstall_known_extensions = false``, ``autoload_known_extensions = false``;
- ``lock_configuration = true``: none of the above can be changed back by a statement
  (``allowed_configs`` leaves only ``enable_progress_bar`` settable).

What DuckDB still allows on a locked connection: reading the allowed files (and, with a statement
the parser check would refuse, writing them: DuckDB's allow-lists do not distinguish reading from
writing, so the parser check is what keeps the run's own files intact), in-memory temporary tables
and views, and everything that computes. On DuckDB 2.0.1, views created before the
lockdown read their files only if those paths are allowed (the cost of ``SET allowed_paths``:
docs/security.md).

**Re-plan on a vanished file.** Views hold explicit file lists, so a connection opened before a
compaction removed the originals would fail afterwards (``No files found that match ...``). The
connection remembers how it was made; when a query fails because a file of its views is gone,
:func:`replan` lists the run again *once*, keeps the files it had (the snapshot) plus the compacted
files that replace the vanished ones, re-creates the file views, and the query is run again. The
compactor keeps no reader registry: originals are removed after its grace period whatever readers
hold them; readers re-plan.
"""

from __future__ import annotations

import re
import shutil
import tempfile
import weakref
from dataclasses import dataclass, field

from . import catalog as cat
from .sql_guard import unguarded

ALLOWED_CONFIGS = ("enable_progress_bar",)  # harmless; report/build.py turns it off after connect


@dataclass
class Plan:
    """How a connection's views were made (for :func:`replan`)."""

    path: object
    runs: list[str] | None
    storage_options: dict | None
    files: set[str] = field(default_factory=set)  # the Hive data files the views read at connect
    locked: bool = False


_PLANS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def view_tables(snap: cat.Catalog, materialized) -> list[str]:
    """The tables that stay views over files (not read into tables at connect)."""
    from .views import PARTITIONED

    return sorted((set(PARTITIONED) | set(snap.tables())) - set(materialized))


def _view_files(snap: cat.Catalog, tables) -> set[str]:
    return {f for r in snap.runs for t in tables for f in r.files.get(t, ())}


def remember(con, path, runs, storage_options, snap: cat.Catalog) -> Plan:
    from .views import MATERIALIZED

    plan = Plan(path, runs, storage_options, _view_files(snap, view_tables(snap, MATERIALIZED)))
    _PLANS[con] = plan
    return plan


def lock_down(con, snap: cat.Catalog, temp_directory: str | None = None) -> None:
    """Lock ``con`` (module docstring). Call after every view of ``snap`` exists. ``temp_directory``:
    where DuckDB may spill (default: a fresh private folder, removed with the connection)."""
    from .views import MATERIALIZED

    tables = view_tables(snap, MATERIALIZED)
    paths = sorted({f for r in snap.runs for t in tables for f in (*r.files.get(t, ()), *r.compacted.get(t, ()))})
    if temp_directory is not None:
        tmp = str(temp_directory)
    else:
        tmp = tempfile.mkdtemp(prefix="entropylens-duckdb-")
        weakref.finalize(con, shutil.rmtree, tmp, True)
    dirs = [tmp.rstrip("/") + "/"] + [str(r.dir / cat.COMPACTED).rstrip("/") + "/" for r in snap.runs]
    con.execute("SET autoinstall_known_extensions = false")
    con.execute("SET autoload_known_extensions = false")
    con.execute("SET temp_directory = ?", [tmp])
    con.execute("SET allowed_directories = ?", [dirs])
    con.execute("SET allowed_paths = ?", [paths])
    con.execute("SET enable_external_access = false")
    con.execute("SET allowed_configs = ?", [list(ALLOWED_CONFIGS)])
    con.execute("SET lock_configuration = true")
    plan = _PLANS.get(con)
    if plan is not None:
        plan.locked = True


_DENIED = re.compile(r'Cannot access (?:file|directory) "([^"]+)"')


def vanished(e: BaseException, plan: Plan | None = None) -> bool:
    """A DuckDB error saying a file the views name is gone (a compaction removed it). On a locked
    connection DuckDB, not finding the file, retries it as a folder (``FILE/**/*.parquet``), which the
    lockdown refuses: a permission error naming one of the views' own files counts too."""
    import duckdb

    msg = str(e)
    if isinstance(e, duckdb.IOException):
        return "No files found" in msg or "No such file" in msg or "Cannot open file" in msg
    if isinstance(e, duckdb.PermissionException) and plan is not None:
        m = _DENIED.search(msg)
        return m is not None and m.group(1).split("/**", 1)[0] in plan.files
    return False


def replan(con) -> bool:
    """Re-create the file views of ``con`` from a fresh listing (module docstring). False if ``con``
    was not made by :func:`entropylens.read.query.connect`."""
    from . import retau
    from .views import MATERIALIZED, _views

    con = unguarded(con)  # re-creating the views is this module's own SQL, not a user's
    plan = _PLANS.get(con)
    if plan is None:
        return False
    snap = cat.scan(plan.path, plan.runs, storage_options=plan.storage_options)
    snap.runs = [r for r in snap.runs if r.id in {row[0] for row in con.execute("SELECT run FROM runs").fetchall()}]
    tables = view_tables(snap, MATERIALIZED)
    for r in snap.runs:  # the snapshot's own files (later steps are not added), plus compacted ones
        for t in tables:
            if t in r.files:
                r.files[t] = [f for f in r.files[t] if f in plan.files]
    for t in tables:
        con.execute(f'DROP VIEW IF EXISTS "{t}"')
    _views(snap, con, only=set(tables))
    retau.replanned(con)  # a connection split at another tau (connect(tau=...)) keeps its split
    return True


def run_replanning(con, fn):
    """``fn()``; if it fails because a file vanished, :func:`replan` once and ``fn()`` again."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - only vanished-file errors are retried
        if not vanished(e, _PLANS.get(unguarded(con))) or not replan(con):
            raise
    return fn()


__all__ = ["lock_down", "remember", "replan", "run_replanning", "vanished"]
