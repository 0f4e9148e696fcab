"""Recorder(log_to=...): a plain loop's step metrics reach real trackers (TensorBoard event files, an
offline W&B run file, Trackio's local SQLite store) at each step's own index, with the steps table's
values. Nothing mocked: each tracker's own files are read back."""

import glob
import json
import os
import struct
import sys
import tempfile
import warnings
from pathlib import Path

import numpy as np
import pytest

from entropylens import Recorder, trackers
from entropylens.query import connect

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_recorder import record_one  # noqa: E402

# trackio reads TRACKIO_DIR once, at its import: point it at a temporary directory before any test imports it
os.environ.setdefault("TRACKIO_DIR", tempfile.mkdtemp(prefix="el-trackio-"))

N_STEPS = 4
# the logged metric -> the steps table's value of the step: token-weighted over the step's updates
CHECKED = ("clip_low_frac", "clip_high_frac", "clip_frac_pa_lp", "clip_frac_na_lp", "erc_drop_frac", "kl_k3",
           "lgn_mean_pa_hp", "lgn_mean_na_lp")


def expected(root) -> dict[int, dict[str, float]]:
    weighted = ", ".join(f"sum({c} * n_tokens) FILTER (WHERE {c} = {c}) / sum(n_tokens) FILTER (WHERE {c} = {c}) {c}"
                         for c in CHECKED)
    shares = ", ".join(f"sum(n_{q}) / sum(n_tokens) share_{q}" for q in ("pa_hp", "pa_lp", "na_hp", "na_lp"))
    df = connect(root).execute(f"SELECT step, {weighted}, {shares} FROM steps GROUP BY step ORDER BY step").df()
    assert df["step"].tolist() == list(range(N_STEPS))
    return {int(r.step): {f"entropylens/{k}": float(v) for k, v in r._asdict().items() if k != "step"}
            for r in df.itertuples(index=False)}


def record_loop(root, log_to, run="r"):
    """N_STEPS steps of two updates each; step 1 ends with end_step, step 2 with commit, the others by the
    next step beginning / close: every way a step closes."""
    with Recorder(root, run=run, config={"method": "grpo"}, log_to=log_to) as rec:
        for step in range(N_STEPS):
            for u in range(2):
                record_one(rec, step, u, seed=10 * step + u, erc=(0.95, 1.05))
            if step == 1:
                rec.end_step(step)
            elif step == 2:
                rec.commit(step)


def assert_matches(got: dict[int, dict[str, float]], root, at=lambda s: s):
    want = expected(root)
    names = set(trackers.step_metrics({"n_tokens": 1.0, **{k: 0.5 for k in trackers.SUMMARY_NAMES}}))
    assert sorted(got) == [at(s) for s in range(N_STEPS)]  # every step, at its own index
    for s, values in want.items():
        row = got[at(s)]
        assert names <= set(row), sorted(names - set(row))  # every metric of the step
        for k, v in values.items():
            np.testing.assert_allclose(row[k], v, rtol=1e-5, atol=1e-7, err_msg=f"step {s} {k}")


# ---------------------------------------------------------------- readers of each tracker's own files
def tensorboard_scalars(logdir) -> dict[int, dict[str, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out: dict[int, dict[str, float]] = {}
    for events in Path(logdir).rglob("events.out.tfevents.*"):
        acc = EventAccumulator(str(events.parent), size_guidance={"scalars": 0})
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            for e in acc.Scalars(tag):
                out.setdefault(e.step, {})[tag] = e.value
    return out


def wandb_records(path):
    """The records of a .wandb run file (W&B's LevelDB-log framing: a 7-byte file header, 32 KiB blocks,
    each chunk a 7-byte header: crc32, length, type FULL/FIRST/MIDDLE/LAST), as wandb's own protobufs."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(path).read_bytes()
    assert data[:4] == b":W&B"
    pos, block, buf = 7, 32768, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # the block's tail is padding
            pos += left
            continue
        _crc, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0 and n == 0:
            pos += left
            continue
        chunk, pos = data[pos + 7:pos + 7 + n], pos + 7 + n
        buf = chunk if kind in (1, 2) else buf + chunk
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(buf)
            yield record


def wandb_history(wandb_dir) -> list[dict]:
    """Every history row of the (one) offline run under wandb_dir, with its step as "_step"."""
    (path,) = glob.glob(f"{wandb_dir}/wandb/offline-run-*/run-*.wandb")
    rows = []
    for r in wandb_records(path):
        if r.WhichOneof("record_type") == "history":
            row = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in r.history.item}
            rows.append({**row, "_step": r.history.step.num})
    return rows


def trackio_logs(project, run) -> list[dict]:
    from trackio.sqlite_storage import SQLiteStorage

    return SQLiteStorage.get_logs(project, run)


@pytest.fixture
def wandb_offline(tmp_path, monkeypatch):
    """W&B offline into tmp_path (WANDB_MODE=offline, WANDB_DIR); wandb's process-wide settings are
    read anew for the test (wandb.teardown)."""
    wandb = pytest.importorskip("wandb")
    wd = tmp_path / "wandb-dir"
    wd.mkdir()
    for k, v in {"WANDB_MODE": "offline", "WANDB_DIR": str(wd), "WANDB_SILENT": "true",
                 "WANDB_DISABLE_GIT": "true", "WANDB_CONSOLE": "off"}.items():
        monkeypatch.setenv(k, v)
    wandb.teardown()
    yield wd
    wandb.teardown()


# ---------------------------------------------------------------- plain loop, each tracker
def test_tensorboard_gets_every_step_at_its_step(tmp_path):
    pytest.importorskip("tensorboard")
    record_loop(tmp_path / "runs", {"tensorboard": tmp_path / "tb"})
    assert_matches(tensorboard_scalars(tmp_path / "tb"), tmp_path / "runs")


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
    record_loop(tmp_path / "runs", {"wandb": {"project": "el-test"}})
    rows = [r for r in wandb_history(wandb_offline) if "entropylens/clip_low_frac" in r]
    assert_matches({r["_step"]: r for r in rows}, tmp_path / "runs")


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
    project = f"el-{tmp_path.name}"
    record_loop(tmp_path / "runs", {"trackio": project}, run="tr")
    rows = [r for r in trackio_logs(project, "tr") if "entropylens/clip_low_frac" in r]
    assert_matches({r["step"]: r for r in rows}, tmp_path / "runs")


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
    df = connect(root).execute(
        "SELECT step, sum(clip_low_frac * n_tokens) / sum(n_tokens) low, sum(clip_high_frac * n_tokens) / "
        "sum(n_tokens) high, sum(kl_k3 * n_tokens) / sum(n_tokens) kl, sum(n_pa_lp) / sum(n_tokens) pa_lp "
        f"FROM steps WHERE run = '{run}' GROUP BY step ORDER BY step").df()
    names = {"low": "clip_low_frac", "high": "clip_high_frac", "kl": "kl_k3", "pa_lp": "share_pa_lp"}
    return {int(r.step) + 1: {f"train/entropylens/{names[k]}": float(v) for k, v in r._asdict().items() if k != "step"}
            for r in df.itertuples(index=False)}


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
    sys.path.insert(0, str(Path(__file__).resolve().parent / "helpers"))
    import trl_tiny

    return trl_tiny


def test_trl_report_to_wandb_offline(tmp_path, wandb_offline, monkeypatch):
    trl_tiny = _trl_tiny()
    monkeypatch.setenv("WANDB_PROJECT", "el-trl")
    tr = trl_tiny.trainer(tmp_path, "wb", max_steps=3, gradient_accumulation_steps=2, logging_steps=1,
                          report_to=["wandb"], run_name="wb")
    tr.train()
    assert_trl_rows(wandb_history(wandb_offline), tmp_path, "wb", 3)


def test_trl_report_to_trackio(tmp_path):
    trl_tiny = _trl_tiny()
    pytest.importorskip("trackio")
    project = f"el-trl-{tmp_path.name}"
    tr = trl_tiny.trainer(tmp_path, "tk", max_steps=3, gradient_accumulation_steps=2, logging_steps=1,
                          report_to=["trackio"], run_name="tk", project=project)
    tr.train()
    assert_trl_rows(trackio_logs(project, "tk"), tmp_path, "tk", 3)
