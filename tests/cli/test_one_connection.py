"""A command opens one connection to the runs (#40): no throwaway connection to check the path or the
--memory-limit first. Counted by wrapping duckdb.connect with a function that counts and calls through
(the real connections, the real answers)."""

import duckdb
import pytest
from cli_calls import err, ok
from fixture_runs import build


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return build(tmp_path_factory.mktemp("one-connection") / "runs")


@pytest.fixture
def connects(monkeypatch):
    """The duckdb.connect calls made while the test runs (each a list of its arguments)."""
    from entropylens.read import memory, sql_guard

    sql_guard._parser()  # the statement checker's parser (one per thread, cached) and the probe of
    memory.takes_percent()  # whether DuckDB reads '50%' (cached): made once per process, not per command
    calls: list[tuple] = []
    real = duckdb.connect

    def counting(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(duckdb, "connect", counting)
    return calls


COMMANDS = {
    "runs": ["runs", "{runs}"],
    "query": ["query", "{runs}", "SELECT count(*) AS n FROM tokens"],
    "analyze": ["analyze", "{runs}", "kl_by_step"],
    "analyze --tau": ["analyze", "{runs}", "clip_by_quadrant", "--tau", "0.5"],
    "report": ["report", "{runs}", "--out", "{out}", "--responses", "2"],
    "check": ["check", "{runs}"],
    "show": ["show", "{runs}", "--run", "a"],
}


@pytest.mark.parametrize("command", COMMANDS)
def test_a_command_opens_one_connection(runs, tmp_path, connects, command):
    args = [a.format(runs=runs, out=tmp_path / "report") for a in COMMANDS[command]]
    ok(*args)
    assert len(connects) == 1, (command, connects)


def test_check_at_another_tau_opens_two(runs, connects):
    """`check --tau`: the alarms read the steps as recorded (step_health's za_frac is a per-quadrant count,
    which a re-split recomputes), the notes the views split at --tau: two views, so two connections."""
    ok("check", runs, "--tau", "0.5")
    assert len(connects) == 2


def test_a_bad_memory_limit_is_named_by_the_one_connection(runs, connects):
    line = err("query", runs, "SELECT 1", "--memory-limit", "lots")
    assert line.startswith("error: --memory-limit 'lots': not a size DuckDB takes (e.g. 4GB, 512MB, 50%): ")
    assert "Memory must have a number" in line
    assert len(connects) == 1
    assert err("analyze", runs, "kl_by_step", "--memory-limit", "lots") == line


def test_a_missing_path_opens_none(tmp_path, connects):
    for command in (["runs"], ["report", "--out", str(tmp_path / "r")], ["check"], ["analyze"]):
        extra = ["kl_by_step"] if command == ["analyze"] else []
        line = err(command[0], tmp_path / "missing", *extra, *command[1:])
        assert "does not exist" in line, line
    assert connects == []
