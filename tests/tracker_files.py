"""Reading back what real trackers wrote (TensorBoard event files, an offline W&B run file, Trackio's
SQLite store) and what the Parquet rows say they should hold: shared by the trackers' tests."""

import glob
import json
import struct
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
from recorded_batches import record_one

from entropylens import Recorder
from entropylens.alarms import Thresholds
from entropylens.read.query import connect
from entropylens.record import trackers
from entropylens.record.writing.step_table import TABLE_COLUMNS

N_STEPS = 4
# the logged metric -> the steps table's value of the step: token-weighted over the step's updates
CHECKED = (
    "clip_low_frac",
    "clip_high_frac",
    "clip_frac_pa_lp",
    "clip_frac_na_lp",
    "erc_drop_frac",
    "kl_k3",
    "lgn_mean_pa_hp",
    "lgn_mean_na_lp",
)


def expected(root) -> dict[int, dict[str, float]]:
    weighted = ", ".join(
        f"sum({c} * n_tokens) FILTER (WHERE {c} = {c}) / sum(n_tokens) FILTER (WHERE {c} = {c}) {c}" for c in CHECKED
    )
    shares = ", ".join(f"sum(n_{q}) / sum(n_tokens) share_{q}" for q in ("pa_hp", "pa_lp", "na_hp", "na_lp"))
    df = connect(root).execute(f"SELECT step, {weighted}, {shares} FROM steps GROUP BY step ORDER BY step").df()
    assert df["step"].tolist() == list(range(N_STEPS))
    return {
        int(r.step): {f"entropylens/{k}": float(v) for k, v in r._asdict().items() if k != "step"}
        for r in df.itertuples(index=False)
    }


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
        # a quadrant without tokens at the step: its means and fractions are not measured, left out (never 0)
        empty = {
            f"entropylens/{m}_{q}"
            for q in QUADS.values()
            if values[f"entropylens/share_{q}"] == 0
            for m in ("lgn_mean", "clip_frac")
        }
        assert names - empty <= set(row), sorted(names - empty - set(row))  # every metric of the step
        assert not empty & set(row), sorted(empty & set(row))
        for k, v in values.items():
            if k not in empty:
                np.testing.assert_allclose(row[k], v, rtol=1e-5, atol=1e-7, err_msg=f"step {s} {k}")


# ---------------------------------------------------------------- histograms and the table, from the Parquet rows
QUADS = {"PA&HP": "pa_hp", "PA&LP": "pa_lp", "NA&HP": "na_hp", "NA&LP": "na_lp"}
EDGES = 0.5 * 4.0 ** (np.arange(33) / 32)  # 32 log-spaced bins over [0.5, 2]


def token_rows(root, run=None):
    where = f"WHERE run = '{run}'" if run else ""
    return (
        connect(root)
        .execute(
            'SELECT step, "update", seq, pos, token_id, logprob, old_logprob, advantage, quadrant, clip, clipped, '
            f'entropy, old_entropy, erc_kept FROM tokens {where} ORDER BY step, "update", seq, pos'
        )
        .df()
    )


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
        _crc, n, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0 and n == 0:
            pos += left
            continue
        chunk, pos = data[pos + 7 : pos + 7 + n], pos + 7 + n
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
