"""`entropylens query` cannot write files. EXPLAIN is checked around what it wraps (cli/sql_guard.py),
and the connection is locked down with DuckDB's own settings once its views exist
(entropylens/read/lockdown.py), so a statement the parser lets through still cannot write or reach the network."""

import hashlib
import os
import sys
from pathlib import Path

import duckdb
import pytest
from cli_calls import err, runner
from entropylens.cli.main import app
from fixture_runs import build

from entropylens.read.query import QueryError, connect, list_analyses, run_analysis, run_sql

sys.path.insert(0, str(Path(__file__).parent.parent / "helpers"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return build(tmp_path_factory.mktemp("lock"))


# DuckDB 1.x (the last release for Python 3.10) parses neither a writing statement as a CTE body nor EXPLAIN's
# (FORMAT ...) around a COPY: its own parser refuses them, in one line, before the guard reads them. Nothing is
# written either way (the digests below). Its configuration lock also leaves PRAGMA enable_profiling on (query
# plans printed, no file: the profiling output path is a locked setting); the guard refuses it on every door.
DUCKDB_1 = duckdb.__version__.startswith("1.")


def _refused(line: str, word: str) -> bool:
    """The one-line refusal names the statement kind as read-only (or, on DuckDB 1.x, DuckDB's parser refused it)."""
    return (word in line and "read-only" in line) or (DUCKDB_1 and "Parser Error" in line)


def _digest(root: Path) -> dict:
    return {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.rglob("*")) if p.is_file()}


def test_explain_is_checked_around_what_it_wraps(runs, tmp_path):
    """EXPLAIN ANALYZE runs the statement it wraps, so EXPLAIN (with or without ANALYZE) around a writing
    statement is refused; a COPY onto a run's own steps file leaves the run's files untouched, and
    reading EXPLAINs still run."""
    own = runs / "a" / "steps" / "step=0" / "rank=0" / "steps.parquet"
    target = tmp_path / "out.csv"
    before = _digest(runs)
    for sql, word in (
        (f"EXPLAIN ANALYZE COPY (SELECT 1 AS x) TO '{target}'", "COPY"),
        (f"EXPLAIN ANALYZE COPY (SELECT * FROM steps WHERE false) TO '{own}' (FORMAT parquet)", "COPY"),
        (f"EXPLAIN (ANALYZE) COPY (SELECT 1) TO '{target}'", "COPY"),
        (f"EXPLAIN ANALYZE (FORMAT json) COPY (SELECT 1) TO '{target}'", "COPY"),
        (f"explain /* c */ analyze -- c\n COPY (SELECT 1) TO '{target}'", "COPY"),
        (f"-- lead comment\nEXPLAIN ANALYZE COPY (SELECT 1) TO '{target}'", "COPY"),
        ("EXPLAIN ANALYZE SET threads = 1", "SET"),
        ("EXPLAIN ANALYZE INSTALL httpfs", "INSTALL"),
        ("EXPLAIN ANALYZE CREATE TABLE t AS SELECT 1", "CREATE"),
        ("EXPLAIN ANALYZE PRAGMA enable_profiling", "PRAGMA enable_profiling"),
        ("EXPLAIN COPY (SELECT 1) TO 'x.csv'", "COPY"),  # the same rule with or without ANALYZE
    ):
        line = err("query", runs, sql)
        assert _refused(line, word), (sql, line)
    assert not target.exists()
    assert _digest(runs) == before  # the run's files untouched
    # nested forms DuckDB does not parse stay errors (one line), and write nothing
    err("query", runs, f"EXPLAIN EXPLAIN ANALYZE COPY (SELECT 1) TO '{target}'")
    err("query", runs, f"EXPLAIN ANALYZE ATTACH '{tmp_path / 'x.db'}'")
    assert not target.exists() and not (tmp_path / "x.db").exists()
    # reading EXPLAINs still run
    res = runner.invoke(app, ["query", str(runs), "EXPLAIN ANALYZE SELECT count(*) FROM tokens", "-f", "json"])
    assert res.exit_code == 0 and "analyzed_plan" in res.stdout, res.output
    res = runner.invoke(app, ["query", str(runs), "EXPLAIN (FORMAT json) SELECT 1"])
    assert res.exit_code == 0, res.output


def test_a_writing_cte_is_refused(runs, tmp_path):
    """DuckDB 2.0 takes COPY TO / INSERT / UPDATE / DELETE as a CTE body and classifies the statement as
    SELECT: `WITH a AS (COPY ... TO '<a run's token file>' (USE_TMP_FILE false)) SELECT 1` passed the parser
    check, and the lockdown allows the runs' own files: that step's token rows were overwritten."""
    own = runs / "a" / "tokens" / "step=0" / "rank=0" / "update-0.parquet"
    before = _digest(runs)
    for sql, word in (
        (f"WITH a AS (COPY (SELECT 1 AS x) TO '{own}' (FORMAT parquet, USE_TMP_FILE false)) SELECT 1", "COPY"),
        (
            f"WITH a AS MATERIALIZED (COPY (SELECT 1 AS x) TO '{own}' (FORMAT parquet, USE_TMP_FILE false)) SELECT 1",
            "COPY",
        ),
        (
            f"EXPLAIN ANALYZE WITH a AS (COPY (SELECT 1 AS x) TO '{own}' (FORMAT parquet, USE_TMP_FILE false)) "
            "SELECT 1",
            "COPY",
        ),
        ("WITH d AS (DELETE FROM steps RETURNING *) SELECT count(*) FROM d", "DELETE"),
        ("SELECT * FROM (WITH i AS (INSERT INTO steps BY NAME SELECT 0 AS step RETURNING *) SELECT 1)", "INSERT"),
        ("WITH s AS (SELECT 1), u AS (UPDATE steps SET step = 0 RETURNING *) SELECT 1", "UPDATE"),
    ):
        line = err("query", runs, sql)
        assert _refused(line, word), (sql, line)
    assert _digest(runs) == before
    res = runner.invoke(app, ["query", str(runs), "WITH a AS (SELECT 1 AS x) SELECT x FROM a"])
    assert res.exit_code == 0, res.output


@pytest.fixture()
def con(runs):
    return connect(runs)


def test_locked_connection_refuses_what_the_parser_would(runs, tmp_path):
    """The second layer: statements run directly on the connection (no parser check: the raw DuckDB
    connection, connect(raw=True)) cannot write files, attach databases, install or load extensions, or
    change settings back."""
    con = connect(runs, raw=True)
    own = runs / "a" / "tokens" / "step=0" / "rank=0" / "update-0.parquet"
    before = _digest(runs)
    outside = tmp_path / "x.csv"
    for sql in (
        f"COPY (SELECT 1) TO '{outside}'",
        f"COPY (SELECT 1) TO '{runs / 'new.csv'}'",
        f"ATTACH '{tmp_path / 'x.db'}' AS x",
        "INSTALL httpfs",
        "LOAD httpfs",
        "SET enable_external_access = true",
        "SET lock_configuration = false",
        "RESET allowed_paths",
        f"SET allowed_directories = ['{tmp_path}/']",
        "SET autoinstall_known_extensions = true",
        "SET threads = 1",
        *(() if DUCKDB_1 else ("PRAGMA enable_profiling",)),
        f"SELECT * FROM read_text('{os.__file__}')",  # a file outside the runs
        "SELECT * FROM read_csv('https://example.invalid/x.csv')",
    ):
        with pytest.raises(QueryError, match="disabled|locked|Permission"):
            run_sql(con, sql)
    assert not outside.exists() and not (runs / "new.csv").exists() and not (tmp_path / "x.db").exists()
    assert _digest(runs) == before and own.exists()
    settings = dict(
        con.execute(
            "SELECT name, value FROM duckdb_settings() WHERE name IN ('enable_external_access', "
            "'lock_configuration', 'autoinstall_known_extensions', "
            "'autoload_known_extensions')"
        ).fetchall()
    )
    assert settings == {
        "enable_external_access": "false",
        "lock_configuration": "true",
        "autoinstall_known_extensions": "false",
        "autoload_known_extensions": "false",
    }
    # what still works: the views, in-memory temporary tables, the progress bar switch (report/build.py)
    assert run_sql(con, "SELECT count(*) AS n FROM tokens")["n"].tolist() == [16]
    run_sql(con, "SET enable_progress_bar = false")
    assert run_sql(con, "CREATE TEMP TABLE t AS SELECT 1 AS x; SELECT x FROM t")["x"].tolist() == [1]


def test_every_analysis_runs_on_the_locked_connection(con):
    for name, _ in list_analyses():
        run_analysis(con, name)  # raises QueryError on a permission error


def test_report_runs_on_the_locked_connection(runs, tmp_path):
    res = runner.invoke(app, ["report", str(runs), "--out", str(tmp_path / "rep")])
    assert res.exit_code == 0, res.output
    assert (tmp_path / "rep" / "index.html").exists()


def test_query_help_says_what_can_be_read(runs):
    res = runner.invoke(app, ["query", "--help"])
    text = " ".join(res.stdout.split())
    assert "EXPLAIN" in text and "only the files of the runs" in text and "network" in text


def test_lockdown_keeps_s3_runs_readable_and_other_buckets_out():
    """S3 runs are read through the fsspec filesystem registered on the connection; the lockdown
    allows exactly the runs' objects: another bucket of the same endpoint is refused."""
    pytest.importorskip("moto")
    pytest.importorskip("s3fs")
    from layout_run import make_run
    from s3_server import s3_environment

    from entropylens import storage

    with s3_environment():
        fs = storage.filesystem("s3")
        fs.mkdir("lockrun")
        fs.mkdir("other")
        make_run("s3://lockrun/runs", "a", steps=2, rows=16)
        make_run("s3://other/runs", "b", steps=1, rows=16)
        c = connect("s3://lockrun/runs")
        assert c.execute("SELECT count(*) FROM tokens").fetchone() == (32,)
        assert run_analysis(c, "kl_by_step").shape[0] == 2
        with pytest.raises(QueryError, match="disabled|Permission"):
            run_sql(c, "SELECT count(*) FROM read_parquet('s3://other/runs/b/tokens/step=0/rank=0/update-0.parquet')")
        with pytest.raises(QueryError, match="disabled|Permission"):
            run_sql(c.raw, "COPY (SELECT 1) TO 's3://lockrun/runs/x.csv'")  # the lockdown, not the statement check
        assert not fs.exists("lockrun/runs/x.csv")


def test_unlocked_connection_on_request(runs):
    """The Python API can opt out (lock=False), e.g. to join the runs with a file of one's own."""
    c = connect(runs, lock=False)
    assert c.execute(f"SELECT count(*) FROM read_text('{os.__file__}')").fetchone() == (1,)


def test_settings_are_applied_before_the_lock(runs, tmp_path):
    """connect(settings=...) sets DuckDB options (a benchmark's memory limit, threads, spill folder)
    before the lock: they hold, and the locked connection still refuses to change them."""
    spill = tmp_path / "spill"
    spill.mkdir()
    c = connect(runs, settings={"threads": 1, "memory_limit": "1GB", "temp_directory": str(spill)})
    assert c.execute("SELECT current_setting('threads')").fetchone() == (1,)
    assert c.execute("SELECT current_setting('temp_directory')").fetchone()[0].rstrip("/") == str(spill)
    with pytest.raises(QueryError):
        run_sql(c, "SET threads = 2")
    with pytest.raises(QueryError, match="not a DuckDB setting name"):
        connect(runs, settings={"threads; DROP": 1})
