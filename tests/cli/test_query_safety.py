"""`entropylens query` as a process: --output never writes into a run folder, Ctrl-C stops a running query
(exit 130, one line, no traceback), and the time limit's watcher never outlives the command (a thread torn
down at the process's exit aborted it with rc 134)."""

import hashlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

sys.path.insert(0, str(Path(__file__).parent.parent / "helpers"))
from entropylens.cli.main import app  # noqa: E402
from recorded_run import record_run  # noqa: E402

runner = CliRunner()
CLI = [sys.executable, "-c", "from entropylens.cli.main import main; main()"]


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    return record_run(tmp_path_factory.mktemp("q"))


def _hashes(d: Path) -> dict:
    return {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("target", ["tokens/step=1/rank=0/update-0.parquet", "run.json", "tokens/new.csv"])
def test_output_inside_a_run_folder_is_refused(run, target):
    before = _hashes(run)
    out = run / target
    res = runner.invoke(app, ["query", str(run.parent), "SELECT 1 AS x", "--output", str(out)])
    assert res.exit_code == 2 and "is inside the run folder" in res.stderr and "Traceback" not in res.output
    assert _hashes(run) == before  # nothing written, nothing replaced


def test_output_beside_the_runs_is_written(run, tmp_path):
    res = runner.invoke(app, ["query", str(run.parent), "SELECT 1 AS x", "--output", str(tmp_path / "x.csv")])
    assert res.exit_code == 0 and (tmp_path / "x.csv").read_text().splitlines() == ["x", "1"]


def test_ctrl_c_stops_a_running_query(run):
    p = subprocess.Popen(
        [*CLI, "query", str(run), "SELECT count(*) FROM range(1000000000000)"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    time.sleep(3)  # the query is running (connect takes well under a second here)
    p.send_signal(signal.SIGINT)
    try:
        _, err = p.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        p.kill()
        pytest.fail("the query did not stop on Ctrl-C")
    assert p.returncode == 130 and "Traceback" not in err, err


def test_queries_under_the_default_time_limit_exit_cleanly(run):
    env = {**os.environ}
    for _ in range(5):
        res = subprocess.run(
            [*CLI, "query", str(run), "SELECT count(*) AS n FROM tokens", "--format", "json"],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
        )
        assert res.returncode == 0 and '"n"' in res.stdout, (res.returncode, res.stderr[-500:])
