"""The Python API is as read-only as `entropylens query`: `entropylens.open(PATH).sql`, `connect(PATH).sql` /
`.execute` / `.query` and the analyses refuse every statement that writes or changes the session (the
write attempts of docs/security.md), with one line, and leave every file of the runs byte-identical;
`connect(PATH, raw=True)` / `.raw` is the named escape hatch; `timeout=` and `memory_limit=` stop a query
with a QueryLimitError that names the limit."""

import hashlib
import os
import shutil
from pathlib import Path

import duckdb
import pandas as pd
import pytest
from fixture_runs import build

import entropylens
from entropylens.read.query import QueryError, QueryLimitError, connect, run_sql
from entropylens.read.sql_guard import ReadOnlyConnection

DUCKDB_1 = duckdb.__version__.startswith("1.")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    return build(tmp_path_factory.mktemp("guard") / "runs")


def _digest(root: Path) -> dict:
    return {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.rglob("*")) if p.is_file()}


def _writes(runs: Path, tmp: Path) -> list[tuple[str, str]]:
    """(SQL, the word its refusal names): each would change a run's file or the session if it ran."""
    tok = runs / "a" / "tokens" / "step=0" / "rank=0" / "update-0.parquet"
    steps = runs / "a" / "steps" / "step=0" / "rank=0" / "steps.parquet"
    return [
        (f"COPY (SELECT 1 AS x) TO '{tok}' (FORMAT parquet, USE_TMP_FILE false)", "COPY"),
        (f"COPY (SELECT * FROM steps WHERE false) TO '{steps}' (FORMAT parquet)", "COPY"),
        (f"WITH a AS (COPY (SELECT 1 AS x) TO '{tok}' (FORMAT parquet, USE_TMP_FILE false)) SELECT 1", "COPY"),
        (f"EXPLAIN ANALYZE COPY (SELECT 1 AS x) TO '{tok}' (FORMAT parquet)", "COPY"),
        ("WITH d AS (DELETE FROM steps RETURNING *) SELECT count(*) FROM d", "DELETE"),
        ("WITH i AS (INSERT INTO steps BY NAME SELECT 0 AS step RETURNING *) SELECT 1", "INSERT"),
        ("WITH u AS (UPDATE steps SET step = 7 RETURNING *) SELECT 1", "UPDATE"),
        ("UPDATE steps SET step = 7", "UPDATE"),
        (f"ATTACH '{tmp / 'x.db'}' AS x", "ATTACH"),
        ("DROP VIEW tokens", "DROP"),
        ("CREATE OR REPLACE VIEW tokens AS SELECT 1 AS x", "CREATE"),
        ("CREATE TEMP TABLE t AS SELECT 1 AS x", "CREATE"),
        ("SET threads = 1", "SET"),
        ("INSTALL httpfs", "INSTALL"),
        ("LOAD httpfs", "LOAD"),
        ("PRAGMA enable_profiling", "PRAGMA enable_profiling"),
        ("SELECT 1; DROP VIEW tokens", "2 statements"),
    ]


def _entry_points(runs: Path):
    """name -> a function running SQL through one door of the Python API."""
    opened = entropylens.open(runs)
    con = connect(runs)
    unlocked = connect(runs, lock=False)
    return {
        "open().sql": opened.sql,
        "open().sql(polars=True)": lambda q: opened.sql(q, polars=True),
        "connect().sql": lambda q: con.sql(q).fetchall(),
        "connect().execute": lambda q: con.execute(q).fetchall(),
        "connect().query": lambda q: con.query(q).fetchall(),
        "connect().cursor().execute": lambda q: con.cursor().execute(q).fetchall(),
        "run_sql(connect())": lambda q: run_sql(con, q),
        "connect(lock=False).execute": lambda q: unlocked.execute(q).fetchall(),
    }, (opened, con, unlocked)


def test_every_write_attempt_is_refused_through_every_door(runs, tmp_path):
    """Each write attempt through each door: a one-line QueryError naming the statement, and afterwards
    every file of the runs byte-identical, no file created, and the views answer as before."""
    doors, conns = _entry_points(runs)
    before = _digest(runs)
    count = "SELECT count(*) AS n FROM tokens"
    assert doors["open().sql"](count)["n"].tolist() == [16]
    for name, run in doors.items():
        for sql, word in _writes(runs, tmp_path):
            # DuckDB 1.x (Python 3.10's) parses no writing statement as a CTE body: its parser refuses it first
            # (through DuckDB's own methods, its own ParserException, as for any syntax error there)
            parser_first = DUCKDB_1 and sql.startswith("WITH")
            with pytest.raises((QueryError, duckdb.ParserException) if parser_first else QueryError) as e:
                run(sql)
            msg = str(e.value)
            assert "\n" not in msg, (name, sql, msg)
            if not (parser_first and "Parser Error" in msg):
                assert word in msg, (name, sql, msg)
                assert "read-only" in msg or "statements" in msg, (name, sql, msg)
    assert _digest(runs) == before
    assert not (tmp_path / "x.db").exists()
    for name, run in doors.items():  # the session is unchanged too: every door still reads 16 token rows
        out = run(count)
        n = out["n"].to_list()[0] if hasattr(out, "columns") else out[0][0]
        assert n == 16, name


def test_analyses_take_numbers_only(runs):
    """Analyses are fixed files; a parameter is a number or a list of numbers, so a value cannot carry
    SQL (it is refused before any SQL runs)."""
    opened = entropylens.open(runs)
    before = _digest(runs)
    for value in ("1) TO 'x.parquet'; --", "10; DROP VIEW tokens", "(COPY (SELECT 1) TO 'y')", "[1, 2]); DROP"):
        with pytest.raises(QueryError, match="not a number"):
            opened.analysis("drift_by_prob_bin", bins=value)
    assert _digest(runs) == before
    assert opened.analysis("drift_by_prob_bin", bins=4).shape[0] > 0


def test_register_and_append_cannot_replace_the_views(runs):
    """A DataFrame registered as `tokens` would replace the view, and `append` adds rows to `steps`:
    both are refused; registering one's own data under a new name and joining it works."""
    con = connect(runs)
    df = pd.DataFrame({"run": ["a"], "note": ["mine"]})
    with pytest.raises(QueryError, match="already has a table or view"):
        con.register("tokens", df)
    with pytest.raises(QueryError, match="read-only"):
        con.append("steps", df)
    with pytest.raises(QueryError, match="read-only"):
        con.install_extension("httpfs")
    with pytest.raises(QueryError, match="only a name registered"):
        con.unregister("tokens")
    con.register("notes", df)
    assert con.execute("SELECT count(*) FROM tokens JOIN notes USING (run)").fetchall() == [(12,)]
    con.unregister("notes")
    assert con.execute("SELECT count(*) FROM tokens").fetchone() == (16,)


def test_raw_is_the_named_escape_hatch(runs, tmp_path):
    """connect(raw=True) and .raw are DuckDB's own connection: statements that the guard refuses run
    there. On a copy of the runs, the COPY the guard refused does overwrite a token file: the hash check
    above would see it."""
    con = connect(runs)
    assert isinstance(con, ReadOnlyConnection) and isinstance(con.raw, duckdb.DuckDBPyConnection)
    assert isinstance(entropylens.open(runs).con, ReadOnlyConnection)
    con.raw.execute("CREATE TEMP TABLE scratch AS SELECT 1 AS x")
    assert con.execute("SELECT x FROM scratch").fetchone() == (1,)  # reading it through the guard is fine
    copy = tmp_path / "copy"
    shutil.copytree(runs, copy)
    own = copy / "a" / "tokens" / "step=0" / "rank=0" / "update-0.parquet"
    before = _digest(copy)
    raw = connect(copy, raw=True)
    assert isinstance(raw, duckdb.DuckDBPyConnection)
    raw.execute(f"COPY (SELECT 1 AS x) TO '{own}' (FORMAT parquet, USE_TMP_FILE false)")
    assert _digest(copy)[own] != before[own]


def test_lock_false_reads_other_files_and_stays_read_only(runs, tmp_path):
    """lock=False is how a user joins their own files (the CLI's help says so): reading them works,
    writing them does not."""
    con = connect(runs, lock=False)
    assert con.execute(f"SELECT count(*) FROM read_text('{os.__file__}')").fetchone() == (1,)
    target = tmp_path / "out.csv"
    with pytest.raises(QueryError, match="COPY"):
        con.execute(f"COPY (SELECT 1) TO '{target}'")
    assert not target.exists()


def test_timeout_stops_a_query_and_names_the_limit(runs):
    """timeout= stops a query DuckDB would run for hours (a timer interrupts it); the connection answers
    the next query. Without a timeout the same connection still runs to the end."""
    opened = entropylens.open(runs)
    with pytest.raises(QueryLimitError) as e:
        opened.sql("SELECT count(*) FROM range(1e12::BIGINT)", timeout=0.5)
    assert str(e.value) == "query stopped: timeout=0.5 s reached; pass timeout=0 for no limit"
    assert e.value.limit == "timeout" and e.value.value == 0.5
    assert opened.sql("SELECT count(*) AS n FROM tokens")["n"].tolist() == [16]
    with pytest.raises(QueryLimitError, match="timeout=0.5 s"):
        run_sql(connect(runs), "SELECT count(*) FROM range(1e12::BIGINT)", timeout=0.5)
    default = entropylens.open(runs, timeout=0.5)  # a default for every call, and a call's own
    with pytest.raises(QueryLimitError, match="timeout=0.5 s"):
        default.sql("SELECT count(*) FROM range(1e12::BIGINT)", polars=True)
    assert default.sql("SELECT count(*) AS n FROM range(1000)", timeout=0)["n"].tolist() == [1000]
    with pytest.raises(QueryError, match="timeout -1"):
        opened.sql("SELECT 1", timeout=-1)


def test_memory_limit_stops_a_query_and_names_the_limit(runs):
    """memory_limit= (DuckDB's, set at connect) stops an aggregation that needs more, spilling included,
    with the limit as DuckDB reads it."""
    small = entropylens.open(runs, memory_limit="10MB")
    with pytest.raises(QueryLimitError) as e:
        small.sql("SELECT count(DISTINCT range) FROM range(5e7::BIGINT)")
    assert str(e.value).startswith("query stopped: memory_limit 9.5 MiB reached (")
    assert e.value.limit == "memory_limit"
    with pytest.raises(QueryLimitError, match="memory_limit 9.5 MiB"):
        small.sql("SELECT list(range) FROM range(5e7::BIGINT)")
    assert small.sql("SELECT count(*) AS n FROM tokens")["n"].tolist() == [16]
