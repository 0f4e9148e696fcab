"""Alarms that act: a live rule in ``stop_on`` makes ``Recorder.should_stop`` true (a plain loop
reads it and stops), and the TRL trainer stops training through its callback
(``control.should_training_stop``), on every process alike. Real Recorder, real TRL, real files."""

import sys
import time
import warnings
from pathlib import Path

import pytest
import torch

from entropylens import Recorder
from entropylens.alarms import EntropyAlarm, Thresholds
from entropylens.read.query import connect

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "helpers"))
import trl_tiny  # noqa: E402
from sampler_api import needs_sampler_api  # noqa: E402


def _update(rec, step, h):
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


def test_a_plain_loop_stops_when_a_stop_on_rule_fires(tmp_path):
    # H0 = 1.0 (baseline 1); collapse at 0.25 x H0: step 2's entropy 0.1 fires it; the loop reads
    # should_stop after each step and leaves, so the later steps are never recorded
    entropies = (1.0, 0.9) + (0.1,) * 98
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with Recorder(tmp_path, run="stop", alarms=Thresholds(baseline=1), stop_on=("collapse",)) as rec:
            for step, h in enumerate(entropies):
                _update(rec, step, h)
                rec.end_step(step)
                time.sleep(0.02)  # the loop's own work (the rules see a step once the writer has it)
                if rec.should_stop:
                    break
            stopped_at = step
            reason = rec.stop_reason
    assert reason == "run=stop step=2 rule=collapse value=0.1 threshold=0.25"
    # end_step does not wait for the writer's summary: the stop comes at the finding's step or a few later
    assert 2 <= stopped_at < len(entropies) - 1
    steps = [s for (s,) in connect(tmp_path / "stop").execute("SELECT DISTINCT step FROM steps ORDER BY 1").fetchall()]
    assert steps == list(range(stopped_at + 1))


def test_other_rules_warn_but_do_not_stop(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with Recorder(tmp_path, run="go", alarms=Thresholds(baseline=1), stop_on="nonfinite") as rec:
            for step, h in enumerate((1.0, 0.9, 0.1, 0.1)):
                _update(rec, step, h)
                rec.end_step(step)
        assert not rec.should_stop and rec.stop_reason is None


def test_stop_on_is_checked(tmp_path):
    with pytest.raises(ValueError, match="stop_on: unknown rule 'colapse'; rules: nonfinite, collapse"):
        Recorder(tmp_path, run="x", alarms=True, stop_on=("colapse",))
    with pytest.raises(ValueError, match="stop_on needs alarms="):
        Recorder(tmp_path, run="y", stop_on=("collapse",))


def test_trl_stops_training_when_a_stop_on_rule_fires(tmp_path):
    # explosion at 1e-3 x H0 fires at the first step after the baseline (any entropy is above it): the
    # trainer stops long before max_steps, with one warning naming the finding
    with (
        pytest.warns(EntropyAlarm, match="run=stop step=1 rule=explosion"),
        pytest.warns(UserWarning, match="entropylens: stopping training: run=stop step=1 rule=explosion"),
    ):
        tr = trl_tiny.trainer(
            tmp_path,
            "stop",
            max_steps=20,
            el=dict(alarms=Thresholds(baseline=1, explosion=1e-3), stop_on=("explosion",)),
        )
        tr.train()
    assert tr.state.global_step < 20
    assert tr.recorder.stop_reason.startswith("run=stop step=1 rule=explosion")
    done = connect(tmp_path / "stop").execute("SELECT max(step) FROM steps").fetchone()[0]
    assert done == tr.state.global_step - 1  # every step the trainer ran is recorded


def test_on_alarm_listeners_get_every_finding(tmp_path):
    # collapse fires at step 2, explosion (H back above 2 x H0) at step 4: one call per finding, in order,
    # on the training thread, besides the one warning per rule
    seen = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with Recorder(tmp_path, run="l", alarms=Thresholds(baseline=1)) as rec:
            rec.on_alarm(seen.append)
            for step, h in enumerate((1.0, 0.9, 0.1, 0.1, 2.5)):
                _update(rec, step, h)
                rec.end_step(step)
    assert [(f.step, f.rule) for f in seen] == [(2, "collapse"), (4, "explosion")]
    with Recorder(tmp_path, run="m") as rec, pytest.raises(ValueError, match="on_alarm needs alarms="):
        rec.on_alarm(print)


@needs_sampler_api
def test_mismatch_fires_live_and_reaches_the_trackers(tmp_path):
    """A plain loop recording sampler log-probs: the sampler-trainer gap is 0.01 nats on every token for 6
    steps (k3 ~5e-5: the run's start), then 0.2 (k3 = e^0.2 - 1.2 = 0.0214 > max(10 x start, 1e-3)): the
    live rule fires at step 6, a stop_on rule stops the loop, and the finding is the tracker's alert."""
    from entropylens.record.trackers import Tracker

    class Alerts(Tracker):
        name = "alerts"

        def __init__(self):
            self.seen = []

        def log(self, step, metrics):  # the step metrics: not this test's
            pass

        def alert(self, title, text, level, step):
            self.seen.append((title, level, step, text))

    tr = Alerts()
    lp = torch.full((2, 3), -0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with Recorder(
            tmp_path, run="mm", alarms=Thresholds(mismatch_warmup=5), stop_on=("mismatch",), log_to=tr
        ) as rec:
            for step in range(40):
                d = 0.2 if step >= 6 else 0.01
                rec.record_update(
                    step,
                    0,
                    mask=torch.ones(2, 3, dtype=torch.bool),
                    advantages=torch.tensor([1.0, -1.0]),
                    logprobs=lp,
                    old_logprobs=lp,
                    entropy=torch.full((2, 3), 1.0),
                    old_entropy=torch.full((2, 3), 1.0),
                    sampler_logprobs=lp - d,
                )
                rec.end_step(step)
                time.sleep(0.02)
                if rec.should_stop:
                    break
            reason = rec.stop_reason
    assert reason is not None and reason.startswith("run=mm step=6 rule=mismatch value=0.0214")
    assert 6 <= step < 39
    assert [(t, lv, s) for t, lv, s, _ in tr.seen] == [("entropylens alarm: mismatch", "ERROR", 6)]
