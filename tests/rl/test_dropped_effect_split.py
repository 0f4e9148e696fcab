"""The dropped entropy effect split by cause (steps.entropy_effect_dropped_clip_low / _clip_high /
_dual_clip / _erc): the parts add up to entropy_effect_dropped, on a hand-built update whose numbers
are worked out below and on real policy_loss updates, through a real Recorder, Parquet and DuckDB."""

import json
import math

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from entropylens import Recorder
from entropylens.read.query import connect
from entropylens.rl import stats
from entropylens.rl.losses import policy_loss

CAUSES = ("clip_low", "clip_high", "dual_clip", "erc")


class _Loss:
    """What record_update(loss=...) reads: columns, loss value, config."""

    def __init__(self, columns, loss=None, config=None):
        self.columns, self.loss, self.config = columns, loss, config or {}


def _steps(path, cols):
    con = connect(path)
    return con.execute(
        f"SELECT {', '.join(cols)} FROM steps WHERE n_tokens IS NOT NULL ORDER BY step, update"
    ).fetchall()


# ------------------------------------------------------------------ hand-built
# One sequence of 6 positions, T = 1, s given directly (entropy_sensitivity):
#   t  what                                g_u    g_e    g     s     dropped            by cause
#   0  inside, unchanged                   -0.2   -0.2  -0.2   0.5   null               -
#   1  PPO-clipped low side (A < 0)         0.3    0     0    -1.0   0.3 * -1 = -0.3    clip_low -0.3
#   2  beta-scaled high side, ERC dropped  -0.5   -0.4   0     2.0   -0.5 * 2 = -1.0    clip_high (-0.5+0.4)*2 = -0.2,
#                                                                                       erc -0.4 * 2 = -0.8
#   3  dual-clipped (A < 0, r > c, +1)      0.6    0     0     0.5   0.3                dual_clip 0.3
#   4  inside, ERC dropped                 -0.1   -0.1   0     4.0   -0.4               erc -0.4
#   5  masked out (its values are ignored)  9      9     0     1.0   -                  -
# total dropped -1.4 = clip_low -0.3 + clip_high -0.2 + dual_clip 0.3 + erc -1.2; by region (where):
# dropped_low -0.3 (t1), dropped_high -0.7 (t2 + t3); entropy_effect = -0.2 * 0.5 = -0.1 (t0).
G_U = [-0.2, 0.3, -0.5, 0.6, -0.1, 9.0]
G_E = [-0.2, 0.0, -0.4, 0.0, -0.1, 9.0]
G = [-0.2, 0.0, 0.0, 0.0, 0.0, 0.0]
S = [0.5, -1.0, 2.0, 0.5, 4.0, 1.0]
CLIP = [0, -1, 1, 1, 0, 0]
CLIPPED = [False, True, True, False, False, False]
DUAL = [False, False, False, True, False, False]
ERC_KEPT = [True, True, False, True, False, True]
CHANGED = [False, True, True, True, True, True]
ADV = [1.0, -1.0, 1.0, -1.0, 1.0, 1.0]
WANT = {
    "entropy_effect": -0.1,
    "entropy_effect_dropped": -1.4,
    "entropy_effect_dropped_low": -0.3,
    "entropy_effect_dropped_high": -0.7,
    "entropy_effect_dropped_clip_low": -0.3,
    "entropy_effect_dropped_clip_high": -0.2,
    "entropy_effect_dropped_dual_clip": 0.3,
    "entropy_effect_dropped_erc": -1.2,
}


def _hand_columns(dual=True, before_erc=True):
    t = lambda v, dt=torch.float32: torch.tensor([v], dtype=dt)  # noqa: E731  [1, 6]
    cols = {
        "grad_coef": t(G),
        "grad_coef_unclipped": t(G_U),
        "clip": t(CLIP, torch.int8),
        "clipped": t(CLIPPED, torch.bool),
        "erc_kept": t(ERC_KEPT, torch.bool),
        "grad_changed": t(CHANGED, torch.bool),
        "quadrant": t([1, 4, 2, 4, 2, 1], torch.int8),
    }
    if before_erc:
        cols["grad_coef_before_erc"] = t(G_E)
    if dual:
        cols["dual_clipped"] = t(DUAL, torch.bool)
    return cols


def _record_hand(path, run, **kw):
    mask = torch.tensor([[True] * 5 + [False]])
    lp = torch.full((1, 6), -1.0)
    with Recorder(path, run=run, config={"method": "ce_gppo"}) as rec:
        rec.record_update(
            0,
            0,
            mask=mask,
            advantages=torch.tensor([ADV]),
            logprobs=lp,
            old_logprobs=lp,
            loss=_Loss(_hand_columns(**kw), torch.tensor(0.0)),
            entropy_sensitivity=torch.tensor([S]),
            seq_ids=torch.tensor([7]),
        )


def test_hand_built_split_through_recorder_parquet_duckdb(tmp_path):
    _record_hand(tmp_path, "hand")
    (row,) = _steps(tmp_path, list(WANT))
    for (name, want), got in zip(WANT.items(), row):
        assert got == pytest.approx(want, rel=1e-6, abs=1e-7), name
    parts = sum(row[list(WANT).index(f"entropy_effect_dropped_{c}")] for c in CAUSES)
    assert parts == pytest.approx(row[1], rel=1e-6)  # the identity
    con = connect(tmp_path)
    toks = con.execute("""SELECT pos, dual_clipped, erc_kept, entropy_effect_dropped FROM tokens
                          ORDER BY pos""").fetchall()
    assert [r[1] for r in toks] == DUAL[:5] and [r[2] for r in toks] == ERC_KEPT[:5]
    assert toks[0][3] is None and toks[2][3] == pytest.approx(-1.0)


def test_hand_built_split_without_dual_clip_and_without_pre_erc_grad(tmp_path):
    # no dual_clipped column: t3 (clip +1, not clipped) counts on the high side; _dual_clip is null
    _record_hand(tmp_path, "nodual", dual=False)
    # ERC without grad_coef_before_erc: the split is unknown, every part null (the totals stay)
    _record_hand(tmp_path, "nosplit", before_erc=False)
    con = connect(tmp_path)
    got = dict(
        con.execute("""SELECT run, [entropy_effect_dropped, entropy_effect_dropped_clip_low,
                              entropy_effect_dropped_clip_high, entropy_effect_dropped_dual_clip,
                              entropy_effect_dropped_erc] FROM steps""").fetchall()
    )
    d, lo, hi, dual, erc = got["nodual"]
    assert (d, lo, hi, erc) == pytest.approx((-1.4, -0.3, 0.1, -1.2), rel=1e-6) and dual is None
    assert got["nosplit"][0] == pytest.approx(-1.4, rel=1e-6) and got["nosplit"][1:] == [None] * 4


# ------------------------------------------------------------------ real losses
def _batch(seed, b=8, t=12, v=23):
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(b, t, v, generator=g) * 2
    tok = torch.randint(0, v, (b, t), generator=g)
    old = z + torch.randn(b, t, v, generator=g) * 1.5  # far from the current policy: ratios above c = 3 exist
    old_lp, old_h = stats.logprobs_and_entropy(old, tok)
    adv = torch.randn(b, generator=g)
    mask = torch.ones(b, t, dtype=torch.bool)
    mask[1, 9:] = False
    return z, tok, old_lp, old_h, adv, mask


def _hand_split(out, s, mask, temperature=1.0):
    """The four parts in float64 from the loss's own columns and s (the rule of aggregates.entropy_budget)."""
    c = {k: v for k, v in out.columns.items()}
    k = 1.0 / temperature**2
    changed = c["grad_changed"] & mask
    g_u, g, s = c["grad_coef_unclipped"].double(), c["grad_coef"].double(), s.double()
    g_e = c["grad_coef_before_erc"].double() if "grad_coef_before_erc" in c else g
    pre = torch.where(changed, (g_u - g_e) * s * k, 0.0)
    erc = torch.where(changed, (g_e - g) * s * k, 0.0)
    dual = ~c["clipped"] & (c["dual_clipped"] | (c["clip"] == 0)) if "dual_clipped" in c else torch.zeros_like(mask)
    return {
        "clip_low": pre[~dual & (c["clip"] < 0)].sum().item(),
        "clip_high": pre[~dual & (c["clip"] > 0)].sum().item(),
        "dual_clip": pre[dual].sum().item(),
        "erc": erc.sum().item(),
        "total": torch.where(changed, (g_u - g) * s * k, 0.0).sum().item(),
    }


@pytest.mark.parametrize(
    "kw",
    [
        dict(method="ce_gppo", beta1=0.5, beta2=1.0, erc=(0.95, 1.05), dual_clip=3.0),
        dict(method="grpo", erc=(0.9, 1.1), dual_clip=3.0, ratio_level="sequence"),
        dict(method="dapo", erc=(0.95, 1.05), delta=1.5),
        dict(method="cispo", erc=(0.95, 1.05)),
    ],
)
def test_real_losses_parts_add_up(tmp_path, kw):
    """policy_loss with clipping, ERC and dual-clip / delta through a Recorder: in every steps row the four
    parts add up to entropy_effect_dropped (1e-6 relative), each part as computed by hand from the loss's
    columns, and the fixture exercises every cause it has."""
    temperature = 0.9
    want = []
    with Recorder(tmp_path, run="r", config={"method": kw["method"]}) as rec:
        for u in range(3):
            z, tok, old_lp, old_h, adv, mask = _batch(u)
            x = z.clone().requires_grad_(True)
            lp, h, s = stats.logprobs_and_entropy(x, tok, temperature=temperature, sensitivity=True)
            out = policy_loss(lp, old_lp, adv, mask, entropy=h, old_entropy=old_h, **kw)
            rec.record_update(
                0,
                u,
                mask=mask,
                advantages=adv,
                logprobs=lp,
                old_logprobs=old_lp,
                entropy=h,
                old_entropy=old_h,
                tokens=tok,
                seq_ids=torch.arange(8) + 8 * u,
                loss=out,
                entropy_sensitivity=s,
                temperature=temperature,
            )
            want.append(_hand_split(out, s, mask, temperature))
    names = ["entropy_effect_dropped"] + [f"entropy_effect_dropped_{c}" for c in CAUSES]
    rows = _steps(tmp_path, names)
    assert len(rows) == 3
    has_dual = "dual_clip" in kw or "delta" in kw
    for row, w in zip(rows, want):
        total, *parts = row
        assert sum(p for p in parts if p is not None) == pytest.approx(total, rel=1e-6)
        assert total == pytest.approx(w["total"], rel=1e-5, abs=1e-9)
        for c, p in zip(CAUSES, parts):
            if c == "dual_clip" and not has_dual:
                assert p is None
            else:
                assert p == pytest.approx(w[c], rel=1e-5, abs=1e-9), c
    sums = {c: sum(abs(w[c]) for w in want) for c in CAUSES}
    assert sums["erc"] > 0 and sums["clip_low"] + sums["clip_high"] > 0
    if has_dual:
        assert sums["dual_clip"] > 0, "the fixture must dual-clip some tokens"


def test_policy_update_parts_add_up_and_step_totals(tmp_path):
    """The same through integrations.torch.policy_update (it computes s itself), summed over a step's
    updates by the entropy_budget_by_step analysis."""
    from entropylens.integrations.torch import policy_update
    from entropylens.read.query import run_analysis

    with Recorder(tmp_path, run="pu", config={"method": "ce_gppo"}) as rec:
        for step in range(2):
            for u in range(2):
                z, tok, old_lp, old_h, adv, mask = _batch(10 * step + u)
                logits = z.clone().requires_grad_(True)
                out = policy_update(
                    rec,
                    step,
                    u,
                    logits,
                    tok,
                    mask,
                    adv,
                    old_lp,
                    old_entropy=old_h,
                    seq_ids=torch.arange(8) + 8 * (2 * step + u),
                    method="ce_gppo",
                    beta1=0.5,
                    erc=(0.95, 1.05),
                    dual_clip=3.0,
                )
                out.loss.backward()
    df = run_analysis(connect(tmp_path), "entropy_budget_by_step").drop_duplicates("step")
    assert len(df) == 2
    for r in df.itertuples():
        parts = r.dropped_clip_low + r.dropped_clip_high + r.dropped_dual_clip + r.dropped_erc
        assert parts == pytest.approx(r.step_dropped, rel=1e-6)
        assert all(abs(v) > 0 for v in (r.dropped_clip_low, r.dropped_clip_high, r.dropped_erc))


# ------------------------------------------------------------------ older runs
def test_erc_part_of_older_runs_reads_null(tmp_path):
    """A run of schema version 2 stored entropy_effect_dropped_erc with another meaning (the whole dropped
    effect of the ERC-dropped tokens): the views null it there, and keep it in today's runs; runs that
    lack the newer columns altogether read them as null, also when every run lacks them."""
    old = tmp_path / "old"
    (old / "steps" / "step=0" / "rank=0").mkdir(parents=True)
    (old / "run.json").write_text(json.dumps({"run": "old", "method": "dapo", "schema_version": 2}))
    pq.write_table(
        pa.table(
            {
                "update": pa.array([0], pa.int16()),
                "n_tokens": pa.array([4], pa.int64()),
                "entropy_effect_dropped": pa.array([-1.0], pa.float32()),
                "entropy_effect_dropped_erc": pa.array([-0.9], pa.float32()),
            }
        ),
        old / "steps" / "step=0" / "rank=0" / "steps.parquet",
    )
    con = connect(old)  # every run lacks the version-3 columns
    assert con.execute("""SELECT entropy_effect_dropped, entropy_effect_dropped_erc, entropy_effect_dropped_clip_low,
                          dual_clip_frac, is_weight_mean FROM steps""").fetchall() == [(-1.0, None, None, None, None)]
    _record_hand(tmp_path, "new")
    got = dict(connect(tmp_path).execute("SELECT run, entropy_effect_dropped_erc FROM steps").fetchall())
    assert got["old"] is None and got["new"] == pytest.approx(-1.2, rel=1e-6)
    assert not math.isnan(np.float32(got["new"]))


@pytest.mark.slow
def test_spark_reads_older_runs_as_duckdb(tmp_path):
    """Spark's views null the changed column in older runs and fill absent columns, as DuckDB's."""
    pytest.importorskip("pyspark")
    from entropylens.read.spark import connect as spark_connect
    from entropylens.read.spark import session

    old = tmp_path / "old"
    (old / "steps" / "step=0" / "rank=0").mkdir(parents=True)
    (old / "run.json").write_text(json.dumps({"run": "old", "method": "dapo", "schema_version": 2}))
    pq.write_table(
        pa.table(
            {
                "update": pa.array([0], pa.int16()),
                "n_tokens": pa.array([4], pa.int64()),
                "entropy_effect_dropped_erc": pa.array([-0.9], pa.float32()),
            }
        ),
        old / "steps" / "step=0" / "rank=0" / "steps.parquet",
    )
    _record_hand(tmp_path, "new")
    sql = "SELECT run, entropy_effect_dropped_erc, dual_clip_frac FROM steps ORDER BY run"
    s = session("local[1]", conf={"spark.sql.shuffle.partitions": "1"})
    try:
        got = [tuple(r) for r in spark_connect(tmp_path, spark=s).execute(sql).fetchall()]
    finally:
        s.stop()
    want = connect(tmp_path).execute(sql).fetchall()
    assert [r[0] for r in got] == ["new", "old"] and got[1][1:] == (None, None) == want[1][1:]
    assert got[0][1] == pytest.approx(want[0][1]) == pytest.approx(-1.2, rel=1e-6)
    assert got[0][2] == pytest.approx(want[0][2]) == pytest.approx(0.2, rel=1e-6)


def test_a_run_resumed_by_a_newer_version_keeps_its_older_schema_version(tmp_path):
    """run.json's schema_version is the oldest any of the run's files was written with: a version-2 run
    continued by this version keeps 2, so its earlier steps' entropy_effect_dropped_erc is not read
    with the new meaning (the resumed steps' is nulled too: the run says 2)."""
    _record_hand(tmp_path, "r")
    info_path = tmp_path / "r" / "run.json"
    info = json.loads(info_path.read_text())
    info_path.write_text(json.dumps({**info, "schema_version": 2}))  # as a version-2 job would have left it
    mask = torch.tensor([[True] * 5 + [False]])
    lp = torch.full((1, 6), -1.0)
    with Recorder(tmp_path, run="r", resume=0) as rec:
        rec.record_update(
            1,
            0,
            mask=mask,
            advantages=torch.tensor([ADV]),
            logprobs=lp,
            old_logprobs=lp,
            loss=_Loss(_hand_columns(), torch.tensor(0.0)),
            entropy_sensitivity=torch.tensor([S]),
            seq_ids=torch.tensor([8]),
        )
    assert json.loads(info_path.read_text())["schema_version"] == 2
    rows = (
        connect(tmp_path)
        .execute("""SELECT step, entropy_effect_dropped, entropy_effect_dropped_erc FROM steps
                                        ORDER BY step""")
        .fetchall()
    )
    assert [(s, e) for s, _, e in rows] == [(0, None), (1, None)] and rows[1][1] == pytest.approx(-1.4, rel=1e-6)
