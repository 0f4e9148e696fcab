"""DuckDB over recorded runs: views ``runs``, ``steps``, ``sequences``, ``tokens``.

PATH may be a run directory, a directory of runs, or any directory above them, locally or on object
storage (``s3://bucket/prefix``): runs are found by their run.json. Which files a view reads is
decided by catalog.py (bad files skipped, a step shown once its steps file exists, compacted files
preferred). Each run contributes ``read_parquet`` calls over explicit file lists (step=/rank= from
the Hive path, or stored in compacted files) and a ``run`` column; runs are glued with
``UNION ALL BY NAME`` (older runs that lack a newer column read as NULL). Analyses are the
``*.sql`` files in ``entropylens.analyses``.

One contract for both engines: :func:`connect` (``engine="duckdb"``, the default, or ``"spark"``:
entropylens/read/spark.py) returns a connection, and :func:`run_analysis` / :func:`run_sql` take either
kind and mean the same on both (same analysis names and parameters, a pandas DataFrame back).
"""

from __future__ import annotations

import os
import re
import sys
import threading
import warnings
from contextlib import contextmanager
from importlib import resources
from typing import TYPE_CHECKING, Any, Literal, overload

from . import catalog as cat
from .catalog import QueryError
from .memory import memory_limit
from .params import check as check_params
from .sql_guard import NotReadOnly, ReadOnlyConnection, unguarded
from .sql_hints import hint as sql_hint
from .views import (  # noqa: F401 - the readers' public names, re-exported
    DEFAULT_HEARTBEAT_S,
    MATERIALIZED,
    PARTITIONED,
    STALE_INTERVALS,
    FileNoteWarning,
    UnreadableFileWarning,
    _views,
    find_runs,
    read_error_hint,
    run_ids,
    run_row,
    run_status,
)

if TYPE_CHECKING:
    from typing import TypeAlias

    import duckdb
    import pandas as pd

    from .spark import SparkConnection

    # What connect() returns: checked DuckDB (the default), DuckDB's own (raw=True), or Spark's views.
    Connection: TypeAlias = "ReadOnlyConnection | duckdb.DuckDBPyConnection | SparkConnection"

ENGINES = ("duckdb", "spark")


class SettingError(QueryError):
    """DuckDB refused a setting of :func:`connect`'s ``settings``: ``key``, ``value`` (as given) and
    ``detail`` (DuckDB's own first line, e.g. ``Parser Error: Memory must have a number (e.g. 1GB)``)."""

    def __init__(self, key: str, value: object, detail: str):
        self.key, self.value, self.detail = key, value, detail
        super().__init__(f"settings: DuckDB refused {key} = {value!r}: {detail}")


@overload
def connect(
    path: str | os.PathLike[str],
    *,
    engine: Literal["duckdb"] = ...,
    runs: list[str] | None = ...,
    database: str = ...,
    storage_options: dict | None = ...,
    lock: bool = ...,
    settings: dict | None = ...,
    raw: Literal[False] = ...,
    tau: float | None = ...,
    spark: None = ...,
) -> ReadOnlyConnection: ...


@overload
def connect(
    path: str | os.PathLike[str],
    *,
    engine: Literal["duckdb"] = ...,
    runs: list[str] | None = ...,
    database: str = ...,
    storage_options: dict | None = ...,
    lock: bool = ...,
    settings: dict | None = ...,
    raw: Literal[True],
    tau: float | None = ...,
    spark: None = ...,
) -> duckdb.DuckDBPyConnection: ...


@overload
def connect(
    path: str | os.PathLike[str],
    *,
    engine: Literal["spark"],
    runs: list[str] | None = ...,
    storage_options: dict | None = ...,
    spark: Any = ...,
) -> SparkConnection: ...


@overload
def connect(
    path: str | os.PathLike[str],
    *,
    engine: str = ...,
    runs: list[str] | None = ...,
    database: str = ...,
    storage_options: dict | None = ...,
    lock: bool = ...,
    settings: dict | None = ...,
    raw: bool = ...,
    tau: float | None = ...,
    spark: Any = ...,
) -> Connection: ...


def connect(
    path: str | os.PathLike[str],
    *,
    engine: str = "duckdb",
    runs: list[str] | None = None,
    database: str = ":memory:",
    storage_options: dict | None = None,
    lock: bool = True,
    settings: dict | None = None,
    raw: bool = False,
    tau: float | None = None,
    spark: Any = None,
) -> Connection:
    """A read-only connection with views runs / steps / sequences / tokens (and probes) over the runs under
    ``path``: DuckDB's (the default) or Spark's (``engine="spark"``, entropylens/read/spark.py, the same
    views). :func:`run_analysis` and :func:`run_sql` take either and mean the same on both.

    The connection is a :class:`~entropylens.read.sql_guard.ReadOnlyConnection`: each statement given
    to ``execute`` / ``sql`` / ``query`` (and so to :func:`run_sql`, :func:`run_analysis`) is checked
    first, as ``entropylens query`` checks its SQL: one statement that reads; COPY, CREATE, INSERT,
    ATTACH, SET, INSTALL, a writing CTE, ... are a one-line QueryError and never run. ``.raw`` on the
    connection is DuckDB's own connection, unchecked.

    The views are a snapshot of the files present at connect time (catalog.py): reconnect to see
    later steps. ``steps`` and ``probes`` (a row per update and rank) are read once, at connect, into
    temporary tables; ``sequences`` and ``tokens`` stay views over the files. Unreadable files are skipped
    with one UnreadableFileWarning each. A query through :func:`run_sql` / :func:`run_analysis` whose files
    a compaction removed is re-planned once onto the compacted files (lockdown.replan). Every connection has
    the SQL macro ``quadrant(advantage, prob, tau)`` (retau.py): a token's quadrant at any tau.

    On Spark (``engine="spark"``) the connection is a :class:`~entropylens.read.spark.SparkConnection`: its
    ``execute`` checks the statement the same way and translates DuckDB SQL to Spark's; the DuckDB-only
    arguments (database, lock, settings, raw, tau) are refused there, Spark's own settings apply.

    Args:
        path: a run directory, a directory of runs, or any directory above them, locally or an object-store
            URL such as ``s3://bucket/runs``: runs are found by their run.json.
        engine: "duckdb" (default) or "spark" (pyspark: ``pip install 'entropylens[spark]'`` and Java 17+;
            docs/spark.md).
        runs: only these runs (run ids, or run directory names); None (default): every run found.
        database: the DuckDB database to connect to (``duckdb.connect``'s); default ":memory:".
        storage_options: options of an object-store path's filesystem (fsspec: endpoint, keys); None: the
            environment's.
        lock: True (default): once the views exist the connection is locked down
            (entropylens/read/lockdown.py: no file access beyond the runs' own files, no network, no
            extensions, configuration locked). False reads other files too (to join your own CSV or
            Parquet); the statement check stays.
        settings: DuckDB settings to apply before the lock (e.g. ``{"memory_limit": "4GB", "threads": 2,
            "temp_directory": DIR}``; a memory_limit in percent is converted where this DuckDB does not read
            percentages; a temp_directory given here is where a locked connection spills, in place of a
            private one). None: DuckDB's defaults.
        raw: True returns DuckDB's own connection, unchecked: the escape hatch for code that writes
            (docs/security.md); on a locked raw connection a statement can still overwrite the runs' own
            files, which the lockdown allows for reading. Default False.
        tau: the views split at this tau, in (0, 1], in place of each run's own (tokens.quadrant, the steps'
            per-quadrant columns recomputed from the token rows, runs.tau; retau.apply_tau). None (default):
            each run's own.
        spark: with ``engine="spark"``, the SparkSession to use; None (default): the active one, else a
            local one (:func:`entropylens.read.spark.session`).

    Returns:
        The read-only connection: a ``ReadOnlyConnection``, with ``raw=True`` DuckDB's own, with
        ``engine="spark"`` a ``SparkConnection``.

    Raises:
        QueryError: when path does not exist, is not a directory, cannot be reached or holds no run, runs
            names an unknown run, tau is not in (0, 1], a settings key is not a name (letters, digits,
            '_'), engine is neither "duckdb" nor "spark", or an argument is given to the engine it is not
            for; :class:`SettingError` (a QueryError) when DuckDB refuses a setting or its value;
            :class:`QueryLimitError` (a QueryError) when the memory_limit is too small for the views;
            :class:`~entropylens.read.spark.SparkUnavailable` (a QueryError) when Spark is asked for and
            pyspark or Java is missing or the session does not start.
        duckdb.Error: when files keep vanishing while the views are made (three listings in a row).
    """
    if engine == "spark":
        return _connect_spark(path, runs, storage_options, spark, database, lock, settings, raw, tau)
    if engine != "duckdb":
        raise QueryError(f"unknown engine {engine!r}: {' or '.join(ENGINES)}")
    if spark is not None:
        raise QueryError("spark= is the session of engine='spark'; this connection is DuckDB's")
    import duckdb

    from . import lockdown, retau

    if tau is not None:
        try:
            tau = retau.check_tau(tau)
        except ValueError as e:
            raise QueryError(str(e)) from None

    for attempt in range(3):
        snap = cat.scan(path, runs, storage_options=storage_options)
        try:
            con = duckdb.connect(database)
            con.execute("SET parquet_metadata_cache = true")  # footers parsed once, not by every query
            con = _views(snap, con)
            retau.register_macro(con)
            if tau is not None:
                retau.apply_tau(con, tau)
            break
        except duckdb.IOException:  # a file vanished since the listing (compaction): list again
            if attempt == 2:
                raise
    lockdown.remember(con, path, runs, storage_options, snap)
    settings = dict(settings or {})
    try:  # a memory_limit below what the views already hold, or too small for the allow-list itself
        for key, value in settings.items():
            if not str(key).replace("_", "").isalnum():
                raise QueryError(f"settings: {key!r} is not a DuckDB setting name")
            try:
                con.execute(f"SET {key} = ?", [memory_limit(value) if key == "memory_limit" else value])
            except duckdb.OutOfMemoryException:
                raise
            except duckdb.Error as e:  # a value (or name) DuckDB does not take: one line naming it
                raise SettingError(key, value, str(e).splitlines()[0]) from None
        if lock:
            lockdown.lock_down(con, snap, temp_directory=settings.get("temp_directory"))
    except duckdb.OutOfMemoryException as e:
        raise _memory_stop(e, con, settings.get("memory_limit")) from None
    for f, why in snap.bad:
        warnings.warn(f"skipped {f}: {why}", UnreadableFileWarning, stacklevel=2)
    return con if raw else ReadOnlyConnection(con)


def _connect_spark(
    path: str | os.PathLike[str],
    runs: list[str] | None,
    storage_options: dict | None,
    spark: Any,
    database: str,
    lock: bool,
    settings: dict | None,
    raw: bool,
    tau: float | None,
) -> SparkConnection:
    """:func:`connect` with ``engine="spark"``; DuckDB's own arguments are refused, by name."""
    duckdb_only = {
        "database": database != ":memory:",
        "lock": not lock,
        "settings": bool(settings),
        "raw": raw,
        "tau": tau is not None,
    }
    given = [name for name, set_ in duckdb_only.items() if set_]
    if given:
        raise QueryError(
            f"{', '.join(given)}: DuckDB's only (engine='duckdb'); a Spark connection takes runs, storage_options, "
            "spark"
        )
    from .spark import connect as spark_connect

    return spark_connect(path, runs=runs, spark=spark, storage_options=storage_options)


def is_spark(con: object) -> bool:
    """Whether ``con`` is a Spark connection (:func:`connect` with ``engine="spark"``), without importing
    the Spark engine where it was never used."""
    mod = sys.modules.get(f"{__package__}.spark")
    return mod is not None and isinstance(con, mod.SparkConnection)


# ---------------------------------------------------------------- limits
class QueryLimitError(QueryError):
    """A query stopped by a limit: ``limit`` is ``"timeout"`` (``value``: the seconds) or
    ``"memory_limit"`` (``value``: DuckDB's setting as it reads it, e.g. ``'9.5 MiB'``); ``detail``:
    DuckDB's own line. The CLI words it with its flags (cli/main.py)."""

    def __init__(self, limit: str, value, detail: str = ""):
        self.limit, self.value, self.detail = limit, value, detail
        if limit == "timeout":
            msg = f"query stopped: timeout={value:g} s reached; pass timeout=0 for no limit"
        else:
            msg = (
                f"query stopped: memory_limit {value} reached ({detail}); connect with a larger one, e.g. "
                "settings={'memory_limit': '80%'}"
            )
        super().__init__(msg)


def check_timeout(timeout) -> float | None:
    """``timeout`` as seconds (None or 0: no limit); a negative or non-number one is a QueryError."""
    if timeout is None:
        return None
    try:
        t = float(timeout)
    except (TypeError, ValueError):
        raise QueryError(f"timeout {timeout!r} is not a number of seconds") from None
    if not t >= 0:
        raise QueryError(f"timeout {timeout!r} is not a number of seconds >= 0 (0: no limit)")
    return t or None


def _memory_stop(e: Exception, con, asked=None) -> QueryLimitError:
    """DuckDB's out-of-memory error as a QueryLimitError. The limit is read from DuckDB's own line
    (``... (8.5 MiB/9.5 MiB used)``): under a tiny limit even asking for the setting fails; ``asked``:
    the limit being set when setting it failed."""
    detail = str(e).splitlines()[0].removeprefix("Out of Memory Error: ")
    m = re.search(r"/([\d.]+ ?[KMGTP]?i?B) used\)", detail)
    if m or asked is not None:
        return QueryLimitError("memory_limit", m.group(1) if m else str(asked), detail)
    try:
        value = str(con.execute("SELECT current_setting('memory_limit')").fetchone()[0])
    except Exception:  # noqa: BLE001 - only for the message
        value = "(its value unknown)"
    return QueryLimitError("memory_limit", value, detail)


@contextmanager
def limits(con, timeout: float | None = None):
    """Run the block's DuckDB work under ``timeout`` seconds (None / 0: none) and turn a stop by a limit
    into a :class:`QueryLimitError`. DuckDB has no statement timeout: a watcher thread calls
    ``con.interrupt()`` when the time is up, and on Ctrl-C too (DuckDB's own check for Ctrl-C missed some
    signals: the query ran on), which then ends the block as a KeyboardInterrupt. The memory limit is
    DuckDB's ``memory_limit``, set at connect (``settings``): a query that needs more than it, spilling
    included, stops with DuckDB's out-of-memory error, reported here as that limit."""
    import duckdb

    raw = unguarded(con)
    timeout = check_timeout(timeout)
    watcher = _Watcher(raw, timeout) if hasattr(raw, "interrupt") else None  # (Spark has its own job limits)
    try:
        yield
    except (duckdb.InterruptException, RuntimeError) as e:  # DuckDB 2.0 raises a Ctrl-C as RuntimeError
        if not isinstance(e, duckdb.InterruptException) and "interrupted" not in str(e).lower():
            raise
        if watcher is not None and watcher.fired == "timeout":
            raise QueryLimitError("timeout", timeout) from None
        raise KeyboardInterrupt from None  # Ctrl-C: the CLI's 'interrupted', exit 130, never a traceback
    except duckdb.OutOfMemoryException as e:
        raise _memory_stop(e, raw) from None
    finally:
        if watcher is not None:
            watcher.stop()


class _Watcher:
    """A thread that interrupts ``raw`` after ``timeout`` seconds or on SIGINT. The signal is seen through
    ``signal.set_wakeup_fd`` (the C-level handler writes to a pipe whichever thread it runs on, while the
    main thread waits inside DuckDB); only in the main thread, and only where a wakeup fd is not already
    in use. :meth:`stop` ends the thread before the caller goes on (a thread torn down at the process's
    exit aborted it: rc 134)."""

    def __init__(self, raw, timeout: float | None):
        import os
        import signal

        self.raw, self.timeout = raw, timeout
        self.fired: str | None = None  # "timeout" or "sigint", once it interrupted the query
        self._r, self._w = os.pipe()
        os.set_blocking(self._w, False)
        self._old_fd = None
        if threading.current_thread() is threading.main_thread():
            try:
                old = signal.set_wakeup_fd(self._w, warn_on_full_buffer=False)
                if old != -1:  # someone else's (asyncio, ...): leave theirs
                    signal.set_wakeup_fd(old)
                else:
                    self._old_fd = old
            except ValueError:
                pass
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="entropylens-query-limits", daemon=True)
        if timeout or self._old_fd is not None:
            self._thread.start()

    def _run(self) -> None:
        import os
        import select
        import signal
        import time

        end = time.monotonic() + self.timeout if self.timeout else None
        while not self._done.is_set():
            wait = 0.5 if end is None else max(0.0, min(0.5, end - time.monotonic()))
            ready, _, _ = select.select([self._r], [], [], wait)
            if ready:
                data = os.read(self._r, 64)
                if signal.SIGINT in data and not self._done.is_set():
                    self.fired = self.fired or "sigint"
                    self.raw.interrupt()
            if end is not None and time.monotonic() >= end and not self._done.is_set() and self.fired is None:
                self.fired = "timeout"
                self.raw.interrupt()
                end = None

    def stop(self) -> None:
        import os
        import signal

        self._done.set()
        if self._old_fd is not None:
            signal.set_wakeup_fd(self._old_fd)
        if self._thread.is_alive():
            os.write(self._w, b"\0")  # wake the select at once
            self._thread.join()
        os.close(self._r)
        os.close(self._w)


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


def run_analysis(con: Connection, name: str, *, timeout: float | None = None, **params: Any) -> pd.DataFrame:
    """Run ``analyses/<name>.sql`` on ``con`` (from :func:`connect`, either engine) and return a pandas
    DataFrame: the same analysis, parameters and result on DuckDB and on Spark (Spark runs the SQL
    translated, entropylens/read/portable.py).

    Args:
        con: a connection from :func:`connect`: DuckDB's (checked or raw) or Spark's (``engine="spark"``).
        name: the analysis, a file name in ``analyses/`` without ``.sql`` (:func:`list_analyses`).
        timeout: seconds before it is stopped (:func:`limits`); None (default) or 0: no limit. DuckDB's only:
            a Spark job is limited by Spark's own settings (docs/spark.md), so a timeout on a Spark
            connection is refused.
        **params: the analysis's parameters (its header's ``params``), numbers or lists of numbers; those not
            given take the header's defaults.

    Returns:
        The result as a pandas DataFrame (integer sums as integers).

    Raises:
        QueryError: when the analysis is unknown, a parameter is not one of its own, a value is not a number
            or a list of numbers or out of its range, the timeout is negative or not a number (or given for
            a Spark connection), or the query fails ("analysis 'NAME' failed: ...", on Spark "... failed on
            Spark: ..."); :class:`QueryLimitError` (a QueryError) when it is stopped by the timeout or the
            memory limit.
    """
    import duckdb

    from .lockdown import run_replanning

    sql = render_analysis(name, **params)
    if is_spark(con):
        if check_timeout(timeout) is not None:
            raise QueryError("timeout applies to DuckDB connections; on Spark use Spark's own job settings")
        try:
            return _frame(con.execute(sql))
        except QueryError as e:
            raise QueryError(f"analysis {name!r} failed on Spark: {e}") from None
    try:
        with limits(con, timeout):
            return run_replanning(con, lambda: _frame(con.execute(sql)))
    except duckdb.Error as e:
        raise QueryError(f"analysis {name!r} failed: {str(e).splitlines()[0]}{read_error_hint(con, e)}") from None


def run_sql(con: Connection, sql: str, *, timeout: float | None = None) -> pd.DataFrame:
    """A user's SQL; errors become one-line QueryErrors (an empty statement too). On a connection from
    :func:`connect` (either engine) the statement is checked first (read-only, sql_guard.py); ``timeout``:
    seconds before it is stopped (:func:`limits`; None: no limit; DuckDB's only, as in :func:`run_analysis`)."""
    import duckdb

    if not sql.strip().strip(";").strip():
        raise QueryError("SQL error: the query is empty")
    if is_spark(con) and check_timeout(timeout) is not None:
        raise QueryError("timeout applies to DuckDB connections; on Spark use Spark's own job settings")
    from .lockdown import run_replanning

    def once() -> pd.DataFrame | None:
        cursor = con.execute(sql)
        return None if cursor is None else _frame(cursor)

    try:
        with limits(con, timeout):
            df = run_replanning(con, once)
        if df is None:  # DuckDB runs nothing (e.g. only comments)
            raise QueryError("SQL error: the query has no statement")
        return df
    except duckdb.Error as e:
        raise QueryError(f"SQL error: {str(e).splitlines()[0]}{sql_hint(e)}{read_error_hint(con, e)}") from None


__all__ = [
    "ENGINES",
    "connect",
    "find_runs",
    "list_analyses",
    "run_analysis",
    "run_sql",
    "QueryError",
    "QueryLimitError",
    "SettingError",
    "NotReadOnly",
    "Runs",
    "open",
]


class Runs:
    """The runs under ``path`` for Python: ``entropylens.open(path)``.

        runs = entropylens.open("runs")
        runs.sql("SELECT run, avg(entropy) FROM tokens GROUP BY run")          # pandas
        runs.sql("SELECT ...", polars=True)                                     # polars (from DuckDB's Arrow)
        runs.analysis("clip_by_quadrant", polars=True)                          # an analysis, either kind

    ``runs.con`` is the connection (:func:`connect`: read-only and locked the same way; ``runs.con.raw``
    is DuckDB's own, unchecked). A statement that writes (COPY, CREATE, ATTACH, SET, ...) is a one-line
    QueryError, so a dashboard may pass a user's SQL to :meth:`sql`. ``timeout``: seconds a query may run
    (default None: no limit; each call may pass its own), ``memory_limit``: DuckDB's, e.g. ``"4GB"`` or
    ``"50%"`` (set at connect). polars is optional
    (``pip install polars``); DuckDB hands its result over as an Arrow table, which polars takes without
    copying (no detour through pandas)."""

    def __init__(
        self,
        path,
        *,
        runs: list[str] | None = None,
        timeout: float | None = None,
        memory_limit: str | None = None,
        **connect_kwargs,
    ):
        self.path = path
        self.timeout = check_timeout(timeout)
        if memory_limit is not None:
            connect_kwargs["settings"] = {**(connect_kwargs.get("settings") or {}), "memory_limit": memory_limit}
        self.con = connect(path, runs=runs, **connect_kwargs)

    def _timeout(self, timeout):
        return self.timeout if timeout is None else check_timeout(timeout)

    def sql(self, query: str, *, polars: bool = False, timeout: float | None = None):
        """A read-only query's result: a pandas DataFrame, or a polars one with ``polars=True``. A statement
        that is not read-only is refused before it runs; ``timeout`` (seconds; 0: none) stops it
        (QueryLimitError)."""
        t = self._timeout(timeout)
        return _result(self.con, query, polars, lambda: run_sql(self.con, query, timeout=t), timeout=t)

    def analysis(self, name: str, *, polars: bool = False, timeout: float | None = None, **params):
        """Analysis ``name`` (analyses/<name>.sql) with its parameters: pandas, or polars."""
        t = self._timeout(timeout)
        return _result(
            self.con,
            render_analysis(name, **params),
            polars,
            lambda: run_analysis(self.con, name, timeout=t, **params),
            what=f"analysis {name!r}",
            timeout=t,
        )

    def __repr__(self) -> str:
        return f"entropylens.open({self.path!r})"


def _result(con, sql: str, polars: bool, as_pandas, what: str = "SQL", timeout: float | None = None):
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
        with limits(con, timeout):
            return run_replanning(con, lambda: pl.from_arrow(con.sql(sql).to_arrow_table()))
    except duckdb.Error as e:
        prefix = "SQL error" if what == "SQL" else f"{what} failed"
        more = sql_hint(e) if what == "SQL" else ""
        raise QueryError(f"{prefix}: {str(e).splitlines()[0]}{more}{read_error_hint(con, e)}") from None


def open(path, *, runs: list[str] | None = None, **connect_kwargs) -> Runs:  # noqa: A001 - entropylens.open
    """The runs under ``path`` (see :class:`Runs`): ``.sql(...)`` and ``.analysis(...)`` as pandas or polars.

    Args:
        path: a run directory, a directory of runs, or any directory above them, locally or an object-store
            URL (as :func:`connect`).
        runs: only these runs (run ids, or run directory names); None (default): every run found.
        **connect_kwargs: ``timeout`` (seconds a query may run; default None: no limit; each call may pass its
            own), ``memory_limit`` (DuckDB's, e.g. ``"4GB"`` or ``"50%"``, set at connect), and the other
            keyword arguments of :func:`connect` (database, storage_options, lock, settings, raw, tau).

    Returns:
        A :class:`Runs`: ``.sql(query)``, ``.analysis(name, **params)``, ``.con`` (the connection).

    Raises:
        QueryError: as :func:`connect`, and when timeout is negative or not a number.
    """
    return Runs(path, runs=runs, **connect_kwargs)
