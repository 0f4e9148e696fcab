"""Recorder(log_to=...): a plain loop's step metrics reach real trackers (TensorBoard event files, an
offline W&B run file, Trackio's local SQLite store) at each step's own index, with the steps table's
values; so do the step histograms (their counts equal numpy's histogram of the Parquet token rows, per
step and quadrant), the token table (its rows are Parquet rows) and a live alarm's alert. Nothing
mocked: each tracker's own files are read back."""

import json
import math
import os
import sys
import tempfile
import warnings
from pathlib import Path

import numpy as np
import pytest

from entropylens import Recorder
from entropylens.read.query import connect
from entropylens.record import trackers
from entropylens.record.writing.step_table import HIST_EDGES, TABLE_COLUMNS, StepTable

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from recorded_batches import record_one  # noqa: E402
from tracker_files import (  # noqa: E402 - the trackers' file readers
    ALERT_LINE,
    EDGES,
    FIRING,
    N_STEPS,
    assert_histograms,
    assert_matches,
    assert_table_rows,
    record_loop,
    tensorboard_histograms,
    tensorboard_scalars,
    tensorboard_texts,
    trackio_hists,
    trackio_logs,
    trackio_tables,
    wandb_alerts,
    wandb_history,
    wandb_hists,
    wandb_tables,
)

# trackio reads TRACKIO_DIR once, at its import: point it at a temporary directory before any test imports it
os.environ.setdefault("TRACKIO_DIR", tempfile.mkdtemp(prefix="el-trackio-"))


@pytest.fixture
def wandb_offline(tmp_path, monkeypatch):
    """W&B offline into tmp_path (WANDB_MODE=offline, WANDB_DIR); wandb's process-wide settings are
    read anew for the test (wandb.teardown)."""
    wandb = pytest.importorskip("wandb")
    wd = tmp_path / "wandb-dir"
    wd.mkdir()
    for k, v in {
        "WANDB_MODE": "offline",
        "WANDB_DIR": str(wd),
        "WANDB_SILENT": "true",
        "WANDB_DISABLE_GIT": "true",
        "WANDB_CONSOLE": "off",
    }.items():
        monkeypatch.setenv(k, v)
    wandb.teardown()
    yield wd
    wandb.teardown()


# ---------------------------------------------------------------- plain loop, each tracker
def test_tensorboard_gets_every_step_at_its_step(tmp_path):
    pytest.importorskip("tensorboard")
    record_loop(tmp_path / "runs", {"tensorboard": tmp_path / "tb"}, alarms=FIRING)
    assert_matches(tensorboard_scalars(tmp_path / "tb"), tmp_path / "runs")
    # the histograms, in the same events: every step, counts equal to numpy's over the Parquet rows
    assert_histograms(tensorboard_histograms(tmp_path / "tb"), tmp_path / "runs")
    # TensorBoard has no alerts: the finding is a text summary at its step
    texts = tensorboard_texts(tmp_path / "tb", "entropylens/alarms")
    assert list(texts) == [1] and texts[1].startswith("WARN: " + ALERT_LINE.format(run="r"))


def test_tensorboard_default_logdir_and_object(tmp_path, monkeypatch):
    pytest.importorskip("tensorboard")
    monkeypatch.chdir(tmp_path)
    record_loop(tmp_path / "runs", "tensorboard", run="r1")  # runs/<run id> under the working directory
    assert_matches(tensorboard_scalars(tmp_path / "runs" / "r1"), tmp_path / "runs")
    record_loop(tmp_path / "o", trackers.TensorBoard(tmp_path / "tb-obj"))
    assert_matches(tensorboard_scalars(tmp_path / "tb-obj"), tmp_path / "o")


def test_callable_and_list(tmp_path):
    seen: dict[int, dict] = {}
    record_loop(tmp_path, [lambda step, m: seen.setdefault(step, m)])
    assert_matches(seen, tmp_path)


def test_wandb_offline_gets_every_step_at_its_step(tmp_path, wandb_offline):
    record_loop(
        tmp_path / "runs", {"wandb": {"project": "el-test"}}, alarms=FIRING, stop_on=("explosion",), log_table_every=2
    )
    rows = [r for r in wandb_history(wandb_offline) if "entropylens/clip_low_frac" in r]
    assert_matches({r["_step"]: r for r in rows}, tmp_path / "runs")
    # histograms in the same history rows; the table (steps 0 and 2) as W&B table files
    assert_histograms(wandb_hists(rows), tmp_path / "runs")
    assert_table_rows(wandb_tables(rows, wandb_offline), tmp_path / "runs", steps=(0, 2))
    # the alert, in the offline run file (W&B's AlertRecord): ERROR for a stop_on rule
    (alert,) = wandb_alerts(wandb_offline)
    assert alert.title == "entropylens alarm: explosion" and alert.level == "ERROR"
    assert alert.text.startswith(ALERT_LINE.format(run="r")) and alert.text.endswith("training stops)")


def test_wandb_uses_the_active_run(tmp_path, wandb_offline):
    import wandb

    run = wandb.init(project="el-test", name="mine")
    try:
        record_loop(tmp_path / "runs", "wandb")
        assert wandb.run is run  # left open: the loop's run, not the recorder's
    finally:
        run.finish()
    rows = [r for r in wandb_history(wandb_offline) if "entropylens/clip_low_frac" in r]
    assert_matches({r["_step"]: r for r in rows}, tmp_path / "runs")


def test_trackio_local_store_gets_every_step_at_its_step(tmp_path):
    pytest.importorskip("trackio")
    from trackio.sqlite_storage import SQLiteStorage

    project = f"el-{tmp_path.name}"
    record_loop(tmp_path / "runs", {"trackio": project}, run="tr", alarms=FIRING, log_table_every=3)
    rows = [r for r in trackio_logs(project, "tr") if "entropylens/clip_low_frac" in r]
    assert_matches({r["step"]: r for r in rows}, tmp_path / "runs")
    assert_histograms(trackio_hists(rows), tmp_path / "runs")
    assert_table_rows(trackio_tables(rows), tmp_path / "runs", steps=(0, 3))
    (alert,) = SQLiteStorage.get_alerts(project, run_name="tr")  # trackio's alerts table
    assert alert["title"] == "entropylens alarm: explosion" and alert["level"] == "warn" and alert["step"] == 1
    assert alert["text"] == ALERT_LINE.format(run="tr") + " value=" + alert["text"].split("value=")[1]


def test_histograms_and_table_options(tmp_path):
    """Off without log_to (the writer counts nothing), on by default with it; log_histograms=False and
    log_table_every=0 turn each off; the step's counts leave the writer's table when the step closes."""
    seen = {}

    class Catch(trackers.Tracker):
        has_tables = True

        def write(self, step, metrics, histograms, table):
            seen[step] = (histograms, table)

    with Recorder(tmp_path, run="plain") as rec:
        assert not rec._writer.work.histograms and rec._writer.work.table_every == 0
    record_loop(tmp_path, Catch(), run="default")
    assert all(len(h) >= 3 for h, _ in seen.values())  # rho and the quadrants with tokens
    assert [s for s, (_, t) in seen.items() if t is not None] == [0]  # every 50 steps: step 0
    seen.clear()
    record_loop(tmp_path, Catch(), run="off", log_histograms=False, log_table_every=0)
    assert seen and all(h == {} and t is None for h, t in seen.values())
    with pytest.raises(ValueError, match="log_table_every"):
        Recorder(tmp_path, run="bad", log_table_every=-1)
    np.testing.assert_array_equal(HIST_EDGES, EDGES)  # the bins the tests count in
    table = StepTable()
    table.add_aggregates(0, 0, {"n_tokens": 4})
    table.add_histograms(
        0, np.ones(4, np.float32), np.array([0.1, 1, 3, np.inf], np.float32), np.array([1, 1, 4, 0], np.int8)
    )
    h = table.histograms(0)
    assert h["entropy_ratio"].counts[17] == 4 and h["ratio_pa_hp"].counts[[0, 17]].tolist() == [1, 1]
    assert h["ratio_na_lp"].counts[33] == 1 and "ratio_pa_lp" not in h  # the ZA token (inf) in none
    table.close(None)
    assert table._histograms == {} and table.histograms(0) == {}


def test_payload_bytes(tmp_path):
    """The per-step payload trackers.PAYLOAD_BYTES states, measured: the 5 histograms with every bin
    filled, as TensorBoard's HistogramProto values, W&B's and Trackio's JSON; a 64-row table's JSON."""
    pytest.importorskip("tensorboard")
    from entropylens.record.writing.step_table import StepHistogram

    hists = {
        f"entropylens/hist/{k}": StepHistogram(np.full(34, 123456, np.int64), 1.2345678e5, 2.3456789e5)
        for k in ("entropy_ratio", "ratio_pa_hp", "ratio_pa_lp", "ratio_na_hp", "ratio_na_lp")
    }
    tb = trackers.TensorBoard(tmp_path / "tb")
    tb.start("p", {})
    events = []
    tb.writer.add_event = events.append
    tb.write(0, {}, hists, None)
    tb_bytes = events[0].summary.ByteSize()
    json_bytes = {
        name: len(
            json.dumps(
                {k: {"_type": kind, "values": h.counts.tolist(), "bins": h.edges().tolist()} for k, h in hists.items()}
            )
        )
        for name, kind in (("wandb", "histogram"), ("trackio", "trackio.histogram"))
    }
    row = [
        50,
        3,
        123456,
        1023,
        151642,
        0.123456789,
        1.23456789,
        -0.987654321,
        "PA&HP",
        0,
        False,
        1.23456789,
        1.0123456789,
        True,
    ]
    table_bytes = len(json.dumps({"columns": list(TABLE_COLUMNS), "data": [row] * 64}))
    got = {"tensorboard": tb_bytes, **json_bytes, "table": table_bytes}
    for name, n in got.items():  # the stated size, to within 5%
        assert 0.95 * trackers.PAYLOAD_BYTES[name] <= n <= trackers.PAYLOAD_BYTES[name], (name, n)
    print(f"payload per step (bytes): {got}")


# ---------------------------------------------------------------- failures and the hot path
def test_a_failing_tracker_warns_once_and_training_goes_on(tmp_path):
    calls = []

    def broken(step, metrics):
        calls.append(step)
        raise OSError("disk full")

    seen = {}
    with pytest.warns(UserWarning, match="disk full") as caught:
        record_loop(tmp_path, [broken, lambda s, m: seen.setdefault(s, m)])
    assert calls == [0]  # dropped after its first failure
    assert len([w for w in caught if "log_to" in str(w.message)]) == 1
    assert_matches(seen, tmp_path)  # the other tracker got every step


def test_bad_log_to_is_refused_before_anything_is_written(tmp_path):
    with pytest.raises(ValueError, match="unknown tracker"):
        Recorder(tmp_path, run="r", log_to="mlflow")
    with pytest.raises(TypeError, match="log_to"):
        Recorder(tmp_path, run="r", log_to=3)
    assert not (tmp_path / "r").exists()


def test_training_thread_does_not_wait_for_the_writer(tmp_path):
    """A step whose summary the writer has not answered yet is logged later, never waited for: with the
    writer thread held, recording goes on and nothing is logged until it is released."""
    seen = {}
    rec = Recorder(tmp_path, run="r", config={"method": "grpo"}, log_to=lambda s, m: seen.setdefault(s, m))
    hold = rec._writer.summary_request  # the writer's reply to a summary: held until released
    gate = __import__("threading").Event()

    class Held:
        def __init__(self, reply):
            self.reply = reply

        def done(self):
            return gate.is_set() and self.reply.done()

    rec._writer.summary_request = lambda *a, **k: Held(hold(*a, **k))
    answer = rec._writer.answer
    rec._writer.answer = lambda r: answer(r.reply if isinstance(r, Held) else r)
    try:
        for step in range(N_STEPS):
            for u in range(2):
                record_one(rec, step, u, seed=10 * step + u, erc=(0.95, 1.05))
            rec.end_step(step)
        assert seen == {}  # asked for, not waited for
        gate.set()
    finally:
        rec.close()
    assert_matches(seen, tmp_path)


def test_no_log_to_costs_nothing(tmp_path):
    with Recorder(tmp_path, run="r") as rec:
        record_one(rec, 0, 0)
        assert rec._step_log is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert trackers.resolve(None) == []
    assert trackers.step_metrics({"n_tokens": 0.0}) == {}


# ---------------------------------------------------------------- TRL's report_to: W&B and Trackio
def trl_steps(root, run) -> dict[int, dict[str, float]]:
    """The steps table of a TRL run as TRL's trackers should carry it: step S at global_step S + 1."""
    df = (
        connect(root)
        .execute(
            "SELECT step, sum(clip_low_frac * n_tokens) / sum(n_tokens) low, sum(clip_high_frac * n_tokens) / "
            "sum(n_tokens) high, sum(kl_k3 * n_tokens) / sum(n_tokens) kl, sum(n_pa_lp) / sum(n_tokens) pa_lp "
            f"FROM steps WHERE run = '{run}' GROUP BY step ORDER BY step"
        )
        .df()
    )
    names = {"low": "clip_low_frac", "high": "clip_high_frac", "kl": "kl_k3", "pa_lp": "share_pa_lp"}
    return {
        int(r.step) + 1: {f"train/entropylens/{names[k]}": float(v) for k, v in r._asdict().items() if k != "step"}
        for r in df.itertuples(index=False)
    }


def assert_trl_rows(rows: list[dict], root, run, n_steps):
    """TRL's callbacks log without a step (W&B and Trackio count their own): each row's index is its
    train/global_step, which must be the step the values describe."""
    want = trl_steps(root, run)
    assert sorted(want) == list(range(1, n_steps + 1))
    got = {int(r["train/global_step"]): r for r in rows if "train/entropylens/clip_low_frac" in r}
    assert sorted(got) == sorted(want)  # every step 1..N
    for g, values in want.items():
        for k, v in values.items():
            np.testing.assert_allclose(got[g][k], v, rtol=1e-5, atol=1e-7, err_msg=f"global_step {g} {k}")
    # TRL's own metrics of every step stay
    assert sorted(int(r["train/global_step"]) for r in rows if "train/loss" in r) == list(range(1, n_steps + 1))


def _trl_tiny():
    pytest.importorskip("trl")
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "helpers"))
    import trl_tiny

    return trl_tiny


def trl_alarms():
    """A TRL run's live alarms that fire (explosion at step 1) and warn (EntropyAlarm, not an error here)."""
    warnings.filterwarnings("ignore", message="entropylens alarm")
    return dict(alarms=FIRING)


def test_trl_report_to_wandb_offline(tmp_path, wandb_offline, monkeypatch):
    import wandb

    trl_tiny = _trl_tiny()
    monkeypatch.setenv("WANDB_PROJECT", "el-trl")
    tr = trl_tiny.trainer(
        tmp_path,
        "wb",
        max_steps=3,
        gradient_accumulation_steps=2,
        logging_steps=1,
        report_to=["wandb"],
        run_name="wb",
        el={**trl_alarms(), "log_table_every": 2},
    )
    tr.train()
    wandb.finish()  # TRL's callback leaves the run open (finished at exit): its file is complete after this
    rows = wandb_history(wandb_offline)
    assert_trl_rows(rows, tmp_path, "wb", 3)
    # histograms and tables through W&B itself, at train/global_step = step + 1 (rows of their own)
    hist_rows = [
        {**r, "_step": int(r["train/global_step"])} for r in rows if "train/entropylens/hist/entropy_ratio/values" in r
    ]
    assert_histograms(wandb_hists(hist_rows, prefix="train/"), tmp_path, "wb", at=lambda s: s + 1, prefix="train/")
    assert_table_rows(wandb_tables(rows, wandb_offline, "train/entropylens/tokens"), tmp_path, steps=(0, 2), run="wb")
    (alert,) = wandb_alerts(wandb_offline)  # the finding, through the run TRL's callback started
    assert alert.title == "entropylens alarm: explosion" and alert.level == "WARN"
    assert alert.text.startswith(ALERT_LINE.format(run="wb"))


def test_trl_report_to_trackio(tmp_path):
    trl_tiny = _trl_tiny()
    pytest.importorskip("trackio")
    project = f"el-trl-{tmp_path.name}"
    from trackio.sqlite_storage import SQLiteStorage

    tr = trl_tiny.trainer(
        tmp_path,
        "tk",
        max_steps=3,
        gradient_accumulation_steps=2,
        logging_steps=1,
        report_to=["trackio"],
        run_name="tk",
        project=project,
        el=trl_alarms(),
    )
    tr.train()
    rows = trackio_logs(project, "tk")
    assert_trl_rows(rows, tmp_path, "tk", 3)
    assert_histograms(
        trackio_hists(rows, prefix="train/", at="train/global_step"),
        tmp_path,
        "tk",
        at=lambda s: s + 1,
        prefix="train/",
    )
    assert_table_rows(trackio_tables(rows, "train/entropylens/tokens"), tmp_path, steps=(0,), run="tk")  # every 50
    (alert,) = SQLiteStorage.get_alerts(project, run_name="tk")  # trackio.alert on TRL's run
    assert alert["title"] == "entropylens alarm: explosion" and alert["level"] == "warn"
    assert alert["text"].startswith(ALERT_LINE.format(run="tk"))


# ---------------------------------------------------------------- two clip definitions on one step
def test_the_two_clip_definitions_on_one_batch(tmp_path):
    """TRL's clip_ratio/low_mean is the mean of the micro-batches' token shares; entropylens/clip_low_frac is
    the pooled share of the step's tokens. One step, two micro-batches of 2 x 61 tokens each (t the positions
    0..60 of both rows), ratio 0.7 (below 1 - 0.2) on A < 0 tokens, else 1:
      micro-batch 0: row 1 (A = -1) clips its first 10 tokens -> 10 / 122 = 0.08197
      micro-batch 1: row 1 (A = -1) clips its first  1 token  ->  1 / 122 = 0.00820
    TRL: (10/122 + 1/122) / 2 = 11/244 = 0.04508; pooled: (10 + 1) / 244 = 0.04508: equal when the
    micro-batches are of one size. With micro-batch 1 of 2 x 30 tokens (1 / 60 = 0.01667): TRL
    (0.08197 + 0.01667) / 2 = 0.04932, pooled 11 / 182 = 0.06044. Both are right; they weight differently."""
    import torch

    from entropylens.rl.losses import policy_loss

    seen: dict[int, dict] = {}
    with Recorder(tmp_path, run="r", log_to=lambda step, m: seen.setdefault(step, m)) as rec:
        trl_fracs = []
        for u, (length, n_clip) in enumerate([(61, 10), (30, 1)]):
            mask = torch.ones(2, length, dtype=torch.bool)
            adv = torch.tensor([1.0, -1.0])
            old = torch.full((2, length), -1.0)
            logp = old.clone()
            logp[1, :n_clip] += math.log(0.7)  # ratio 0.7 on the A < 0 row's first n_clip tokens
            out = policy_loss(logp, old, adv, mask, method="grpo")
            low = (out.columns["clip"] == -1) & (adv[:, None] < 0) & mask  # TRL's is_low_clipped
            trl_fracs.append(float(low.sum() / mask.sum()))  # TRL: global_masked_mean per micro-batch
            rec.record_update(
                0,
                u,
                mask=mask,
                advantages=adv,
                logprobs=logp,
                old_logprobs=old,
                seq_ids=torch.arange(2) + 2 * u,
                loss=out,
            )
        rec.end_step(0)
    trl = sum(trl_fracs) / len(trl_fracs)  # TRL's log(): the mean over the micro-batches
    assert trl == pytest.approx((10 / 122 + 1 / 60) / 2)
    assert seen[0]["entropylens/clip_low_frac"] == pytest.approx(11 / 182, rel=1e-6)
    assert abs(trl - 11 / 182) > 0.01
