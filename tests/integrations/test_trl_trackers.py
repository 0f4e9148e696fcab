"""TRL's own trackers get entropylens' step metrics at every logged step, at the step they describe
(a 6-step run: each of the 6 steps, none skipped or shifted). A real
TensorBoard run through TRL's report_to, offline; the event files read back with tensorboard's
EventAccumulator and checked against the steps table; the step histograms (written through TRL's own
TensorBoard writer) against numpy's histogram of the Parquet token rows, and a live alarm as a text
summary."""

import sys
from pathlib import Path

import numpy as np
import pytest

from entropylens.read.query import connect

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "helpers"))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import trl_tiny  # noqa: E402
from tracker_files import ALERT_LINE, FIRING, assert_histograms, tensorboard_histograms, tensorboard_texts  # noqa: E402

pytest.importorskip("tensorboard")


def _scalars(logdir: Path) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out: dict[str, dict[int, float]] = {}
    for events in logdir.rglob("events.out.tfevents.*"):
        acc = EventAccumulator(str(events.parent), size_guidance={"scalars": 0})
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            out.setdefault(tag, {}).update({e.step: e.value for e in acc.Scalars(tag)})
    return out


def test_tensorboard_gets_every_steps_metrics_at_its_step(tmp_path, monkeypatch):
    tb = tmp_path / "tb"
    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(tb))  # transformers' TensorBoardCallback reads it
    tr = trl_tiny.trainer(
        tmp_path,
        "tb",
        max_steps=6,
        gradient_accumulation_steps=2,
        num_iterations=2,
        logging_steps=1,
        report_to=["tensorboard"],
        el=dict(alarms=FIRING),
    )
    with pytest.warns(UserWarning, match="entropylens alarm"):
        tr.train()
    got = _scalars(tb)
    # TRL's own log of every step stays (logging entropylens' values must not cancel TRL's due log)
    assert sorted(got["train/entropy"]) == [1, 2, 3, 4, 5, 6]
    assert sorted(h["step"] for h in tr.state.log_history if "loss" in h) == [1, 2, 3, 4, 5, 6]
    steps = (
        connect(tmp_path / "tb")
        .execute(
            "SELECT step, sum(n_tokens) n, sum(clip_low_frac * n_tokens) / sum(n_tokens) low, "
            "sum(clip_high_frac * n_tokens) / sum(n_tokens) high, sum(n_pa_lp) / sum(n_tokens) pa_lp, "
            "sum(kl_k3 * n_tokens) / sum(n_tokens) kl FROM steps GROUP BY step ORDER BY step"
        )
        .df()
    )
    assert steps["step"].tolist() == [0, 1, 2, 3, 4, 5]
    for tag, col in (
        ("train/entropylens/clip_low_frac", "low"),
        ("train/entropylens/clip_high_frac", "high"),
        ("train/entropylens/share_pa_lp", "pa_lp"),
        ("train/entropylens/kl_k3", "kl"),
    ):
        assert sorted(got[tag]) == [1, 2, 3, 4, 5, 6], tag  # every step, at its own index
        np.testing.assert_allclose(
            [got[tag][s + 1] for s in steps["step"]], steps[col], rtol=1e-5, atol=1e-7, err_msg=tag
        )
    # the histograms at the same global_step, with numpy's counts over every token row (sample=1.0)
    assert_histograms(tensorboard_histograms(tb), tmp_path / "tb", "tb", at=lambda s: s + 1, prefix="train/")
    # TensorBoard has no alerts: a text summary (SummaryWriter.add_text adds /text_summary to the tag)
    texts = tensorboard_texts(tb, "train/entropylens/alarms/text_summary")
    assert list(texts) == [2] and texts[2].startswith("WARN: " + ALERT_LINE.format(run="tb"))
