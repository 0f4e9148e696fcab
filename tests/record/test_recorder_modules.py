"""The Recorder in parts: one module per job, each short enough to read alone; the facade keeps the
names users see (``Recorder.record_update`` in Python's own errors, ``entropylens.record.recorder.RecorderError``);
the step state is one object; what ``record_update(loss=...)`` reads is a written-down Protocol."""

from pathlib import Path

import pytest
import torch

from entropylens import Recorder
from entropylens.record.recorder import RecorderError, StepState
from entropylens.record.training.loss_output import CheckedLossOutput, LossOutput
from entropylens.rl.losses import policy_loss

PACKAGE = Path(__file__).resolve().parents[2] / "entropylens" / "record"
PARTS = (
    "recorder.py",
    "training/lifecycle.py",
    "training/inputs.py",
    "training/update.py",
    "training/steps.py",
    "training/summaries.py",
    "training/loss_output.py",
    "training/base.py",
)


@pytest.mark.parametrize("name", PARTS)
def test_each_part_reads_alone(name):
    lines = (PACKAGE / name).read_text().splitlines()
    # 400 ruff-formatted lines (one argument a line where a call does not fit: the 300 compact lines of
    # before the reformat are ~360 now)
    assert len(lines) <= 400, f"{name}: {len(lines)} lines"
    assert lines[0].startswith('"""'), f"{name} says its job first"


def test_the_facade_keeps_the_names_users_see(tmp_path):
    assert RecorderError.__module__ == "entropylens.record.recorder"
    assert Recorder.record_update.__qualname__ == "Recorder.record_update"
    assert Recorder.should_stop.fget.__qualname__ == "Recorder.should_stop"
    with pytest.raises(TypeError, match=r"^Recorder\.__init__\(\) got an unexpected keyword argument 'bogus'"):
        Recorder(tmp_path, run="r", bogus=1)


def test_the_step_state_is_one_object(tmp_path):
    with Recorder(tmp_path, run="r", fsync=False) as rec:
        mask, lp = torch.ones(1, 2, dtype=torch.bool), torch.zeros(1, 2)
        rec.record_update(3, 0, mask=mask, advantages=torch.ones(1), logprobs=lp, old_logprobs=lp)
        rec.end_step()
        assert isinstance(rec._steps, StepState)
        assert (rec._steps.last, rec._steps.closed_upto, list(rec._steps.updates)) == (3, 3, [0])
        for old in (
            "_last_step",
            "_closed_upto",
            "_alarms_seen",
            "_step_logged",
            "_step_updates",
            "_step_scalars_seen",
            "_sequence_parts",
            "_resumed_after",
        ):
            assert not hasattr(rec, old)


def test_policy_loss_output_is_the_protocol():
    lp, mask = torch.zeros(1, 2), torch.ones(1, 2, dtype=torch.bool)
    out = policy_loss(lp, lp, torch.ones(1), mask)
    assert isinstance(out, LossOutput) and isinstance(out, CheckedLossOutput)
    assert not isinstance(object(), LossOutput)
