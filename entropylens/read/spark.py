"""The same analyses on Spark: views equal to query.py's DuckDB views, analyses translated by sqlglot.

DuckDB stays canonical. This engine builds the Spark temporary views ``runs``, ``steps``,
``sequences``, ``tokens`` (and ``probes``) with the same rules as :func:`entropylens.read.query.connect`:
the files are the ones catalog.py selects (a step's token / sequence rows only once its steps file
exists, unreadable files skipped with an UnreadableFileWarning, compacted files in place of the
originals of the steps they cover); a ``run`` column per run; files unioned by name (a column a
file lacks reads as NULL); ``step`` INT and ``rank`` SMALLINT (from the Hive path, or stored in
compacted files); the derived columns of schema.py (prob = exp(old_logprob), ratio =
exp(logprob - old_logprob), entropy_ratio = (entropy + 1e-8) / (old_entropy + 1e-8)) computed in the
view; ``runs`` from each run.json (query.run_row). An analysis (``analyses/NAME.sql``, parameters
filled in by query.render_analysis) is translated DuckDB -> Spark by
:func:`entropylens.read.portable.to_spark`. ``s3://`` URLs are read by Spark as ``s3a://``.

Python API: the one contract of query.py, with ``engine="spark"``::

    from entropylens import connect, run_analysis
    con = connect("runs/", engine="spark")                    # a SparkConnection (duck-typed like DuckDB's)
    df = run_analysis(con, "entropy_by_step")                 # pandas DataFrame, as on DuckDB

pyspark is imported lazily (``entropylens --help`` stays fast). The session is the active one if a
cluster (or RayDP's ``raydp.init_spark``) started it, otherwise a local one
(``ENTROPYLENS_SPARK_MASTER``, default ``local[*]``); see docs/spark.md.
"""

from __future__ import annotations

import os
import shutil
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..schema import TABLES, changed_meaning
from . import catalog as cat
from .portable import to_spark
from .query import PARTITIONED, QueryError, UnreadableFileWarning, find_runs, render_analysis, run_row
from .query import run_analysis as query_run_analysis
from .sql_guard import check_read_only

if TYPE_CHECKING:
    import pandas as pd

    from .query import Connection

_SPARK_TYPES = {
    "int8": "TINYINT",
    "int16": "SMALLINT",
    "int32": "INT",
    "int64": "BIGINT",
    "float32": "FLOAT",
    "float64": "DOUBLE",
    "bool": "BOOLEAN",
    "string": "STRING",
    "dict8": "STRING",
}
_PART_TYPES = {"step": "INT", "rank": "SMALLINT"}  # query.py's hive_types

# A local session's settings: no web UI, few shuffle partitions (the data of one machine), UTC.
LOCAL_CONF = {
    "spark.ui.enabled": "false",
    "spark.ui.showConsoleProgress": "false",
    "spark.sql.shuffle.partitions": "8",
    "spark.sql.session.timeZone": "UTC",
    "spark.sql.execution.arrow.pyspark.enabled": "true",
    "spark.sql.parquet.mergeSchema": "true",
}


class SparkUnavailable(QueryError):
    """pyspark or Java is missing, or the session did not start (one line for the CLI)."""


def _import_pyspark():
    try:
        import pyspark  # noqa: F401
        from pyspark.sql import SparkSession
    except ImportError:
        raise SparkUnavailable("the Spark engine needs pyspark: pip install 'entropylens[spark]'") from None
    return SparkSession


def _java_available() -> bool:
    home = os.environ.get("JAVA_HOME")
    if home and (Path(home) / "bin" / "java").exists():
        return True
    return shutil.which("java") is not None


def session(master: str | None = None, conf: dict | None = None):
    """The active SparkSession, or a new local one (``master``, else $ENTROPYLENS_SPARK_MASTER, else
    ``local[*]``) with :data:`LOCAL_CONF` plus ``conf``. A one-line SparkUnavailable if it cannot start."""
    SparkSession = _import_pyspark()
    active = SparkSession.getActiveSession()
    if active is not None:
        return active
    if not _java_available():
        raise SparkUnavailable("the Spark engine needs Java 17+ (no `java` on PATH and no JAVA_HOME)")
    builder = SparkSession.builder.appName("entropylens").master(
        master or os.environ.get("ENTROPYLENS_SPARK_MASTER") or "local[*]"
    )
    for k, v in {**LOCAL_CONF, **(conf or {})}.items():
        builder = builder.config(k, v)
    try:
        spark = builder.getOrCreate()
    except Exception as e:  # JAVA_GATEWAY_EXITED and friends: a JVM that would not start
        raise SparkUnavailable(
            f"Spark did not start: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
        ) from None
    spark.sparkContext.setLogLevel("ERROR")
    return spark


# ---------------------------------------------------------------- views
def spark_url(url: str) -> str:
    """A catalog URL as Spark's Hadoop filesystems name it: s3:// -> s3a:// (hadoop-aws)."""
    return "s3a://" + url[len("s3://") :] if url.startswith("s3://") else url


def _read_files(spark, run: cat.RunFiles, table: str):
    """One run's files of ``table`` that the DuckDB view reads (catalog.py chose them: committed
    steps only, bad files skipped, compacted files instead of the originals they replace), as one
    DataFrame with step INT and rank SMALLINT; None without files."""
    from functools import reduce

    frames = []
    hive = run.files.get(table)
    if hive:  # step / rank from the Hive path, as read_parquet(hive_partitioning = true)
        base = spark_url(str(run.dir / table))
        frames.append(spark.read.option("basePath", base).option("mergeSchema", "true").parquet(*map(spark_url, hive)))
    compacted = run.compacted.get(table)
    if compacted:  # step / rank stored in the file
        frames.append(spark.read.option("mergeSchema", "true").parquet(*map(spark_url, compacted)))
    if not frames:
        return None
    df = reduce(lambda a, b: a.unionByName(b, allowMissingColumns=True), frames)
    casts = [f"CAST(`{c}` AS {_PART_TYPES[c]}) AS `{c}`" if c in _PART_TYPES else f"`{c}`" for c in df.columns]
    return df.selectExpr(*casts)


def _with_derived(df, table: str, schema_version=None):
    """Add schema.py's derived columns the files lack (NULL where an input is missing too) and the stored
    ones they lack (NULL), and null the columns whose meaning changed since the run's ``schema_version``
    (schema.changed_meaning), as query.py does."""
    import re

    have = set(df.columns)
    old = set(changed_meaning(table, schema_version)) & have
    types = {c.name: c.dtype for c in TABLES.get(table, ())}
    exprs = [f"CAST(NULL AS {_SPARK_TYPES[types[c]]}) AS `{c}`" if c in old else f"`{c}`" for c in df.columns]
    for c in TABLES.get(table, ()):
        if c.name in have or c.name in ("step", "rank"):
            continue
        if c.derived:
            inputs = set(re.findall(r"[a-z_]+", c.derived)) - {"exp", "e"}
            expr = c.derived if inputs <= have else "NULL"
        else:
            expr = "NULL"
        exprs.append(f"CAST({expr} AS {_SPARK_TYPES[c.dtype]}) AS `{c.name}`")
    return df.selectExpr(*exprs)


def _empty(spark, table: str):
    cols = "".join(f", CAST(NULL AS {_SPARK_TYPES[c.dtype]}) AS `{c.name}`" for c in TABLES.get(table, ()))
    return spark.sql(f"SELECT CAST(NULL AS STRING) AS run{cols} WHERE false")


def _coerce(value, dtype: str):
    """A run.json value as the column's Python type, or None (DuckDB's CAST of the same value)."""
    if value is None:
        return None
    try:
        if dtype.startswith("int"):
            return int(value)
        if dtype.startswith("float"):
            return float(value)
        if dtype == "bool":
            return bool(value)
        return value if isinstance(value, str) else str(value)
    except (TypeError, ValueError):
        return None


def _runs_df(spark, infos: list[dict]):
    from pyspark.sql import types as T

    kinds = {
        "int8": T.ByteType(),
        "int16": T.ShortType(),
        "int32": T.IntegerType(),
        "int64": T.LongType(),
        "float32": T.FloatType(),
        "float64": T.DoubleType(),
        "bool": T.BooleanType(),
        "string": T.StringType(),
        "dict8": T.StringType(),
    }
    cols = list(TABLES["runs"])
    schema = T.StructType(
        [T.StructField(c.name, kinds[c.dtype], True) for c in cols] + [T.StructField("path", T.StringType(), True)]
    )
    rows = [tuple(_coerce(i.get(c.name), c.dtype) for c in cols) + (i.get("path"),) for i in infos]
    return spark.createDataFrame(rows, schema)


class _Result:
    """A Spark result shaped like a DuckDB one: ``df()``, ``fetchall()``, ``fetchone()``, ``description``."""

    def __init__(self, df):
        self._df = df

    @property
    def description(self):
        return [(f.name, f.dataType.simpleString().upper(), None, None, None, None, None) for f in self._df.schema]

    def _run(self, fn):
        try:
            return fn()
        except Exception as e:  # errors at execution time (ANSI overflow, unreadable file, ...)
            raise QueryError(f"Spark SQL error: {_one_line(e)}") from None

    def df(self):
        with warnings.catch_warnings():  # pyspark's notes about pandas 3 (FutureWarning, Pandas4Warning)
            warnings.filterwarnings("ignore", module=r"pyspark\.")
            warnings.filterwarnings("ignore", message="PySpark does not yet fully support pandas")
            return self._run(self._df.toPandas)

    def fetchall(self):
        return [tuple(r) for r in self._run(self._df.collect)]

    def fetchone(self):
        rows = self._run(self._df.limit(1).collect)
        return tuple(rows[0]) if rows else None


class SparkConnection:
    """Spark views over the runs under a path. ``execute(duckdb_sql)`` translates and runs SQL, so
    ``query.run_analysis(con, name)`` / ``query.run_sql`` and report/build.py work unchanged."""

    def __init__(self, spark, path, runs: list[str] | None = None, storage_options: dict | None = None):
        from functools import reduce

        from pyspark.sql import functions as F

        self.spark = spark.newSession()  # its own temporary views; shares the SparkContext
        self.spark.conf.set("spark.sql.session.timeZone", "UTC")
        snap = cat.scan(path, runs, storage_options=storage_options)  # the same snapshot rules as DuckDB
        for f, why in snap.bad:
            warnings.warn(f"skipped {f}: {why}", UnreadableFileWarning, stacklevel=3)
        _runs_df(self.spark, [run_row(r.info, r.id, str(r.dir)) for r in snap.runs]).createOrReplaceTempView("runs")
        for table in sorted(set(PARTITIONED) | set(snap.tables())):
            frames = []
            for r in snap.runs:
                df = _read_files(self.spark, r, table)
                if df is not None:
                    df = _with_derived(df, table, r.info.get("schema_version"))
                    frames.append(df.select(F.lit(r.id).alias("run"), *[F.col(f"`{c}`") for c in df.columns]))
            view = (
                reduce(lambda a, b: a.unionByName(b, allowMissingColumns=True), frames)
                if frames
                else _empty(self.spark, table)
            )
            view.createOrReplaceTempView(table)

    def sql(self, spark_sql: str):
        """Spark SQL over the views (a Spark DataFrame)."""
        return self.spark.sql(spark_sql)

    def execute(self, sql: str) -> _Result:
        """DuckDB SQL in the portable subset, translated to Spark; errors as one-line QueryErrors. The
        statement must be read-only, as on a DuckDB connection (sql_guard.py)."""
        check_read_only(sql)
        try:
            translated = to_spark(sql)
        except ValueError as e:
            raise QueryError(str(e)) from None
        try:
            return _Result(self.spark.sql(translated))
        except Exception as e:  # AnalysisException, ParseException, ...
            raise QueryError(f"Spark SQL error: {_one_line(e)}") from None


def _one_line(e: Exception) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:300] if text else type(e).__name__


def connect(
    path: str | os.PathLike[str],
    *,
    runs: list[str] | None = None,
    spark: Any = None,
    storage_options: dict | None = None,
) -> SparkConnection:
    """Spark views runs / steps / sequences / tokens (/ probes) over the runs under ``path`` (see
    module doc); ``spark``: a session to use (default: :func:`session`). ``entropylens.connect(path,
    engine="spark")`` calls this."""
    if spark is None:
        find_runs(path, runs, storage_options)  # a bad path is a one-line error before any JVM starts
        spark = session()
    return SparkConnection(spark, path, runs, storage_options)


def run_analysis(
    con: Connection | str | os.PathLike[str], name: str, *, timeout: float | None = None, **params: Any
) -> pd.DataFrame:
    """:func:`entropylens.read.query.run_analysis`: analyses/<name>.sql on a connection from
    ``connect(path, engine="spark")`` (or DuckDB's), a pandas DataFrame.

    Deprecated: a path in place of the connection (``run_analysis("runs/", name, runs=..., spark=...,
    storage_options=...)``) still connects to Spark and runs it, with a DeprecationWarning; it goes in the
    next release. Use ``run_analysis(connect(path, engine="spark", ...), name)``."""
    if isinstance(con, (str, os.PathLike)):
        warnings.warn(
            "entropylens.read.spark.run_analysis(PATH, ...) is deprecated: use "
            "run_analysis(connect(PATH, engine='spark'), name) (entropylens.connect / entropylens.run_analysis)",
            DeprecationWarning,
            stacklevel=2,
        )
        opts = {k: params.pop(k) for k in ("runs", "spark", "storage_options") if k in params}
        render_analysis(name, **params)  # unknown analysis / bad parameter before Spark starts
        con = connect(con, **opts)
    return query_run_analysis(con, name, timeout=timeout, **params)


__all__ = ["SparkConnection", "SparkUnavailable", "connect", "run_analysis", "session"]
