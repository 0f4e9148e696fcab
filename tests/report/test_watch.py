"""`entropylens watch`: the view as a pure function of a steps frame (rendered to text), the alarms as
`entropylens check` finds them, the CLI's errors, and the live view in a real terminal (tmux) over a
run that a background process records step by step: it follows the steps as they commit, leaves by
itself once the run is finished, and leaves cleanly on Ctrl-C."""

from __future__ import annotations

import io
import os
import re
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pandas as pd
import pytest
from alarm_runs import record_run
from cli_calls import err, ok
from rich.console import Console

from entropylens.alarms import Finding
from entropylens.read.query import connect
from entropylens.report.checks import check
from entropylens.report.watch import render, snapshot, sparkline, summary_line

TMUX = shutil.which("tmux") or "/usr/bin/tmux"


def text_of(renderable, width: int = 160) -> str:
    console = Console(record=True, width=width, color_system=None, file=io.StringIO())
    console.print(renderable)
    return console.export_text()


def frame() -> pd.DataFrame:
    base = dict(
        n_rows=2, n_tokens=400, n_steps=3, clipped_frac=0.1, kl_k3=0.001, grad_norm=1.0, erc_low=0.95, erc_high=1.05
    )
    rows = [
        dict(
            base,
            run="erc-run",
            step=10,
            old_entropy_mean=1.2345,
            entropy_mean=1.2001,
            reward_mean=0.25,
            clip_low_frac=0.011,
            clip_high_frac=0.022,
            clip_frac_pa_hp=0.001,
            clip_frac_pa_lp=0.301,
            clip_frac_na_hp=0.002,
            clip_frac_na_lp=0.402,
            entropy_ratio_p05=0.931,
            entropy_ratio_p50=1.002,
            entropy_ratio_p95=1.071,
            erc_drop_frac=0.083,
        ),
        dict(
            base,
            run="erc-run",
            step=11,
            old_entropy_mean=1.1111,
            entropy_mean=1.0987,
            reward_mean=0.5,
            clip_low_frac=0.033,
            clip_high_frac=0.044,
            clip_frac_pa_hp=0.003,
            clip_frac_pa_lp=0.312,
            clip_frac_na_hp=0.004,
            clip_frac_na_lp=0.423,
            entropy_ratio_p05=0.942,
            entropy_ratio_p50=1.003,
            entropy_ratio_p95=1.062,
            erc_drop_frac=0.071,
        ),
        dict(
            base,
            run="erc-run",
            step=12,
            old_entropy_mean=0.9876,
            entropy_mean=0.9555,
            reward_mean=0.75,
            clip_low_frac=0.055,
            clip_high_frac=0.066,
            clip_frac_pa_hp=0.005,
            clip_frac_pa_lp=0.323,
            clip_frac_na_hp=0.006,
            clip_frac_na_lp=0.434,
            entropy_ratio_p05=0.953,
            entropy_ratio_p50=1.004,
            entropy_ratio_p95=1.053,
            erc_drop_frac=0.064,
        ),
        dict(
            base,
            run="plain",
            step=0,
            old_entropy_mean=2.5,
            entropy_mean=2.4,
            reward_mean=0.1,
            n_steps=1,
            clip_low_frac=0.0,
            clip_high_frac=0.0,
            clip_frac_pa_hp=None,
            clip_frac_pa_lp=None,
            clip_frac_na_hp=None,
            clip_frac_na_lp=None,
            entropy_ratio_p05=0.9,
            entropy_ratio_p50=1.0,
            entropy_ratio_p95=1.1,
            erc_drop_frac=None,
            erc_low=None,
            erc_high=None,
        ),
    ]
    return pd.DataFrame(rows)


def test_render_shows_the_latest_steps_values_and_alarms():
    findings = [
        Finding("erc-run", 12, "collapse", 0.9876, 1.0),
        Finding("plain", 0, "nonfinite", float("nan"), float("inf"), "grad_norm"),
    ]
    out = text_of(render(frame(), findings, {"erc-run": ("ce_gppo", "running"), "plain": ("grpo", "finished")}))
    erc, plain = out.split("plain  grpo")
    assert "erc-run  ce_gppo  running" in erc and "finished" in plain
    assert "latest step 12" in erc and "steps 3" in erc and "H_old 0.9876" in erc and "reward 0.7500" in erc
    step12 = next(line for line in erc.splitlines() if re.match(r"^\W*12 ", line))
    # step, H_old, H, reward, clip low / high, the four quadrants, rho p05 / p50 / p95, out of band
    assert step12.split()[2:-1] == [
        "0.9876",
        "0.9555",
        "0.750",
        "5.5%",
        "6.6%",
        "0.5%",
        "32.3%",
        "0.6%",
        "43.4%",
        "0.953",
        "1.004",
        "1.053",
        "6.4%",
    ]
    assert re.search(r"^\W*10 +1\.2345 +1\.2001", erc, re.M) and re.search(r"^\W*11 +1\.1111", erc, re.M)
    assert "ERC band [0.950, 1.050]" in erc and "no ERC band in this run" in plain
    assert "step 12 collapse value=0.9876 threshold=1" in erc and "alarms: none" not in erc
    assert "step 0 nonfinite value=nan threshold=inf signal=grad_norm" in plain
    assert sparkline(frame()["old_entropy_mean"][:3]) in erc  # entropy falls: █ then down to ▁
    step0 = next(line for line in plain.splitlines() if re.match(r"^\W*0 ", line))
    assert step0.split()[2:-1] == [
        "2.5000",
        "2.4000",
        "0.100",
        "0.0%",
        "0.0%",
        "-",
        "-",
        "-",
        "-",
        "0.900",
        "1.000",
        "1.100",
        "-",
    ]


def test_render_narrow_moves_the_quadrants_below_and_shows_runs_without_steps():
    steps = frame()[lambda d: d.run == "erc-run"]
    out = text_of(render(steps, [], {"erc-run": ("ce_gppo", "running"), "new": ("grpo", "running")}), width=80)
    assert max(len(line) for line in out.splitlines()) <= 80
    assert "clip by quadrant, step 12: PA&HP 0.5%  PA&LP 32.3%  NA&HP 0.6%  NA&LP 43.4%" in out
    assert "new  grpo  running" in out and "no step committed yet" in out and "alarms: none" in out


def test_sparkline_scales_between_min_and_max():
    assert sparkline([1.0, 2.0, 3.0]) == "▁▅█"
    assert sparkline([2.0, 2.0]) == "▅▅" and sparkline([]) == "" and sparkline([1.0, None, 3.0]) == "▁ █"


def test_snapshot_findings_are_those_of_check(tmp_path):
    # entropy 1.0 for 3 steps (H_0), then 0.2: collapse at step 3 (below 0.25 x H_0)
    record_run(tmp_path, "c", steps=6, entropy=lambda s: 1.0 if s < 3 else 0.2)
    snap = snapshot(tmp_path)
    assert snap.findings == check(tmp_path) and [(f.step, f.rule) for f in snap.findings] == [(3, "collapse")]
    assert snap.runs == {"c": ("grpo", "finished")} and snap.ended
    assert list(snap.steps["step"]) == list(range(6)) and set(snap.steps["n_steps"]) == {6}
    assert summary_line(snap) == "watch: all 1 run(s) ended: c finished at step 5; 1 alarm(s)"
    only_last = snapshot(tmp_path, tail=2)
    assert list(only_last.steps["step"]) == [4, 5] and only_last.findings == snap.findings  # alarms see every step


def test_watch_cli_on_ended_runs_prints_the_view_and_the_summary(tmp_path):
    record_run(tmp_path, "c", steps=6, entropy=lambda s: 1.0 if s < 3 else 0.2)
    out = ok("watch", tmp_path, "--interval", "0.1")
    assert "latest step 5" in out and "step 3 collapse value=0.2" in out
    assert out.rstrip().splitlines()[-1] == "watch: all 1 run(s) ended: c finished at step 5; 1 alarm(s)"


def test_watch_cli_errors(tmp_path):
    assert err("watch", tmp_path / "nope") == f"error: path does not exist: {tmp_path / 'nope'}"
    assert "no entropylens run under" in err("watch", tmp_path)
    record_run(tmp_path, "c", steps=1)
    assert err("watch", tmp_path, "--run", "zz").startswith("error: unknown run(s) zz")
    assert err("watch", tmp_path, "--interval", "0") == "error: --interval must be a number of seconds > 0, got 0.0"


# ------------------------------------------------------------------ live, in a real terminal (tmux)

CHILD = r"""
import os, sys, time
import torch
from entropylens import Recorder
from entropylens.rl.losses import policy_loss
from entropylens.rl.stats import logprobs_and_entropy

root, run, steps, go, release = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5]


def wait_for(path):  # the test touches the file (bounded: a lost test does not leave us behind)
    deadline = time.monotonic() + 60
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.05)


torch.set_num_threads(1)
gen = torch.Generator().manual_seed(3)
b, t, v = 8, 32, 40
with Recorder(root, run=run, config={"method": "grpo"}, fsync=False) as rec:
    for step in range(steps):
        for u in range(2):
            logits = torch.randn(b, t, v, generator=gen, requires_grad=True)
            tokens = torch.randint(0, v, (b, t), generator=gen)
            mask = torch.rand(b, t, generator=gen) < 0.8
            adv = torch.randn(b, generator=gen)
            with torch.no_grad():
                old_lp, old_h = logprobs_and_entropy(logits + 0.3 * torch.randn(b, t, v, generator=gen), tokens)
            rec.watch_logits(logits)
            lp, h = logprobs_and_entropy(logits, tokens)
            out = policy_loss(lp, old_lp, adv, mask, entropy=h, old_entropy=old_h, erc=(0.95, 1.05))
            rec.record_update(step, u, mask=mask, advantages=adv, logprobs=lp, old_logprobs=old_lp, entropy=h,
                              old_entropy=old_h, tokens=tokens, seq_ids=torch.arange(b) + 8 * u + 16 * step,
                              loss=out)
            out.loss.backward()
            rec.record_step(step, update=u, grad_norm=float(logits.grad.norm()), lr=1e-3)
        rec.record_sequences(step, seq_ids=torch.arange(16) + 16 * step, rewards=torch.rand(16, generator=gen),
                             advantages=torch.randn(16, generator=gen), lengths=torch.full((16,), t))
        rec.end_step(step)
        print(f"ended {step}", flush=True)
        if step == 0:
            wait_for(go)  # the test has seen step 0 in the view
        elif step < steps - 1:
            time.sleep(0.5)
    wait_for(release)  # the test has looked at the running view: close (status finished)
print("closed", flush=True)
"""
STEPS = 4


class Pane:
    """One tmux server of its own (a unique socket, no user config), one 160 x 50 window."""

    def __init__(self, cwd: Path):
        self.sock = f"el-watch-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.cwd = cwd

    def tmux(self, *args, check=True) -> str:
        return subprocess.run(
            [TMUX, "-L", self.sock, "-f", "/dev/null", *args], capture_output=True, text=True, check=check, timeout=10
        ).stdout

    def start(self, command: str) -> None:
        self.tmux("new-session", "-d", "-x", "160", "-y", "50", "-c", str(self.cwd), command)

    def capture(self) -> str:
        return self.tmux("capture-pane", "-p", "-J")

    def wait_for(self, pred, timeout: float, what: str) -> str:
        deadline = time.monotonic() + timeout
        while True:
            text = self.capture()
            if pred(text):
                return text
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}; the pane:\n{text}")
            time.sleep(0.1)

    def kill(self) -> None:
        self.tmux("kill-server", check=False)


def start_child(tmp_path: Path, run: str):
    """The recorder in its own process: step 0, then (once the test touches `go`) steps 1 .. STEPS-1 0.5 s
    apart, each closed with end_step; it closes the run (finished) once the test touches `release`."""
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    go, release = tmp_path / "go", tmp_path / "release"
    proc = subprocess.Popen(
        [sys.executable, str(script), str(tmp_path / "runs"), run, str(STEPS), str(go), str(release)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    line = proc.stdout.readline()  # step 0 is closed: the run directory exists
    assert line.strip() == "ended 0", proc.stderr.read()
    return proc, go, release


def watch_command(tmp_path: Path) -> str:
    cli = f"{sys.executable} -m entropylens.cli.main"
    # rich takes COLUMNS / LINES over the terminal's size, and a pane may inherit stale ones (80 x 24)
    return f"env -u COLUMNS -u LINES {cli} watch {tmp_path / 'runs'} --interval 0.3; echo WATCH_EXIT=$?; sleep 60"


def step_entropy(path: Path, step: int) -> float:
    con = connect(path)
    return con.execute(
        "SELECT sum(old_entropy_mean * n_tokens) / sum(n_tokens) FROM steps WHERE step = ?", [step]
    ).fetchone()[0]


@pytest.mark.skipif(not Path(TMUX).exists(), reason="needs tmux")
def test_watch_follows_a_run_live_and_leaves_when_it_finishes(tmp_path):
    proc, go, release = start_child(tmp_path, "live")
    pane = Pane(tmp_path)
    try:
        pane.start(watch_command(tmp_path))
        pane.wait_for(lambda t: "latest step 0" in t, 15, "step 0 in the view")
        go.touch()  # the recorder goes on: steps 1 .. STEPS-1, 0.5 s apart
        # the same process showed step 0, and now (refreshed as the steps committed) the last step
        running = pane.wait_for(lambda t: f"latest step {STEPS - 1}" in t, 15, f"step {STEPS - 1} in the view")
        assert "live  grpo  running" in running and "WATCH_EXIT" not in running
        h = step_entropy(tmp_path / "runs", STEPS - 1)
        assert f"H_old {h:.4f}" in running  # the latest step's entropy, as in the steps table
        row = next(line for line in running.splitlines() if re.match(rf"^\W*{STEPS - 1} ", line))
        assert row.split()[2] == f"{h:.4f}"
        assert "PA&LP" in running and "clip by quadrant" not in running  # 160 wide
        release.touch()  # the recorder closes: status finished
        assert proc.wait(timeout=15) == 0, proc.stderr.read()
        final = pane.wait_for(lambda t: "WATCH_EXIT=" in t, 10, "watch to leave")
        assert "WATCH_EXIT=0" in final and "Traceback" not in final
        assert f"watch: all 1 run(s) ended: live finished at step {STEPS - 1}; 0 alarm(s)" in final
        assert "live  grpo  finished" in final
        (tmp_path / "capture.txt").write_text(running + "\n---\n" + final)  # docs/watch.md's example
    finally:
        pane.kill()
        release.touch()
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)


@pytest.mark.skipif(not Path(TMUX).exists(), reason="needs tmux")
def test_watch_leaves_on_ctrl_c_without_a_traceback(tmp_path):
    proc, go, release = start_child(tmp_path, "live")
    pane = Pane(tmp_path)
    try:
        pane.start(watch_command(tmp_path))
        pane.wait_for(lambda t: "latest step" in t, 15, "the view")
        pane.tmux("send-keys", "C-c")
        final = pane.wait_for(lambda t: "WATCH_EXIT=" in t, 10, "watch to leave on Ctrl-C")
        assert "WATCH_EXIT=0" in final, final
        assert "Traceback" not in final and "KeyboardInterrupt" not in final
        assert re.search(r"watch: stopped \(Ctrl-C\); 1 run\(s\) watched: live running at step \d", final), final
        (tmp_path / "capture.txt").write_text(final)
    finally:
        pane.kill()
        release.touch()
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)
