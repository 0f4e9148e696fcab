"""The overhead benchmarks run end to end (tiny settings; they assert nothing about time, and neither
does this test): each mode trains each step from the same saved state, bit for bit. Slow: each runs a
benchmark script end to end in a subprocess (about 2 CPU-minutes together); `pytest -m slow` runs them."""

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]


def _run(script: str, *args: str) -> str:
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def test_overhead_benchmark_pairs_the_same_work():
    out = _run(
        "overhead.py",
        "--steps",
        "2",
        "--sft-steps",
        "2",
        "--prompts",
        "2",
        "--fsync-files",
        "2",
        "--modes",
        "off,full,full-nofsync,sample=0.1,hook,clip_cov,kl_cov",
    )
    # every recorder mode (off, full, full-nofsync, sample=0.1, the loss hook) ran each of the 4 steps from the same
    # state and ended with the same weights: the recorder never changes training and the pairs are the same work
    # (clip_cov / kl_cov train the same step with another loss: left out of that check, timed against full)
    assert "4 of 4 steps (2 measured, 2 warm-up rounds) ended with identical weights in all modes" in out
    assert "overhead_ratio=" in out and "paired_overhead_ratio=" in out and "hook_paired_overhead_ratio=" in out
    assert "clip_cov_paired_cpu_ratio=" in out and "kl_cov_paired_cpu_ratio=" in out


def test_trl_overhead_benchmark_times_the_sampler_columns():
    """--sampler: a third trainer records TRL's sampling log-probs (old log-probs minus a fixed pattern); it saw
    the same tokens as plain TRL and full recording without them (the same training), and recorded the sampler
    log-probs; the ratios are printed (their values are not asserted)."""
    pytest.importorskip("trl")
    out = _run("trl_overhead.py", "--steps", "4", "--rounds", "1", "--sampler")
    seen = next(line for line in out.splitlines() if line.startswith("tokens seen per round"))
    plain, full, sampler = seen.rsplit(":", 1)[1].split("/")
    assert int(plain) == int(full) == int(sampler) > 0
    recorded = next(line for line in out.splitlines() if line.startswith("sampler log-probs recorded"))
    assert int(recorded.rsplit(":", 1)[1]) > 0
    for key in ("trl_sampler_ratio=", "trl_sampler_paired_ratio=", "trl_sampler_columns_ratio=", "trl_overhead_ratio="):
        assert key in out


def test_trl_overhead_benchmark_times_several_losses():
    """--loss grpo,clip_cov: each entropylens loss replaces TRL's in a trainer of its own, and clip_cov is also
    timed against grpo (the covariance control's own cost); the ratios are printed, not asserted."""
    pytest.importorskip("trl")
    out = _run("trl_overhead.py", "--steps", "4", "--rounds", "1", "--loss", "grpo,clip_cov")
    assert "loss=grpo against TRL's own loss, both recorded" in out
    assert "loss=clip_cov against loss=grpo" in out and "trl_clip_cov_vs_grpo_cpu_ratio=" in out


def test_contention_benchmark_runs():
    out = _run("contention.py", "--steps", "1", "--sft-steps", "2", "--burn-ms", "1")
    assert [line.split()[0] for line in out.splitlines()[-3:]] == ["off", "python", "native"]


def test_report_runs_benchmark_runs(tmp_path):
    import user_runs

    user_runs.record_run(tmp_path / "runs", "grpo-a", {"method": "grpo", "lr": 1e-3, "decay": 0.05})
    out = _run("report_runs.py", str(tmp_path / "runs" / "grpo-a"), "--copies", "3")
    assert "runs=3 report_1_s=" in out.splitlines()[-1]
