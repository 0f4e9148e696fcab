"""Alarms (entropylens.alarms, `entropylens check`): each rule on hand-built step sequences, the CLI's
lines and exit codes, the Recorder's live warning, and GRPO's collapse on a real short toy run."""

import math
import warnings

import pandas as pd
import pytest
from entropylens.cli.main import app
from typer.testing import CliRunner

from entropylens.alarms import EntropyAlarm, LiveAlarms, Monitor, Thresholds, evaluate

runner = CliRunner()


def _feed(rows, t=None, run="r"):
    mon = Monitor(run, t or Thresholds())
    out = []
    for step, row in enumerate(rows):
        out += mon.observe(step, row)
    return out


def test_collapse_and_explosion_against_the_initial_entropy():
    # baseline: mean of steps 0..2 = (1.0 + 1.2 + 0.8) / 3 = 1.0; collapse below 0.25, explosion above 2.0
    h = [1.0, 1.2, 0.8, 0.9, 0.3, 0.24, 0.2, 0.5, 0.1, 2.5]
    found = _feed([{"old_entropy": x} for x in h])
    assert [(f.step, f.rule) for f in found] == [(5, "collapse"), (8, "collapse"), (9, "explosion")]
    assert found[0].value == pytest.approx(0.24) and found[0].threshold == pytest.approx(0.25)
    # an early dip inside the baseline steps does not fire; entropy falls back to `entropy` when old is absent
    assert _feed([{"entropy": x} for x in (1.0, 0.1, 1.0, 0.9)]) == []


def test_negative_budget_needs_a_sustained_run_and_a_fallen_entropy():
    # budget < 0 for 3 steps in a row AND entropy < 0.5 x initial (1.0): steps 3, 4, 5 are negative but
    # entropy is 0.9 there (a falling entropy with a negative budget is normal RL); at step 6 it is 0.4
    t = Thresholds(budget_steps=3)
    b = [-1, -1, 0.5, -1, -1, -1, -2, 1, -1]
    h = [1.0, 1.0, 1.0, 0.9, 0.9, 0.9, 0.4, 0.4, 0.4]
    found = _feed([{"entropy_effect": x, "old_entropy": y} for x, y in zip(b, h)], t)
    assert [(f.step, f.rule, f.value) for f in found] == [(6, "negative_budget", -2)]
    # without an entropy the rule cannot judge: quiet
    assert _feed([{"entropy_effect": x} for x in b], t) == []
    # --budget-entropy 0.3: 0.4 is not low enough
    assert (
        _feed(
            [{"entropy_effect": x, "old_entropy": y} for x, y in zip(b, h)],
            Thresholds(budget_steps=3, budget_entropy=0.3),
        )
        == []
    )


def test_nonfinite_fires_at_the_first_nan_or_inf_and_is_left_out_elsewhere():
    nan, inf = float("nan"), float("inf")
    rows = [{"grad_norm": 1.0, "old_entropy": 1.0, "kl": 1e-3}] * 6
    rows += [
        {"grad_norm": nan, "old_entropy": 1.0, "kl": 1e-3},
        {"grad_norm": inf, "old_entropy": 1.0, "kl": 1e-3},
        {"grad_norm": 1.0, "old_entropy": 1.0, "kl": 1e-3},
        {"grad_norm": 1.0, "old_entropy": 1.0, "kl": -inf},
        {"grad_norm": 1.0, "old_entropy": 1.0, "kl": 1e-3, "n_nonfinite_ratio": 0},
        {"grad_norm": 1.0, "old_entropy": 1.0, "kl": 1e-3, "n_nonfinite_ratio": 2},
    ]
    found = _feed(rows)
    # one episode for steps 6-7 (NaN then inf), a new one at step 9 (KL), another at 11 (overflowed ratios)
    assert [(f.step, f.rule, f.signal) for f in found] == [
        (6, "nonfinite", "grad_norm"),
        (9, "nonfinite", "kl"),
        (11, "nonfinite", "n_nonfinite_ratio"),
    ]
    assert math.isnan(found[0].value) and found[0].threshold == math.inf and found[2].value == 2
    assert found[0].line() == "run=r step=6 rule=nonfinite value=nan threshold=inf signal=grad_norm"
    # an inf grad norm is not also a grad_norm_spike, and a NaN entropy never enters the baseline
    assert not [f for f in found if f.rule != "nonfinite"]
    h = _feed([{"old_entropy": x} for x in (nan, 1.0, 1.0, 1.0, 0.2)])
    assert [(f.step, f.rule) for f in h] == [(0, "nonfinite"), (4, "collapse")]
    assert h[1].threshold == pytest.approx(0.25)


def test_no_signal_in_a_row_or_half_of_the_window():
    # zero-advantage share >= 0.5 for 3 steps in a row (steps 2, 3, 4)
    za = [0.1, 0.6, 0.5, 0.9, 0.7, 0.0]
    found = _feed([{"za_frac": x} for x in za])
    assert [(f.step, f.rule, f.value, f.threshold, f.signal) for f in found] == [(3, "no_signal", 3, 3, "za_frac")]
    # grad norm exactly 0 at every other step: signal-free 1, 3, 5 -> at step 5, 3 of 6 steps = 0.5
    g = _feed([{"zero_grad_frac": 1.0 if s % 2 else 0.0} for s in range(10)])
    assert [(f.step, f.rule, f.value, f.signal) for f in g] == [(5, "no_signal", 0.5, "zero_grad_frac")]
    # one signal-free step in three: 1/3 < 0.5, quiet; no input: quiet
    assert _feed([{"zero_grad_frac": 1.0 if s % 3 == 0 else 0.0} for s in range(30)]) == []
    assert _feed([{"grad_norm": 1.0}] * 10) == []


def test_spikes_against_the_rolling_median():
    # clipped fraction: 0.01 for 6 steps (median 0.01), then 0.05 (> 3 x 0.01), back, then 0.02 (not > 0.03)
    c = [0.01] * 6 + [0.05, 0.01, 0.02]
    found = _feed([{"clipped_frac": x} for x in c])
    assert [(f.step, f.rule) for f in found] == [(6, "clip_spike")]
    assert found[0].threshold == pytest.approx(0.03)
    # fewer than 5 previous steps: never fires; a zero median never fires
    assert _feed([{"kl": x} for x in (1e-4, 1e-4, 1.0)]) == []
    assert _feed([{"grad_norm": x} for x in [0.0] * 6 + [5.0]]) == []
    g = _feed([{"grad_norm": x} for x in [1.0, 2.0, 1.0, 2.0, 1.0, 7.0]])  # median 1 -> threshold 3
    assert [(f.step, f.rule) for f in g] == [(5, "grad_norm_spike")]


def test_erc_drop_rate_range_and_one_line_per_finding():
    band = {"erc_low": 0.95, "erc_high": 1.05}
    found = _feed(
        [
            {"erc_drop_frac": x, **band, "entropy_ratio_p05": 0.9, "entropy_ratio_p95": 1.1}
            for x in (0.2, 0.6, 0.7, 0.2, 0.0)
        ]
    )
    assert [(f.step, f.rule, f.threshold) for f in found] == [(1, "erc_drop_rate", 0.5), (4, "erc_drop_rate", 0.001)]
    assert found[0].line() == "run=r step=1 rule=erc_drop_rate value=0.6 threshold=0.5"
    # nothing dropped while every entropy ratio stays inside the band: healthy, no alarm
    inside = _feed([{"erc_drop_frac": 0.0, **band, "entropy_ratio_p05": 0.97, "entropy_ratio_p95": 1.03}] * 10)
    assert inside == []
    # nothing dropped although ratios leave the band (p95 1.2 > 1.05): ERC is not applied as configured
    out = _feed([{"erc_drop_frac": 0.0, **band, "entropy_ratio_p05": 0.97, "entropy_ratio_p95": 1.2}])
    assert [(f.step, f.value, f.threshold) for f in out] == [(0, 0.0, 0.001)]
    # without the band (or the quantiles) the low side cannot judge
    assert _feed([{"erc_drop_frac": 0.0, "entropy_ratio_p95": 1.2}]) == []
    df = pd.DataFrame({"run": ["b", "a", "a"], "step": [0, 1, 0], "erc_drop_frac": [0.9, 0.9, 0.2]})
    assert [(f.run, f.step) for f in evaluate(df)] == [("a", 1), ("b", 0)]
    with pytest.raises(ValueError, match="collapse"):
        Thresholds(collapse=-1)
    with pytest.raises(ValueError, match="no_signal_share is a share"):
        Thresholds(no_signal_share=2)


def test_live_alarms_warn_once_per_rule():
    live = LiveAlarms("r", Thresholds(baseline=1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step, h in enumerate((1.0, 0.1, 0.5, 0.1)):  # collapses at 1, recovers, collapses again at 3
            live.observe(step, {"old_entropy_mean": h})
    alarms = [w for w in caught if issubclass(w.category, EntropyAlarm)]
    assert len(alarms) == 1 and "rule=collapse" in str(alarms[0].message)
    assert [f.step for f in live.findings] == [1, 3]


def _hand_run(root, run="g", entropies=(1.2, 1.1, 1.0, 0.9, 0.5, 0.2, 0.1), erc=None):
    """A recorded run written with the project's own writer: one steps row per step."""
    import json

    from entropylens.record.writing.parquet import write_steps

    d = root / run
    d.mkdir(parents=True)
    (d / "run.json").write_text(json.dumps({"run": run, "method": "grpo", "status": "finished", "schema_version": 2}))
    for step, h in enumerate(entropies):
        write_steps(
            d,
            step,
            0,
            [
                {
                    "update": 0,
                    "n_tokens": 100,
                    "old_entropy_mean": h,
                    "entropy_mean": h,
                    "clipped_frac": 0.01,
                    "kl_k3": 1e-3,
                    "grad_norm": 1.0,
                    "erc_drop_frac": erc,
                    "entropy_effect": -0.01,
                }
            ],
        )
    return root


def test_check_cli_lines_and_exit_codes(tmp_path):
    # initial entropy = mean(1.2, 1.1, 1.0) = 1.1; collapse threshold 0.275: step 5 (0.2) fires once
    _hand_run(tmp_path)
    bad = runner.invoke(app, ["check", str(tmp_path)])
    assert bad.exit_code == 1, bad.output
    assert bad.output.splitlines() == ["run=g step=5 rule=collapse value=0.2 threshold=0.275"]
    ok = runner.invoke(app, ["check", str(tmp_path), "--collapse", "0.05"])
    assert ok.exit_code == 0 and "no alarm" in ok.output
    # 5 negative budgets in a row at step 4, where entropy 0.5 is below 0.5 x 1.1 = 0.55
    budget = runner.invoke(app, ["check", str(tmp_path), "--collapse", "0.05", "--budget-steps", "4"])
    assert budget.output.splitlines() == ["run=g step=4 rule=negative_budget value=-0.01 threshold=0"]
    quiet = runner.invoke(
        app, ["check", str(tmp_path), "--collapse", "0.05", "--budget-steps", "4", "--budget-entropy", "0.05"]
    )
    assert quiet.exit_code == 0, quiet.output
    err = runner.invoke(app, ["check", str(tmp_path / "nope")])
    assert err.exit_code == 2 and err.output.startswith("error:") and "Traceback" not in err.output
    for flags in (
        ["--window", "0"],
        ["--no-signal-steps", "0"],
        ["--no-signal-share", "1.5"],
        ["--budget-entropy", "-1"],
        ["--erc-drop-min", "0.9"],
    ):
        res = runner.invoke(app, ["check", str(tmp_path), *flags])
        assert res.exit_code == 2 and len(res.output.strip().splitlines()) == 1, (flags, res.output)
        assert res.output.startswith("error:") and "Traceback" not in res.output


@pytest.mark.parametrize("end_steps", [False, True])
def test_recorder_warns_live(tmp_path, end_steps):
    # with end_step after each step the steps close early; the alarms still see each step once (when the
    # next step begins, or at close) and never make end_step wait for the writer's summary
    import torch

    from entropylens import Recorder

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with Recorder(tmp_path, run="live", alarms=Thresholds(baseline=1)) as rec:
            for step, h in enumerate((1.0, 0.9, 0.1, 0.1)):
                lp = torch.full((2, 3), -0.5)
                rec.record_update(
                    step,
                    0,
                    mask=torch.ones(2, 3, dtype=torch.bool),
                    advantages=torch.tensor([1.0, -1.0]),
                    logprobs=lp,
                    old_logprobs=lp,
                    entropy=torch.full((2, 3), h),
                    old_entropy=torch.full((2, 3), h),
                )
                if end_steps:
                    summaries = rec._writer.summary
                    rec._writer.summary = None  # end_step must not ask the writer (it would wait)
                    assert rec.end_step() == step
                    rec._writer.summary = summaries
    alarms = [str(w.message) for w in caught if issubclass(w.category, EntropyAlarm)]
    assert alarms == ["entropylens alarm: run=live step=2 rule=collapse value=0.1 threshold=0.25"]
    where = [w.filename for w in caught if issubclass(w.category, EntropyAlarm)]
    assert where == [__file__]  # the warning names the user's line, not recorder.py


@pytest.mark.slow
def test_grpo_collapse_fires_on_a_real_toy_run(tmp_path):
    """GRPO on a smaller, faster toy (lr 2e-3, 64 sequences, 4 updates per step) collapses within 60 steps
    (measured: entropy 1.15 -> 0.17, the default rule first fires at step 39); with probes every 6 steps."""
    from entropylens.demo.toy import config_for, train
    from entropylens.report.checks import check

    train(config_for("grpo", steps=60, prompts=8, group=8, minibatches=2, epochs=2, lr=2e-3, probe_every=6), tmp_path)
    found = [f for f in check(tmp_path) if f.rule == "collapse"]
    assert found, "GRPO's entropy collapse was not flagged"
    assert found[0].value < found[0].threshold
    res = runner.invoke(app, ["check", str(tmp_path)])
    assert res.exit_code == 1 and "rule=collapse" in res.output


def test_one_definition_documented_everywhere():
    """Every rule is in alarms.py's docstring, `check --help` and docs/alarms.md; every threshold has a
    `check` flag whose default is the Thresholds default, and docs/alarms.md names the flag."""
    from dataclasses import fields
    from pathlib import Path

    import typer.main

    from entropylens import alarms
    from entropylens.alarms import RULES

    docs = (Path(__file__).resolve().parents[1] / "docs" / "alarms.md").read_text()
    cmd = typer.main.get_command(app).commands["check"]
    help_text = runner.invoke(app, ["check", "--help"], terminal_width=200).output
    for rule in RULES:
        assert rule in alarms.__doc__ and f"`{rule}`" in docs and rule in help_text, rule
    defaults = {p.name: p.default for p in cmd.params}
    for f in fields(Thresholds):
        flag = "--" + f.name.replace("_", "-")
        assert defaults[f.name] == getattr(Thresholds(), f.name), f.name
        assert flag in help_text and f"`{flag}`" in docs, flag


def test_mismatch_against_the_runs_own_start():
    # warm-up 5 steps: sampler KL 1e-3, 2e-3, 1e-3, 3e-3, 1e-3 -> median B = 1e-3; threshold
    # max(10 x 1e-3, floor 1e-3) = 1e-2. Step 5 (9e-3) stays under it; step 6 (0.02) fires; 7 too (same
    # episode, not reported again); 8 falls back; 9 fires again
    kl = [1e-3, 2e-3, 1e-3, 3e-3, 1e-3, 9e-3, 0.02, 0.05, 1e-3, 0.03]
    found = _feed([{"sampler_kl": x} for x in kl])
    assert [(f.step, f.rule) for f in found] == [(6, "mismatch"), (9, "mismatch")]
    assert found[0].value == pytest.approx(0.02) and found[0].threshold == pytest.approx(0.01)
    # a near-zero start (bf16 rounding: 1e-6) sets the threshold at the floor, 1e-3, not at 1e-5
    tiny = _feed([{"sampler_kl": x} for x in [1e-6] * 5 + [5e-5, 5e-4, 2e-3]])
    assert [(f.step, f.threshold) for f in tiny] == [(7, pytest.approx(1e-3))]
    # a KL that is high from the start is the run's normal: no alarm; nor during the warm-up itself
    assert _feed([{"sampler_kl": x} for x in [0.5, 0.6, 0.5, 0.4, 0.5, 0.6, 0.55]]) == []
    assert _feed([{"sampler_kl": x} for x in [1e-4, 1.0, 1e-4]]) == []
    # a run without sampler log-probs (None / NULL) never fires; a NaN is not a KL
    assert _feed([{"sampler_kl": None}] * 20) == []
    assert _feed([{"sampler_kl": x} for x in [1e-3] * 5 + [math.nan, 5e-3]]) == []
    # the thresholds are the user's: warm-up 2 -> B = median(1e-3, 2e-3) = 1.5e-3, threshold 2 x B = 3e-3;
    # step 3 (3e-3) is not above it, step 5 (9e-3) is, 6-7 the same episode, 8 below, 9 again
    assert [f.step for f in _feed([{"sampler_kl": x} for x in kl], Thresholds(mismatch=2, mismatch_warmup=2))] == [5, 9]
    with pytest.raises(ValueError, match="mismatch_warmup"):
        Thresholds(mismatch_warmup=0)


def test_mismatch_offline_from_the_steps_table(tmp_path):
    import json

    from entropylens.record.writing.parquet import write_steps

    d = tmp_path / "mm"
    d.mkdir()
    (d / "run.json").write_text(json.dumps({"run": "mm", "method": "grpo", "status": "finished", "schema_version": 4}))
    kl = [1e-3] * 6 + [0.05] * 3  # two ranks per step: 100 tokens at kl, 300 at 3 x kl -> 2.5 x kl
    for step, k in enumerate(kl):
        for rank, (n, f) in enumerate(((100, 1.0), (300, 3.0))):
            write_steps(
                d,
                step,
                rank,
                [
                    {
                        "update": 0,
                        "n_tokens": n,
                        "old_entropy_mean": 1.0,
                        "entropy_mean": 1.0,
                        "clipped_frac": 0.01,
                        "kl_k3": 1e-3,
                        "grad_norm": 1.0,
                        "sampler_kl_k3": k * f,
                    }
                ],
            )
    res = runner.invoke(app, ["check", str(tmp_path)])
    # token-weighted: (100 k + 300 x 3k) / 400 = 2.5 k; start B = 2.5e-3; threshold 2.5e-2; step 6: 0.125
    assert res.exit_code == 1
    assert "run=mm step=6 rule=mismatch value=0.125 threshold=0.025" in res.output
    assert runner.invoke(app, ["check", str(tmp_path), "--mismatch", "100"]).exit_code == 0


def test_live_mismatch_reads_the_step_summarys_sampler_kl_and_calls_the_listeners():
    # the Recorder's step summary carries steps.sampler_kl_k3 (the steps column of the same name)
    seen = []
    live = LiveAlarms("r", Thresholds(mismatch_warmup=2), stop_on=("mismatch",))
    live.listeners.append(seen.append)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step, kl in enumerate((2e-4, 2e-4, 5e-4, 3e-3, 3e-3)):  # threshold max(10 x 2e-4, 1e-3) = 2e-3
            live.observe(step, {"old_entropy_mean": 1.0, "sampler_kl_k3": kl})
    assert [(f.step, f.rule) for f in seen] == [(3, "mismatch")] and live.stop is seen[0]
    assert seen[0].threshold == pytest.approx(2e-3)
    assert sum("rule=mismatch" in str(w.message) for w in caught if issubclass(w.category, EntropyAlarm)) == 1
