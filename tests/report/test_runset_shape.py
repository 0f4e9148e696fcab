"""A comparison is controlled only where the runs also share what a curve means: steps recorded, updates
per step, responses per step, group size (report/runset.py RECORDED_SHAPE)."""

import torch

from entropylens import Recorder
from entropylens.read.query import connect
from entropylens.report import runset
from entropylens.rl.losses import policy_loss


def _run(root, run: str, method: str, steps: int, groups: int = 2, group_size: int = 2) -> None:
    gen = torch.Generator().manual_seed(0)
    b, t = groups * group_size, 4
    with Recorder(root, run, config={"method": method, "lr": 1e-3}) as rec:
        for step in range(steps):
            mask = torch.ones(b, t, dtype=torch.bool)  # [B, T]
            old = (0.1 + 0.8 * torch.rand(b, t, generator=gen)).log()  # [B, T]
            adv = torch.tensor([0.5, -0.5] * (b // 2))  # [B]
            seq = torch.arange(b) + step * b
            grp = torch.arange(b) // group_size
            rec.record_sequences(
                step, seq_ids=seq, rewards=adv, advantages=adv, lengths=torch.full((b,), t), group_ids=grp
            )
            out = policy_loss(old, old, adv, mask, method=method)
            rec.record_update(
                step, 0, mask=mask, advantages=adv, logprobs=old, old_logprobs=old, seq_ids=seq, group_ids=grp, loss=out
            )
            rec.record_step(step, grad_norm=1.0)


def test_a_3_step_and_a_10_step_run_are_not_called_controlled(tmp_path):
    _run(tmp_path, "grpo-3", "grpo", 3)
    _run(tmp_path, "dapo-10", "dapo", 10)
    rs = runset.from_connection(connect(tmp_path))
    assert rs.factors()["steps recorded"] == [3, 10]
    assert rs.controlled_in() is None
    text = rs.differs_text()
    assert "steps recorded (3, 10)" in text and "not a controlled comparison" in text, text


def test_same_shape_different_method_is_controlled_and_group_size_counts(tmp_path):
    _run(tmp_path / "a", "grpo-5", "grpo", 5)
    _run(tmp_path / "a", "dapo-5", "dapo", 5)
    assert runset.from_connection(connect(tmp_path / "a")).controlled_in() == "method"
    _run(tmp_path / "b", "grpo-g2", "grpo", 5, groups=2, group_size=2)
    _run(tmp_path / "b", "dapo-g4", "dapo", 5, groups=1, group_size=4)
    rs = runset.from_connection(connect(tmp_path / "b"))
    assert rs.factors()["group size"] == [2, 4] and rs.controlled_in() is None
    assert "responses per step" not in rs.factors()  # 4 responses per step in both
