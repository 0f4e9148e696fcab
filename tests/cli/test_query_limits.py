"""`entropylens query` and `analyze` stop at --timeout and --memory-limit (safe defaults: 300 s, 50% of
RAM) with one line that names the limit that was hit and what to pass instead, exit 2."""

import pytest
from cli_calls import err, ok, runner
from entropylens.cli.main import app
from fixture_runs import build


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return build(tmp_path_factory.mktemp("limits") / "runs")


def test_timeout_stops_a_query_that_would_run_for_hours(runs):
    line = err("query", runs, "SELECT count(*) FROM range(1e12::BIGINT)", "--timeout", "0.5")
    assert line == "error: query stopped: --timeout 0.5 s reached; pass --timeout 0 for no limit"


def test_memory_limit_stops_a_big_aggregation(runs):
    line = err("query", runs, "SELECT count(DISTINCT range) FROM range(5e7::BIGINT)", "--memory-limit", "10MB")
    assert line.startswith("error: query stopped: --memory-limit 10MB (9.5 MiB) reached: ")
    assert line.endswith("; pass a larger --memory-limit, e.g. 80%")


def test_memory_limit_of_an_analysis(runs):
    line = err("analyze", runs, "run_summary", "--memory-limit", "300KB")
    assert line.startswith("error: query stopped: --memory-limit 300KB") and "reached" in line


def test_a_limit_too_small_to_set_is_one_line(runs):
    """Below what connecting already holds DuckDB cannot even set the limit: the same one line."""
    line = err("query", runs, "SELECT 1 AS x", "--memory-limit", "1KB")
    assert line.startswith("error: query stopped: --memory-limit 1KB reached: Failed to change memory limit")


def test_bad_limits_are_named(runs):
    assert "--memory-limit 'lots'" in err("query", runs, "SELECT 1", "--memory-limit", "lots")
    assert "--timeout" in err("query", runs, "SELECT 1", "--timeout", "-1")
    assert "--timeout" in err("analyze", runs, "kl_by_step", "--timeout", "soon")


def test_within_the_limits_the_answer_is_unchanged(runs):
    """The defaults and explicit limits (0: no timeout) give the same answer as before."""
    plain = ok("query", runs, "SELECT count(*) AS n FROM tokens", "-f", "csv")
    assert (
        plain
        == ok("query", runs, "SELECT count(*) AS n FROM tokens", "-f", "csv", "--timeout", "0", "--memory-limit", "1GB")
        == "n\n16\n"
    )
    assert ok("analyze", runs, "kl_by_step", "--timeout", "60", "--memory-limit", "25%") == ok(
        "analyze", runs, "kl_by_step"
    )


def test_help_states_the_defaults():
    for command in ("query", "analyze"):
        text = " ".join(runner.invoke(app, [command, "--help"]).stdout.split())
        assert "--timeout" in text and "--memory-limit" in text and "default 300" in text and "50% of RAM" in text


def test_a_percentage_means_the_same_on_a_duckdb_that_takes_none(runs, monkeypatch):
    """DuckDB 1.x (Python 3.10's last) refuses '50%'; entropylens then sets that share of the machine's memory
    in MiB, which this DuckDB 2 reads as it reads '50%' itself (within a MiB of rounding)."""
    import duckdb

    from entropylens.read import memory

    con = duckdb.connect()

    def read(size):
        con.execute("SET memory_limit = ?", [size])
        return con.execute("SELECT current_setting('memory_limit')").fetchone()[0]

    assert memory.takes_percent()  # this DuckDB reads percentages: sizes pass through unchanged
    assert memory.memory_limit("50%") == "50%" and memory.memory_limit("4GB") == "4GB"
    monkeypatch.setattr(memory, "takes_percent", lambda: False)  # as DuckDB 1.x answers
    mib = memory.memory_limit("50%")
    assert mib.endswith("MiB") and memory.memory_limit(" 12.5 % ").endswith("MiB")
    assert read(mib) == read("50%")  # e.g. '11.7 GiB' both
    assert memory.memory_limit("4GB") == "4GB" and memory.memory_limit("lots") == "lots"
    out = ok("query", runs, "SELECT current_setting('memory_limit') AS m", "--memory-limit", "50%")
    assert read("50%") in out
