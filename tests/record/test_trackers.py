"""Recorder(log_to=...): a plain loop's step metrics reach real trackers (TensorBoard event files, an
offline W&B run file, Trackio's local SQLite store) at each step's own index, with the steps table's
values; so do the step histograms (their counts equal numpy's histogram of the Parquet token rows, per
step and quadrant), the token table (its rows are Parquet rows) and a live alarm's alert. Nothing
mocked: each tracker's own files are read back."""

import glob
import json
import os
import struct
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import pytest

from entropylens import Recorder
from entropylens.record import trackers
from entropylens.alarms import Thresholds
from entropylens.read.query import connect
from entropylens.record.step_table import HIST_EDGES, StepTable, TABLE_COLUMNS

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
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


# explosion at 1e-3 x H0 fires at step 1, the first step after the baseline (any entropy is above it)
FIRING = Thresholds(baseline=1, explosion=1e-3, erc_drop_max=1.0)  # (ERC here drops most: not that rule)
ALERT_LINE = "run={run} step=1 rule=explosion"


def record_loop(root, log_to, run="r", **kw):
    """N_STEPS steps of two updates each; step 1 ends with end_step, step 2 with commit, the others by the
    next step beginning / close: every way a step closes. ``kw``: more Recorder options."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="entropylens alarm")  # FIRING's EntropyAlarm
        _record_loop(root, log_to, run, **kw)


def _record_loop(root, log_to, run, **kw):
    with Recorder(root, run=run, config={"method": "grpo"}, log_to=log_to, **kw) as rec:
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


# ---------------------------------------------------------------- histograms and the table, from the Parquet rows
QUADS = {"PA&HP": "pa_hp", "PA&LP": "pa_lp", "NA&HP": "na_hp", "NA&LP": "na_lp"}
EDGES = 0.5 * 4.0 ** (np.arange(33) / 32)  # 32 log-spaced bins over [0.5, 2]


def token_rows(root, run=None):
    where = f"WHERE run = '{run}'" if run else ""
    return connect(root).execute(
        'SELECT step, "update", seq, pos, token_id, logprob, old_logprob, advantage, quadrant, clip, clipped, '
        f"entropy, old_entropy, erc_kept FROM tokens {where} ORDER BY step, \"update\", seq, pos").df()


def np_counts(x: np.ndarray) -> list[int]:
    """underflow (< 0.5), numpy's histogram over the 32 bins (half-open but the last, which holds no 2.0:
    x >= 2 is the overflow), overflow."""
    inner = np.histogram(x[(x >= 0.5) & (x < 2.0)], bins=EDGES)[0]
    return [int((x < 0.5).sum()), *inner.tolist(), int((x >= 2.0).sum())]


def expected_histograms(root, run=None) -> dict[int, dict[str, list[int]]]:
    """step -> name -> the 34 counts, from every token row (recorded with sample=1.0)."""
    df = token_rows(root, run)
    out: dict[int, dict[str, list[int]]] = {}
    for step, g in df.groupby("step"):
        rho = (g["entropy"].to_numpy() + np.float32(1e-8)) / (g["old_entropy"].to_numpy() + np.float32(1e-8))
        hists = {"entropy_ratio": np_counts(rho)}
        r = np.exp(g["logprob"].to_numpy() - g["old_logprob"].to_numpy())  # float32, as the tokens view
        for q, slug in QUADS.items():
            x = r[(g["quadrant"] == q).to_numpy()]
            if len(x):
                hists[f"ratio_{slug}"] = np_counts(x)
        out[int(step)] = hists
    return out


def drawn_edges() -> np.ndarray:
    """The bins as charts draw them: the under- and overflow bins one bin wide, to 6 decimals."""
    q = 4.0 ** (1 / 32)
    return np.round(np.concatenate([[0.5 / q], EDGES, [2.0 * q]]), 6)


def assert_histograms(got: dict[int, dict[str, list[int]]], root, run=None, at=lambda s: s, prefix=""):
    """got: tracker step -> full name -> the 34 counts."""
    want = expected_histograms(root, run)
    assert sorted(got) == sorted(at(s) for s in want)
    for s, hists in want.items():
        names = {f"{prefix}entropylens/hist/{k}": v for k, v in hists.items()}
        assert sorted(got[at(s)]) == sorted(names), f"step {s}"
        for name, counts in names.items():
            assert got[at(s)][name] == counts, f"step {s} {name}"
    assert sum(sum(h["entropy_ratio"]) for h in want.values()) == len(token_rows(root, run))  # every token


def assert_table_rows(rows: list[dict], root, steps, run=None):
    """Each table row is the Parquet row of its (step, update, seq, pos), column for column."""
    df = token_rows(root, run)
    parquet = {(r["step"], r["update"], r["seq"], r["pos"]): r for r in df.to_dict("records")}
    assert sorted({r["step"] for r in rows}) == list(steps)
    for step in steps:
        mine = [r for r in rows if r["step"] == step]
        assert len(mine) == min(64, int((df["step"] == step).sum())), step  # 64 rows (all of a smaller step)
        keys = [(r["update"], r["seq"], r["pos"]) for r in mine]
        assert keys == sorted(set(keys))  # no row twice, in (update, seq, pos) order
    f32 = np.float32
    for r in rows:
        t = parquet[(r["step"], r["update"], r["seq"], r["pos"])]
        for c in ("token_id", "quadrant", "clip", "clipped", "erc_kept"):
            assert r[c] == t[c], c
        lp, old, h, h_old = f32(t["logprob"]), f32(t["old_logprob"]), f32(t["entropy"]), f32(t["old_entropy"])
        assert f32(r["advantage"]) == f32(t["advantage"]) and f32(r["entropy"]) == h
        assert f32(r["prob"]) == np.exp(old) and f32(r["ratio"]) == np.exp(lp - old)
        assert f32(r["entropy_ratio"]) == (h + f32(1e-8)) / (h_old + f32(1e-8))


def from_bins(values, bins) -> list[int]:
    """W&B's / Trackio's stored (values, bins) as the 34 counts, checking the drawn edges."""
    np.testing.assert_array_equal(bins, drawn_edges())
    return [int(v) for v in values]


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


def tensorboard_histograms(logdir) -> dict[int, dict[str, list[int]]]:
    """step -> tag -> the 34 counts, from the HistogramProto buckets (the non-empty span of the bins:
    each bucket's limit is its right edge; min and max the span's drawn edges)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    edges, out = drawn_edges(), {}
    for events in Path(logdir).rglob("events.out.tfevents.*"):
        acc = EventAccumulator(str(events.parent), size_guidance={"histograms": 0})
        acc.Reload()
        for tag in acc.Tags()["histograms"]:
            for e in acc.Histograms(tag):
                h = e.histogram_value
                right = [int(np.argmin(np.abs(edges - limit))) for limit in h.bucket_limit]
                np.testing.assert_array_equal(h.bucket_limit, edges[right])
                assert right == list(range(right[0], right[-1] + 1))  # one contiguous span of bins
                assert h.min == pytest.approx(edges[right[0] - 1]) and h.max == pytest.approx(edges[right[-1]])
                counts = [0] * 34
                for i, c in zip(right, h.bucket):
                    counts[i - 1] = int(c)
                assert h.num == sum(counts) and h.bucket[0] > 0 and h.bucket[-1] > 0
                out.setdefault(e.step, {})[tag] = counts
    return out


def tensorboard_texts(logdir, tag) -> dict[int, str]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = {}
    for events in Path(logdir).rglob("events.out.tfevents.*"):
        acc = EventAccumulator(str(events.parent), size_guidance={"tensors": 0})
        acc.Reload()
        if tag in acc.Tags()["tensors"]:
            out.update({e.step: e.tensor_proto.string_val[0].decode() for e in acc.Tensors(tag)})
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


def wandb_run_file(wandb_dir) -> str:
    """The (one) offline run file under wandb_dir, once wandb's service has written it whole: its last
    record is the run's exit record. run.finish() returns before the service process has flushed the file
    (under load the history was read half written: no rows, or step 1 alone). A liveness bound, not a
    timing: a file never finished fails here."""
    (path,) = glob.glob(f"{wandb_dir}/wandb/offline-run-*/run-*.wandb")
    for _ in range(600):
        try:
            records = list(wandb_records(path))
        except (AssertionError, ValueError):  # a header or chunk still being written
            records = []
        if records and records[-1].WhichOneof("record_type") == "exit":
            return path
        time.sleep(0.1)
    raise AssertionError(f"{path}: wandb never wrote the run's exit record")


def wandb_history(wandb_dir) -> list[dict]:
    """Every history row of the (one) offline run under wandb_dir, with its step as "_step"."""
    path = wandb_run_file(wandb_dir)
    rows = []
    for r in wandb_records(path):
        if r.WhichOneof("record_type") == "history":
            row = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in r.history.item}
            rows.append({**row, "_step": r.history.step.num})
    return rows


def wandb_run_dir(wandb_dir) -> Path:
    (path,) = glob.glob(f"{wandb_dir}/wandb/offline-run-*")
    return Path(path)


def wandb_alerts(wandb_dir) -> list:
    path = wandb_run_file(wandb_dir)
    return [r.alert for r in wandb_records(path) if r.WhichOneof("record_type") == "alert"]


def wandb_hists(rows, prefix="") -> dict[int, dict[str, list[int]]]:
    """step -> name -> counts, from history rows (a histogram is stored as <name>/values, <name>/bins)."""
    out = {}
    for r in rows:
        for k in r:
            if k.startswith(prefix + "entropylens/hist/") and k.endswith("/values"):
                name = k[: -len("/values")]
                assert r[name + "/_type"] == "histogram"
                out.setdefault(r["_step"], {})[name] = from_bins(r[k], r[name + "/bins"])
    return out


def wandb_tables(rows, wandb_dir, name="entropylens/tokens") -> list[dict]:
    """Every logged token table's rows (the table files under files/), as dicts."""
    out = []
    for r in rows:
        if name + "/path" in r:
            table = json.loads((wandb_run_dir(wandb_dir) / "files" / r[name + "/path"]).read_text())
            assert table["columns"] == list(TABLE_COLUMNS)
            out += [dict(zip(table["columns"], row)) for row in table["data"]]
    return out


def trackio_hists(rows, prefix="", at="step") -> dict[int, dict[str, list[int]]]:
    out = {}
    for r in rows:
        for k, v in r.items():
            if k.startswith(prefix + "entropylens/hist/"):
                assert v["_type"] == "trackio.histogram"
                out.setdefault(int(r[at]), {})[k] = from_bins(v["values"], v["bins"])
    return out


def trackio_tables(rows, name="entropylens/tokens") -> list[dict]:
    out = []
    for r in rows:
        if name in r:
            assert r[name]["_type"] == "trackio.table"
            out += r[name]["_value"]
    return out


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
    record_loop(tmp_path / "runs", {"wandb": {"project": "el-test"}}, alarms=FIRING, stop_on=("explosion",),
                log_table_every=2)
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
    table.add_histograms(0, np.ones(4, np.float32), np.array([0.1, 1, 3, np.inf], np.float32),
                         np.array([1, 1, 4, 0], np.int8))
    h = table.histograms(0)
    assert h["entropy_ratio"].counts[17] == 4 and h["ratio_pa_hp"].counts[[0, 17]].tolist() == [1, 1]
    assert h["ratio_na_lp"].counts[33] == 1 and "ratio_pa_lp" not in h  # the ZA token (inf) in none
    table.close(None)
    assert table._histograms == {} and table.histograms(0) == {}


def test_payload_bytes(tmp_path):
    """The per-step payload trackers.PAYLOAD_BYTES states, measured: the 5 histograms with every bin
    filled, as TensorBoard's HistogramProto values, W&B's and Trackio's JSON; a 64-row table's JSON."""
    pytest.importorskip("tensorboard")
    from entropylens.record.step_table import StepHistogram

    hists = {f"entropylens/hist/{k}": StepHistogram(np.full(34, 123456, np.int64), 1.2345678e5, 2.3456789e5)
             for k in ("entropy_ratio", "ratio_pa_hp", "ratio_pa_lp", "ratio_na_hp", "ratio_na_lp")}
    tb = trackers.TensorBoard(tmp_path / "tb")
    tb.start("p", {})
    events = []
    tb.writer.add_event = events.append
    tb.write(0, {}, hists, None)
    tb_bytes = events[0].summary.ByteSize()
    json_bytes = {name: len(json.dumps({k: {"_type": kind, "values": h.counts.tolist(), "bins": h.edges().tolist()}
                                       for k, h in hists.items()}))
                  for name, kind in (("wandb", "histogram"), ("trackio", "trackio.histogram"))}
    row = [50, 3, 123456, 1023, 151642, 0.123456789, 1.23456789, -0.987654321, "PA&HP", 0, False, 1.23456789,
           1.0123456789, True]
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
    tr = trl_tiny.trainer(tmp_path, "wb", max_steps=3, gradient_accumulation_steps=2, logging_steps=1,
                          report_to=["wandb"], run_name="wb", el={**trl_alarms(), "log_table_every": 2})
    tr.train()
    wandb.finish()  # TRL's callback leaves the run open (finished at exit): its file is complete after this
    rows = wandb_history(wandb_offline)
    assert_trl_rows(rows, tmp_path, "wb", 3)
    # histograms and tables through W&B itself, at train/global_step = step + 1 (rows of their own)
    hist_rows = [{**r, "_step": int(r["train/global_step"])} for r in rows
                 if "train/entropylens/hist/entropy_ratio/values" in r]
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

    tr = trl_tiny.trainer(tmp_path, "tk", max_steps=3, gradient_accumulation_steps=2, logging_steps=1,
                          report_to=["trackio"], run_name="tk", project=project, el=trl_alarms())
    tr.train()
    rows = trackio_logs(project, "tk")
    assert_trl_rows(rows, tmp_path, "tk", 3)
    assert_histograms(trackio_hists(rows, prefix="train/", at="train/global_step"), tmp_path, "tk",
                      at=lambda s: s + 1, prefix="train/")
    assert_table_rows(trackio_tables(rows, "train/entropylens/tokens"), tmp_path, steps=(0,), run="tk")  # every 50
    (alert,) = SQLiteStorage.get_alerts(project, run_name="tk")  # trackio.alert on TRL's run
    assert alert["title"] == "entropylens alarm: explosion" and alert["level"] == "warn"
    assert alert["text"].startswith(ALERT_LINE.format(run="tk"))
