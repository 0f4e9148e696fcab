"""`entropylens demo --quick` end to end, toy determinism, and config errors before training."""

import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest
from entropylens.cli.main import app
from typer.testing import CliRunner

from entropylens.demo.toy import config_for, train
from entropylens.read.query import connect


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo")
    res = CliRunner().invoke(app, ["demo", "--quick", "--out", str(out), "--workers", "2"])
    assert res.exit_code == 0, res.output
    assert "report:" in res.output
    assert "4 run(s) in 2 worker process(es), 1 torch thread each" in res.output
    return out


def test_demo_writes_runs_and_report(demo_dir):
    runs = sorted(p.name for p in (demo_dir / "runs").iterdir())
    assert runs == ["ce_gppo-s0", "dapo-s0", "erc_dapo-s0", "grpo-s0"]
    assert (demo_dir / "report" / "index.html").exists()
    from entropylens.report.build import FIGURES

    assert len(list((demo_dir / "report").glob("*.png"))) == len([f for f in FIGURES if not f.optional])  # no probes
    con = connect(demo_dir / "runs")
    for table in ("tokens", "steps", "sequences"):
        per_run = dict(con.execute(f"SELECT run, count(*) FROM {table} GROUP BY run").fetchall())
        assert set(per_run) == set(runs) and min(per_run.values()) > 0
    assert con.execute("SELECT DISTINCT status FROM runs").fetchall() == [("finished",)]


def test_demo_tables_are_consistent(demo_dir):
    con = connect(demo_dir / "runs")
    t = con.execute("""SELECT t.*, r.eps_low, r.eps_high, r.tau FROM tokens t JOIN runs r USING (run)""").df()
    # (ratio, prob and entropy_ratio are the views' own definitions: checked against the stored
    # decisions below, clip / clipped / quadrant / erc_kept, which the loss made on the device)
    a, p, r = t["advantage"], t["prob"], t["ratio"]
    quad = np.where(
        a == 0,
        "ZA",
        np.where(a > 0, np.where(p >= t["tau"], "PA&HP", "PA&LP"), np.where(p >= t["tau"], "NA&HP", "NA&LP")),
    )
    assert (t["quadrant"].to_numpy() == quad).all()
    clip = np.where(r < 1 - t["eps_low"], -1, np.where(r > 1 + t["eps_high"], 1, 0))
    # the loss decided clip in float32 from the same logprobs: allow float32 ties at the exact boundary
    edge = np.isclose(r, 1 - t["eps_low"], rtol=1e-6) | np.isclose(r, 1 + t["eps_high"], rtol=1e-6)
    assert ((t["clip"].to_numpy() == clip) | edge).all()
    clipped = ((clip == -1) & (a < 0)) | ((clip == 1) & (a > 0))
    assert ((t["clipped"].to_numpy() == clipped) | edge).all()
    assert (t["entropy"] >= 0).all() and (t["old_entropy"] >= 0).all()
    assert t["logit_grad_norm"].notna().all() and t["grad_coef"].notna().all()
    erc = t[t["run"] == "erc_dapo-s0"]
    assert erc["erc_kept"].notna().all()
    assert (erc["erc_kept"] == ((erc["entropy_ratio"] > 0.95) & (erc["entropy_ratio"] < 1.05))).mean() > 0.999
    # (steps aggregates against the token rows: tests/record/test_recorder.py::test_step_aggregates_equal_token_rows)
    n_upd = con.execute("SELECT count(*) FROM steps WHERE grad_norm IS NULL OR lr IS NULL").fetchone()[0]
    assert n_upd == 0


def test_toy_is_deterministic(tmp_path):
    cfg = config_for("ce_gppo", steps=1, prompts=4, group=4, minibatches=2, epochs=1, sft_steps=5, seed=3)
    a = train(cfg, tmp_path / "a", run="x")
    b = train(cfg, tmp_path / "b", run="x")
    q = "SELECT * EXCLUDE (run) FROM tokens WHERE step = 0 ORDER BY update, seq, pos"
    da, db = connect(a.path).execute(q).df(), connect(b.path).execute(q).df()
    assert len(da) > 0
    assert da.equals(db)


def test_bad_config_fails_before_training(tmp_path):
    with pytest.raises(ValueError, match="unknown run 'ppo3'"):
        config_for("ppo3")
    with pytest.raises(ValueError, match="must split into 3 mini-batches"):
        config_for("grpo", minibatches=3)
    with pytest.raises(ValueError, match="group must be >= 2"):
        config_for("grpo", group=1)
    from entropylens.demo.runner import run_demo

    with pytest.raises(ValueError, match="unknown run"):
        run_demo(tmp_path / "d", methods=("grpo", "nope"), progress=False)
    assert not (tmp_path / "d" / "runs" / "grpo-s0").exists()  # nothing trained


def test_demo_trains_runs_in_worker_processes_with_one_thread(tmp_path):
    """One intra-op thread per toy run, runs in parallel worker processes (config, not timing)."""
    import torch

    from entropylens.demo.runner import available_cores, default_workers, run_demo

    assert default_workers(4) == min(available_cores(), 4) and default_workers(1) == 1
    res = run_demo(tmp_path, methods=("grpo", "dapo"), quick=True, steps=1, workers=2, report=False, progress=False)
    assert res.workers == 2
    assert os.getpid() not in {r.pid for r in res.runs}  # trained in the worker processes (which one: scheduling)
    assert [r.threads for r in res.runs] == [1, 1]
    before = torch.get_num_threads()
    one = run_demo(tmp_path / "inproc", methods=("grpo",), quick=True, steps=1, workers=1, report=False, progress=False)
    assert one.runs[0].pid == os.getpid() and one.runs[0].threads == 1
    assert torch.get_num_threads() == before  # the caller's setting is restored
    # same seed, same results whether trained in a worker or in-process
    assert one.runs[0].rewards == res.runs[0].rewards


def test_demo_progress_lines_through_a_pipe(tmp_path):
    """Stdout is a pipe: plain progress lines arrive while the demo runs, warm-up named as such."""
    cmd = [
        sys.executable,
        "-m",
        "entropylens.cli.main",
        "demo",
        "--quick",
        "--steps",
        "2",
        "--methods",
        "grpo",
        "--workers",
        "1",
        "--out",
        str(tmp_path),
    ]
    # cwd: `python -m` puts it first on sys.path; the repository root's entropylens/ would shadow the install
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    lines, status_at_warmup = [], None
    for line in proc.stdout:
        lines.append(line.rstrip("\n"))
        if status_at_warmup is None and "supervised pre-training" in line:
            rj = tmp_path / "runs" / "grpo-s0" / "run.json"
            status_at_warmup = json.loads(rj.read_text())["status"] if rj.exists() else "not started"
            alive_at_warmup = proc.poll() is None
    assert proc.wait(timeout=600) == 0, proc.stderr.read()
    assert status_at_warmup == "not started" and alive_at_warmup  # printed live, before any RL step
    text = "\n".join(lines)
    for want in (
        "warm-up seed 0: supervised pre-training before RL",
        "grpo-s0: started (2 RL steps)",
        "grpo-s0: step 1/2",
        "grpo-s0: step 2/2",
        "grpo-s0: finished",
    ):
        assert want in text, text
    assert text.index("warm-up seed 0") < text.index("grpo-s0: step 1/2") < text.index("grpo-s0: step 2/2")
    assert "\x1b[" not in text  # no terminal control codes in a log


def test_demo_stops_quietly_when_its_reader_goes_away(tmp_path):
    """`entropylens demo | head -2`: the reader closes the pipe while the workers train. The demo stops at
    once, says nothing (no `--out DIR: Broken pipe`, no workers' tracebacks), does not hang on unread
    progress events, exits 1 (click's code for a closed pipe) and leaves no worker."""
    cmd = [sys.executable, "-m", "entropylens.cli.main", "demo", "--quick", "--workers", "2", "--out", str(tmp_path)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    for _ in range(2):
        assert proc.stdout.readline()
    proc.stdout.close()  # as head does after its lines
    try:
        code = proc.wait(timeout=240)  # a liveness bound, not a timing: the hang never returned
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError("the demo did not stop after its reader went away") from None
    assert (code, proc.stderr.read()) == (1, "")
    time.sleep(1.0)
    left = subprocess.run(["pgrep", "-f", f"entropylens.*{tmp_path}"], capture_output=True, text=True).stdout
    assert left.strip() == "", left


def test_demo_refuses_an_existing_run_then_overwrites_cleanly(tmp_path):
    """Re-running into an output directory never mixes runs: refused, or replaced with --overwrite;
    the summary and the report cover exactly the runs this demo made."""
    tiny = dict(prompts=4, group=4, minibatches=2, epochs=1, sft_steps=5)
    train(config_for("grpo", steps=3, **tiny), tmp_path / "runs", run="grpo-s0")
    train(config_for("dapo", steps=3, **tiny), tmp_path / "runs", run="dapo-s0")  # an older neighbour
    runner = CliRunner()
    args = ["demo", "--quick", "--methods", "grpo", "--steps", "2", "--workers", "1", "--out", str(tmp_path)]
    res = runner.invoke(app, args)
    assert res.exit_code == 2
    lines = [x for x in res.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and "already holds run(s) grpo-s0" in lines[0] and "--overwrite" in lines[0]
    con = connect(tmp_path / "runs", runs=["grpo-s0"])
    assert con.execute("SELECT count(DISTINCT step) FROM steps").fetchone()[0] == 3  # untouched
    res = runner.invoke(app, [*args, "--overwrite"])
    assert res.exit_code == 0, res.output
    table = res.stdout.split("runs:")[0]
    assert "grpo-s0" in table and "dapo-s0" not in table
    con = connect(tmp_path / "runs")
    steps = dict(con.execute("SELECT run, count(DISTINCT step) FROM steps GROUP BY run").fetchall())
    assert steps == {"grpo-s0": 2, "dapo-s0": 3}  # replaced whole, the neighbour kept
    assert con.execute("SELECT max(step) FROM tokens WHERE run = 'grpo-s0'").fetchone()[0] == 1
    md = (tmp_path / "report" / "report.md").read_text()
    assert "| grpo-s0 |" in md and "dapo-s0" not in md


def test_default_demo_is_the_short_fast_regime_and_steps_runs_longer():
    """The default demo trains DEMO_STEPS (32) steps per run of the fast regime's maths; --steps N
    keeps the full length available. (Config, not timing.)"""
    from dataclasses import replace

    from entropylens.demo.runner import DEMO_STEPS, demo_configs
    from entropylens.demo.toy.config import DEMO_DEFAULT, ToyConfig

    cfgs = demo_configs()
    assert DEMO_STEPS == 32 < ToyConfig().steps
    assert [c.name for c in cfgs] == list(DEMO_DEFAULT) and {c.steps for c in cfgs} == {DEMO_STEPS}
    for c in cfgs:  # only the step count differs from the named run of the fast regime
        assert replace(c, steps=ToyConfig().steps) == config_for(c.name)
    assert {c.steps for c in demo_configs(steps=120)} == {120}
    assert {c.steps for c in demo_configs(quick=True)} == {6}


@pytest.mark.slow  # two whole reports (the --quick demo above draws its report in the workers, for real)
def test_report_drawn_figure_by_figure_equals_the_one_process_report(tmp_path):
    """The demo's workers draw the figures one at a time (FIGURE_ORDER, each on the worker's one
    connection) while the parent writes the pages: same pages, same files as one process."""
    from fixture_runs import build

    from entropylens.demo.runner import FIGURE_ORDER
    from entropylens.report.build import open_report, render_figure, write_report

    runs = build(tmp_path / "runs")
    one = write_report(runs, tmp_path / "one").parent
    con = open_report(runs)
    part = {n: render_figure(con, tmp_path / "two", n) for n in FIGURE_ORDER}
    tables = []
    two = write_report(
        runs, tmp_path / "two", elsewhere=FIGURE_ORDER, done=lambda: part, on_summary=tables.append
    ).parent
    assert (one / "report.md").read_text() == (two / "report.md").read_text()
    assert (one / "index.html").read_text() == (two / "index.html").read_text()
    assert sorted(p.name for p in one.glob("*.png")) == sorted(p.name for p in two.glob("*.png"))
    assert list(tables[0]["run"]) == ["a", "b"]


def test_figure_order_names_every_figure_once():
    """The workers draw FIGURE_ORDER (most expensive first): every figure of the report, once."""
    from entropylens.demo.runner import FIGURE_ORDER
    from entropylens.report.build import FIGURES

    assert sorted(FIGURE_ORDER) == sorted(f.name for f in FIGURES) and len(set(FIGURE_ORDER)) == len(FIGURE_ORDER)


def test_fork_server_starts_early_only_for_parallel_demos(monkeypatch):
    """`entropylens demo` starts the fork server before importing torch (its imports overlap ours) when
    the demo will use worker processes, and not for one run or --workers 1. (Config, not timing.)"""
    from multiprocessing import forkserver

    from entropylens.demo import workers

    calls = []
    monkeypatch.setattr(forkserver, "ensure_running", lambda: calls.append(os.environ.get("OMP_NUM_THREADS")))
    monkeypatch.setattr(workers, "available_cores", lambda: 2)
    assert not workers.start_fork_server(1) and not workers.start_fork_server(4, workers=1)
    assert calls == []
    assert workers.start_fork_server(4)
    assert calls == ["1"]  # started under the one-thread environment


def test_demo_cli_exits_with_its_code_without_teardown(tmp_path):
    """The CLI leaves at once after a command that loaded torch, keeping the exit code and the one-line
    error (a bad method is found after the demo's imports)."""
    cmd = [sys.executable, "-m", "entropylens.cli.main", "demo", "--methods", "grpo,nope", "--out", str(tmp_path)]
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert res.returncode == 2, res.stderr
    lines = [x for x in res.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "nope" in lines[0], res.stderr


def test_demo_workers_start_with_one_thread_environment(monkeypatch):
    """Under load, the workers' runtimes (torch's OpenMP, pyarrow, MKL) start as under
    OMP_NUM_THREADS=1, whatever the caller's environment; the caller's is restored. (Config, not timing.)"""
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    from entropylens.demo import runner as demo

    monkeypatch.setenv("OMP_NUM_THREADS", "8")
    monkeypatch.delenv("MKL_NUM_THREADS", raising=False)
    ctx = demo._worker_context(mp)
    with demo._one_thread_env():
        with ProcessPoolExecutor(1, mp_context=ctx) as pool:
            env = [
                pool.submit(os.getenv, k).result()
                for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")
            ]
    assert env == ["1", "1", "1"]
    assert os.environ["OMP_NUM_THREADS"] == "8" and "MKL_NUM_THREADS" not in os.environ
