"""Object storage (S3 protocol) end to end against moto's real S3 server on loopback: the writer,
the readers (DuckDB through an fsspec filesystem, no httpfs), partition pruning, bad objects, a
recording process killed with SIGKILL, the CLI, compaction, and the torch example."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

sys.path.insert(0, str(Path(__file__).parent / "helpers"))
from entropylens.cli.main import app  # noqa: E402
from layout_run import make_run, write_step  # noqa: E402

from entropylens import storage  # noqa: E402
from entropylens.read.compact import compact  # noqa: E402
from entropylens.read.query import connect, run_analysis  # noqa: E402

HELPERS = Path(__file__).parent / "helpers"
EXAMPLES = Path(__file__).parent.parent / "examples"
runner = CliRunner()


def _keys(url: str) -> list[str]:
    loc = storage.location(url)
    return sorted(loc.files())


def test_writer_and_reader_on_s3(s3):
    url = s3()
    make_run(url, "a", steps=4, rows=64, ranks=2)
    keys = _keys(url)
    assert f"{url[5:]}/a/tokens/step=3/rank=1/update-0.parquet" in keys
    assert not any("/." in k for k in keys)  # no temporaries: one PUT per file under its final name
    con = connect(url)
    assert con.execute("SELECT count(*), count(DISTINCT step) FROM tokens").fetchone() == (4 * 2 * 64, 4)
    assert con.execute("SELECT sum(n_tokens) FROM steps").fetchone() == (4 * 2 * 64,)
    assert con.execute("SELECT path FROM runs").fetchone() == (f"{url}/a",)


def test_hive_pruning_skips_files_on_s3(s3, monkeypatch):
    url = s3()
    make_run(url, "a", steps=10, rows=32)
    con = connect(url)
    fs = storage.location(url).fs
    opened = []
    real_open = fs._open

    def counting_open(path, *a, **k):
        opened.append(path)
        return real_open(path, *a, **k)

    monkeypatch.setattr(fs, "_open", counting_open)
    assert con.execute("SELECT count(*) FROM tokens WHERE step = 3").fetchone() == (32,)
    token_files = {p for p in opened if "/tokens/" in p}
    assert f"{url[5:]}/a/tokens/step=3/rank=0/update-0.parquet" in token_files
    assert len(token_files) <= 2, token_files  # step 3 (+ the first file, for the schema), of 10
    plan = con.execute("EXPLAIN ANALYZE SELECT count(*) FROM tokens WHERE step = 3").fetchall()[0][1]
    assert "Scanning Files: 1/10" in plan


def test_bad_object_is_skipped_and_verify_lists_it(s3):
    url = s3()
    d = make_run(url, "a", steps=3, rows=16)
    bad = d / "tokens" / "step=1" / "rank=0" / "update-1.parquet"
    bad.write_bytes(b"PAR1 but cut")
    with pytest.warns(UserWarning, match="update-1.parquet"):
        con = connect(url)
    assert con.execute("SELECT count(*) FROM tokens").fetchone() == (48,)
    res = runner.invoke(app, ["verify", url])
    assert res.exit_code == 1 and f"bad: {bad}:" in res.stdout, res.output


@pytest.mark.slow
def test_killed_recorder_on_s3_then_runs_analyze_report(s3, tmp_path):
    url = s3()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    p = subprocess.Popen(
        [sys.executable, str(HELPERS / "record_child.py"), "kill", url, "k0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert p.stdout.readline().strip() == "ready", p.stderr.read()
        time.sleep(0.7)
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()
    assert p.returncode == -signal.SIGKILL
    con = connect(url)
    bad = con.execute("""
        SELECT s.step, s.update, s.n_tokens, coalesce(t.n, 0) FROM steps s
        LEFT JOIN (SELECT step, update, count(*) AS n FROM tokens GROUP BY ALL) t USING (step, update)
        WHERE s.n_tokens <> coalesce(t.n, 0)""").fetchall()
    assert bad == []  # every committed step is whole; no half object was ever visible
    n_steps = con.execute("SELECT count(DISTINCT step) FROM steps").fetchone()[0]
    assert n_steps >= 2
    assert con.execute("SELECT status FROM runs").fetchone()[0] in ("running", "stale")
    res = runner.invoke(app, ["runs", url])
    assert res.exit_code == 0 and "k0" in res.stdout, res.output
    res = runner.invoke(app, ["analyze", url, "entropy_by_step", "-f", "csv"])
    assert res.exit_code == 0, res.output
    assert len(res.stdout.strip().splitlines()) - 1 == n_steps
    res = runner.invoke(app, ["report", url, "--out", str(tmp_path / "rep")])
    assert res.exit_code == 0, res.output
    assert (tmp_path / "rep" / "index.html").stat().st_size > 1000


def test_compaction_on_s3_keeps_every_answer(s3):
    url = s3()
    d = make_run(url, "a", steps=8, rows=40, ranks=2)
    write_step(d, 8, 0, 40, commit=False)
    con = connect(url)
    before = {name: run_analysis(con, name) for name in ("run_summary", "clip_by_quadrant", "entropy_by_step")}
    totals = con.execute("SELECT count(*), sum(entropy)::DOUBLE FROM tokens").fetchone()
    with pytest.warns(UserWarning, match="step 8 not compacted"):  # step 8 has no steps file yet: left alone
        (res,) = compact(url, grace_s=0)
    assert res.steps == (0, 7) and res.removed >= 8 * 2 * 3
    keys = _keys(url)
    assert not any("/tokens/step=3/" in k for k in keys)
    assert any(k.endswith("compacted/steps/steps-0-7.parquet") for k in keys)
    con = connect(url)
    assert con.execute("SELECT count(*), sum(entropy)::DOUBLE FROM tokens").fetchone() == pytest.approx(totals)
    for name, df in before.items():
        import pandas as pd

        pd.testing.assert_frame_equal(run_analysis(con, name), df, check_dtype=False, obj=name)


def test_unknown_bucket_and_protocol_are_one_line_errors(s3):
    res = runner.invoke(app, ["runs", "s3://no-such-bucket/x"])
    assert res.exit_code == 2 and res.stderr.count("\n") == 1, res.output
    res = runner.invoke(app, ["runs", "nosuchproto://b/x"])
    assert res.exit_code == 2 and res.stderr.startswith("error:") and res.stderr.count("\n") == 1, res.output


@pytest.mark.slow
def test_torch_loop_example_writes_to_s3(s3):
    url = s3()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, str(EXAMPLES / "torch_loop.py"), "--out", url, "--steps", "2"],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr
    assert f"run: {url}/torch-loop-ce_gppo" in out.stdout
    con = connect(url)
    assert con.execute("SELECT count(DISTINCT step), count(*) FROM steps").fetchone() == (2, 8)
    assert con.execute("SELECT status FROM runs").fetchone() == ("finished",)


def test_any_fsspec_url_works_the_same(tmp_path):
    """Not only s3://: fsspec's in-memory filesystem goes through the same writer and readers."""
    make_run("memory://el-test/runs", "a", steps=3, rows=16)
    d = storage.location("memory://el-test/runs/a")
    (d / "tokens" / "step=1" / "rank=0" / "update-7.parquet").write_bytes(b"")
    with pytest.warns(UserWarning, match="update-7.parquet: empty"):
        con = connect("memory://el-test/runs")
    assert con.execute("SELECT count(*), count(DISTINCT step) FROM tokens").fetchone() == (48, 3)
    (res,) = compact("memory://el-test/runs", grace_s=0)
    assert res.steps == (0, 2)
    with pytest.warns(UserWarning, match="update-7.parquet: empty"):  # the empty file is still there: said again
        after = connect("memory://el-test/runs")
    assert after.execute("SELECT count(*) FROM tokens").fetchone() == (48,)
