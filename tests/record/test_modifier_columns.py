"""The loss modifiers' columns: tokens.dual_clipped / token_kept / seq_kept / is_weight and the steps'
dual_clip_frac / token_masked_frac / seq_masked_frac / is_weight_mean, through the packed single-copy
path (flags word, float columns), a real Recorder, Parquet and DuckDB; null where the loss had none."""

import numpy as np
import pytest
import torch

from entropylens import Recorder
from entropylens.read.query import connect
from entropylens.record.device import blocks, packed_block
from entropylens.rl.losses import policy_loss

FRACTIONS = ("dual_clip_frac", "token_masked_frac", "seq_masked_frac", "is_weight_mean")
TOKEN_COLS = ("dual_clipped", "token_kept", "seq_kept", "is_weight")


class _Loss:
    def __init__(self, columns, loss=None, config=None):
        self.columns, self.loss, self.config = columns, loss, config or {}


# Hand-built: 2 sequences x 3 positions, position (1, 2) masked out, so 5 tokens:
#   token_kept   T F T | T T (F, masked out)  -> outside the mask: 1 of 5 = 0.2
#   seq_kept     seq 0 kept, seq 1 dropped     -> 2 of 5 = 0.4
#   is_weight    0.5 1.0 1.5 | 2.0 3.0 (99)    -> mean 8.0 / 5 = 1.6
#   dual_clipped F F T | F T (T)               -> 2 of 5 = 0.4
def _hand():
    mask = torch.tensor([[True, True, True], [True, True, False]])
    cols = {
        "token_kept": torch.tensor([[True, False, True], [True, True, False]]),
        "seq_kept": torch.tensor([[True] * 3, [False] * 3]),
        "is_weight": torch.tensor([[0.5, 1.0, 1.5], [2.0, 3.0, 99.0]]),
        "dual_clipped": torch.tensor([[False, False, True], [False, True, True]]),
        "grad_coef": torch.full((2, 3), -0.1),
    }
    return mask, cols


def test_hand_built_columns_and_fractions(tmp_path):
    mask, cols = _hand()
    lp = torch.full((2, 3), -1.0)
    with Recorder(tmp_path, run="h") as rec:
        rec.record_update(
            0,
            0,
            mask=mask,
            advantages=torch.tensor([1.0, -1.0]),
            logprobs=lp,
            old_logprobs=lp,
            loss=_Loss(cols, torch.tensor(0.5)),
            seq_ids=torch.tensor([3, 4]),
        )
    con = connect(tmp_path)
    row = con.execute(f"SELECT {', '.join(FRACTIONS)} FROM steps").fetchone()
    assert row == pytest.approx((0.4, 0.2, 0.4, 1.6), rel=1e-6)
    toks = con.execute(f"SELECT seq, pos, {', '.join(TOKEN_COLS)} FROM tokens ORDER BY seq, pos").fetchall()
    assert toks == [
        (3, 0, False, True, True, 0.5),
        (3, 1, False, False, True, 1.0),
        (3, 2, True, True, True, 1.5),
        (4, 0, False, True, False, 2.0),
        (4, 1, True, True, False, 3.0),
    ]
    types = dict(con.execute("SELECT column_name, column_type FROM (DESCRIBE tokens)").fetchall())
    assert [types[c] for c in TOKEN_COLS] == ["BOOLEAN", "BOOLEAN", "BOOLEAN", "FLOAT"]


def test_without_modifiers_null(tmp_path):
    mask, cols = _hand()
    lp = torch.full((2, 3), -1.0)
    with Recorder(tmp_path, run="n") as rec:
        rec.record_update(
            0,
            0,
            mask=mask,
            advantages=torch.tensor([1.0, -1.0]),
            logprobs=lp,
            old_logprobs=lp,
            loss=_Loss({"grad_coef": cols["grad_coef"]}),
        )
    con = connect(tmp_path)
    assert con.execute(f"SELECT {', '.join(FRACTIONS)} FROM steps").fetchone() == (None,) * 4
    assert con.execute(f"SELECT count({'), count('.join(TOKEN_COLS)}), count(*) FROM tokens").fetchone() == (0,) * 4 + (
        5,
    )
    # and policy_loss's own metrics leave them out
    out = policy_loss(lp, lp, torch.tensor([1.0, -1.0]), mask)
    assert not set(FRACTIONS) & set(out.metrics)


def test_device_path_block_and_stacked_updates_equal():
    """update_block (the path a CUDA update takes: aggregates and pack in one go, then one host copy)
    decodes the same columns and fractions; a stack of updates gives each update's own block."""
    mask, cols = _hand()
    base = dict(
        advantage=torch.tensor([[1.0] * 3, [-1.0] * 3]),
        logprob=torch.full((2, 3), -1.0),
        old_logprob=torch.full((2, 3), -1.2),
        quadrant=torch.tensor([[1, 2, 1], [3, 4, 4]], dtype=torch.int8),
        clip=torch.zeros(2, 3, dtype=torch.int8),
        clipped=torch.zeros(2, 3, dtype=torch.bool),
    )
    base["ratio"] = torch.exp(base["logprob"] - base["old_logprob"])
    full = {**base, **cols}
    finite = packed_block.FiniteFlags((), None)
    seq, group = torch.tensor([3, 4]), torch.tensor([0, 0])
    block, layout = blocks.update_block(dict(full), mask, torch.tensor(0.0), finite, seq, group, None, 0, 1.0)
    host = packed_block.unpack(block.numpy(), layout)
    assert layout.bool_names == ("dual_clipped", "token_kept", "seq_kept")
    assert [host.aggregates[n] for n in FRACTIONS] == pytest.approx([0.4, 0.2, 0.4, 1.6], rel=1e-12)
    r = host.rows()
    for c in TOKEN_COLS:
        want = full[c].reshape(-1)[mask.reshape(-1)].numpy()
        assert np.array_equal(r[c], want), c
    # two same-shaped updates stacked: row u == update u's own block, word for word
    other = {**full, "is_weight": full["is_weight"] * 2, "token_kept": ~full["token_kept"]}
    stacked = {k: torch.stack([full[k], other[k]]) for k in full}
    stacked_blocks, layout2 = blocks.update_block(
        stacked,
        torch.stack([mask, mask]),
        torch.tensor([0.0, 0.0]),
        packed_block.FiniteFlags((), None),
        torch.stack([seq, seq + 2]),
        torch.stack([group, group]),
        None,
        0,
        1.0,
    )
    alone, _ = blocks.update_block(dict(other), mask, torch.tensor(0.0), finite, seq + 2, group, None, 0, 1.0)
    assert torch.equal(stacked_blocks[0], block) and torch.equal(stacked_blocks[1], alone) and layout2 == layout
    rows = packed_block.rows_of([packed_block.unpack(b.numpy(), layout) for b in stacked_blocks], [0, 1])
    assert rows["token_kept"].tolist() == r["token_kept"].tolist() + (~r["token_kept"]).tolist()
    assert rows["is_weight"].tolist() == pytest.approx(r["is_weight"].tolist() + (2 * r["is_weight"]).tolist())


def test_real_policy_loss_modifiers_exact_under_sampling(tmp_path):
    """policy_loss with TRL's token mask, off-policy sequence mask, vLLM IS weight and delta through a
    Recorder at sample=0.5: the token rows carry the loss's own columns; the steps fractions are exact
    over all tokens (hand-computed from the inputs), not over the kept rows."""
    g = torch.Generator().manual_seed(3)
    b, t = 16, 9
    lp = -torch.rand(b, t, generator=g) * 3
    old = lp + torch.randn(b, t, generator=g) * 0.5
    adv = torch.randn(b, generator=g)
    mask = torch.rand(b, t, generator=g) > 0.2
    token_mask = torch.rand(b, t, generator=g) > 0.3
    seq_mask = torch.rand(b, generator=g) > 0.25
    is_w = torch.rand(b, t, generator=g) * 2
    with Recorder(tmp_path, run="m", sample=0.5, config={"method": "dapo"}) as rec:
        out = policy_loss(
            lp, old, adv, mask, method="dapo", token_mask=token_mask, seq_mask=seq_mask, is_weight=is_w, delta=1.4
        )
        rec.record_update(
            0, 0, mask=mask, advantages=adv, logprobs=lp, old_logprobs=old, loss=out, seq_ids=torch.arange(b)
        )
    n = mask.sum().item()
    dual = out.columns["dual_clipped"] & mask
    want = (
        dual.sum().item() / n,
        (~token_mask & mask).sum().item() / n,
        (~seq_mask.unsqueeze(1) & mask).sum().item() / n,
        is_w[mask].double().mean().item(),
    )
    assert dual.any() and (~token_mask & mask).any() and (~seq_mask).any()
    con = connect(tmp_path)
    assert con.execute(f"SELECT {', '.join(FRACTIONS)} FROM steps").fetchone() == pytest.approx(want, rel=1e-6)
    assert {k: v.item() for k, v in out.metrics.items() if k in FRACTIONS} == pytest.approx(dict(zip(FRACTIONS, want)))
    rows = con.execute(f"SELECT seq, pos, {', '.join(TOKEN_COLS)} FROM tokens").fetchall()
    assert 0 < len(rows) < n  # sampled
    for seq, pos, d, tk, sk, w in rows:
        assert (d, tk, sk) == (bool(dual[seq, pos]), bool(token_mask[seq, pos]), bool(seq_mask[seq]))
        assert w == pytest.approx(is_w[seq, pos].item(), rel=1e-7)
