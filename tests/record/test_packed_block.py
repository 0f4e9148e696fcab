"""pack / unpack: one block per update, every part where its Layout says, rows selected on the host."""

import numpy as np
import pytest
import torch

from entropylens.record.device import blocks, packed_block, token_columns
from entropylens.rl import aggregates
from entropylens.schema import CLIP_HIGH, CLIP_LOW, CLIP_NONE


def test_pack_unpack_round_trip_with_flags_and_selection():
    # B = 2 sequences, T = 3 positions. Selected: seq 0 positions 0, 1 and seq 1 position 2.
    selected = torch.tensor([[True, True, False], [False, False, True]])
    cols = {
        "logprob": torch.tensor([[-1.0, -2.0, -3.0], [-4.0, -5.0, -6.0]]),
        "old_logprob": torch.tensor([[-1.5, -2.5, -3.5], [-4.5, -5.5, -6.5]]),
        "advantage": torch.tensor([[1.0, 1.0, 1.0], [-2.0, -2.0, -2.0]]),
        "grad_coef": torch.tensor([[0.1, 0.2, 0.3], [0.4, 0.5, 0.6]]),
        "quadrant": torch.tensor([[1, 2, 0], [3, 4, 4]], dtype=torch.int8),
        "clip": torch.tensor([[CLIP_LOW, CLIP_NONE, CLIP_HIGH], [CLIP_HIGH, CLIP_LOW, CLIP_LOW]], dtype=torch.int8),
        "clipped": torch.tensor([[False, False, True], [False, True, True]]),
        "erc_kept": torch.tensor([[True, False, True], [False, True, False]]),
    }
    aggs = torch.arange(len(aggregates.AGG_NAMES), dtype=torch.float64) / 8  # 0, 0.125, ... exact in float64
    finite = {"logprobs": torch.tensor(True), "entropy": torch.tensor(False)}
    packed, layout = packed_block.pack(
        cols,
        selected,
        aggs,
        finite,
        seq=torch.tensor([10, 11]),
        group=torch.tensor([5, 6]),
        tokens=torch.tensor([[7, 8, 9], [1, 2, 3]]),
    )
    assert packed.dtype == torch.int32 and packed.shape == (layout.size,)
    # sizes in int32 words: aggregates 2 each, 2 finite flags x 2, 4 float columns x 6, 6 token ids,
    # 6 flags, 2 seq ids, 2 group ids
    assert layout.size == 2 * len(aggregates.AGG_NAMES) + 4 + 24 + 6 + 6 + 2 + 2
    host = packed_block.unpack(packed.numpy(), layout)
    assert host.finite == {"logprobs": True, "entropy": False}
    assert packed_block.read_finite(packed.numpy(), layout) == host.finite
    assert list(host.aggregates.values()) == aggs.tolist()
    rows = host.rows()
    # row order: (seq 0, pos 0), (seq 0, pos 1), (seq 1, pos 2)
    np.testing.assert_array_equal(rows["seq"], [10, 10, 11])
    np.testing.assert_array_equal(rows["group"], [5, 5, 6])
    np.testing.assert_array_equal(rows["pos"], [0, 1, 2])
    np.testing.assert_array_equal(rows["token_id"], [7, 8, 3])
    np.testing.assert_array_equal(rows["logprob"], [-1.0, -2.0, -6.0])
    np.testing.assert_array_equal(rows["grad_coef"], np.float32([0.1, 0.2, 0.6]))
    np.testing.assert_array_equal(rows["quadrant"], [1, 2, 4])
    np.testing.assert_array_equal(rows["clip"], [CLIP_LOW, CLIP_NONE, CLIP_LOW])
    np.testing.assert_array_equal(rows["clipped"], [False, False, True])
    np.testing.assert_array_equal(rows["erc_kept"], [True, False, False])
    assert "entropy" not in rows  # absent columns stay absent (written as nulls)


def test_pack_without_tokens_or_erc():
    selected = torch.tensor([[True, False]])
    cols = {
        "logprob": torch.zeros(1, 2),
        "quadrant": torch.zeros(1, 2, dtype=torch.int8),
        "clip": torch.zeros(1, 2, dtype=torch.int8),
        "clipped": torch.zeros(1, 2, dtype=torch.bool),
    }
    packed, layout = packed_block.pack(
        cols,
        selected,
        torch.zeros(len(aggregates.AGG_NAMES)),
        {},
        seq=torch.tensor([3]),
        group=torch.tensor([-1]),
        tokens=None,
    )
    rows = packed_block.unpack(packed.numpy(), layout).rows()
    assert rows["token_id"].tolist() == [-1] and rows["seq"].tolist() == [3] and "erc_kept" not in rows


def test_step_aggregates_count_non_finite_values_instead_of_zeroing_them():
    # 4 tokens, A = +1, p = exp(old) = 0.6 >= tau: all PA&HP. log r = [0, ln 2, 100, 0] in float32:
    # r = [1, 2, inf, 1]; k3 = (r - 1) - log r = [0, 1 - ln 2 = 0.306853, inf, 0].
    # Finite tokens 0, 1, 3: ratio_mean = (1 + 2 + 1) / 3 = 4/3; kl_k3 = 0.306853 / 3 = 0.102284.
    # (zeroing the inf, as nan_to_num did, gave ratio_mean (1 + 2 + 0 + 1) / 4 = 1.0 and hid the overflow)
    # logit-gradient norms [1, inf, nan, 3]: two non-finite; lgn_mean_pa_hp = (1 + 3) / 2 = 2.
    old = torch.log(torch.full((1, 4), 0.6))
    logp = old + torch.tensor([[0.0, np.log(2.0), 100.0, 0.0]])
    mask = torch.ones(1, 4, dtype=torch.bool)
    cols = token_columns.derive_columns(
        mask=mask,
        advantages=torch.ones(1),
        logprobs=logp,
        old_logprobs=old,
        entropy=None,
        old_entropy=None,
        loss_columns=None,
        eps_low=0.2,
        eps_high=0.2,
        tau=0.5,
    )
    lgn = torch.tensor([[1.0, float("inf"), float("nan"), 3.0]])
    agg = aggregates.step_metrics(cols, mask, lgn=lgn)
    assert agg["n_tokens"].item() == 4 and agg["n_pa_hp"].item() == 4
    assert agg["n_nonfinite_ratio"].item() == 1
    assert agg["ratio_mean"].item() == pytest.approx(4 / 3, rel=1e-6)
    assert agg["kl_k3"].item() == pytest.approx((1 - np.log(2.0)) / 3, rel=1e-5)
    assert agg["n_nonfinite_lgn"].item() == 2
    assert agg["lgn_mean_pa_hp"].item() == pytest.approx(2.0)
    # without non-finite values the counts are 0
    agg2 = aggregates.step_metrics(cols, mask & torch.tensor([[True, True, False, True]]), lgn=torch.ones(1, 4))
    assert agg2["n_nonfinite_ratio"].item() == 0 and agg2["n_nonfinite_lgn"].item() == 0
    assert agg2["ratio_mean"].item() == pytest.approx(4 / 3, rel=1e-6)


@pytest.mark.parametrize("sample", [1.0, 0.5])
def test_snapshot_block_equals_update_block_and_ignores_later_changes(sample):
    # The CPU path: the training thread takes a snapshot (three stacked copies) and the writer thread
    # builds the block from it later. That block must equal, word for word, update_block on the
    # original tensors (the CUDA path), with ERC, the attribution, tokens, a loss value and a sample,
    # even after the caller overwrote its tensors in place.
    from entropylens.rl.losses import policy_loss
    from entropylens.rl.stats import logprobs_and_entropy

    g = torch.Generator().manual_seed(3)
    b, t, v = 6, 5, 11
    logits = torch.randn(b, t, v, generator=g, dtype=torch.float64).float().requires_grad_(True)
    tokens = torch.randint(0, v, (b, t), generator=g)
    mask = torch.rand(b, t, generator=g) < 0.8
    adv = torch.randn(b, generator=g)
    lp, h, sens = logprobs_and_entropy(logits, tokens, sensitivity=True)
    old = lp.detach() + 0.3 * torch.randn(b, t, generator=g)
    old_h = h.detach() * (0.9 + 0.2 * torch.rand(b, t, generator=g))
    out = policy_loss(lp, old, adv, mask, method="ce_gppo", entropy=h, old_entropy=old_h, erc=(0.95, 1.05))
    cols = token_columns.derive_columns(
        mask=mask,
        advantages=adv,
        logprobs=lp,
        old_logprobs=old,
        entropy=h,
        old_entropy=old_h,
        loss_columns=out.columns,
        eps_low=0.2,
        eps_high=0.2,
        tau=0.5,
    )
    cols["logit_grad_norm"] = torch.rand(b, t, generator=g)
    finite = packed_block.FiniteFlags(("logprobs", "entropy"), torch.tensor([True, False]))
    seq, group = torch.arange(b) * 7, torch.arange(b) // 2
    expected, layout = blocks.update_block(
        dict(cols), mask, out.loss, finite, seq, group, tokens, 12345, sample, sens, 0.7
    )
    snap = blocks.snapshot(cols, mask, out.loss, finite, seq, group, tokens, sens, 0.7)
    for x in (*cols.values(), mask, seq, group, tokens, sens):
        x.detach().zero_()  # the caller reuses its buffers
    got, got_layout = snap.block(12345, sample)
    assert got_layout == layout
    assert torch.equal(got, expected)
    host = packed_block.unpack(expected.numpy(), layout)
    assert "entropy_effect" in host.columns and "entropy_effect_dropped" in host.columns
    assert host.selected.sum() < host.masked.sum() if sample < 1 else (host.selected == host.masked).all()


def _update_inputs(seed: int, b: int = 6, t: int = 5, v: int = 11, erc: bool = True):
    """One update's recorder inputs (ce_gppo with ERC, entropies, attribution, tokens, lgn)."""
    from entropylens.rl.losses import policy_loss
    from entropylens.rl.stats import logprobs_and_entropy

    g = torch.Generator().manual_seed(seed)
    logits = (2 * torch.randn(b, t, v, generator=g)).requires_grad_(True)
    tokens = torch.randint(0, v, (b, t), generator=g)
    mask = torch.rand(b, t, generator=g) < 0.8
    adv = torch.randn(b, generator=g)
    adv[0] = 0.0  # a zero-advantage sequence (quadrant ZA)
    lp, h, sens = logprobs_and_entropy(logits, tokens, sensitivity=True)
    old = lp.detach() + 0.3 * torch.randn(b, t, generator=g)
    if seed == 2:
        old[1, 1] = -200.0  # ratio exp(~200) = inf: counted in n_nonfinite_ratio, left out of the means
    old_h = h.detach() * (0.9 + 0.2 * torch.rand(b, t, generator=g))
    out = policy_loss(
        lp, old, adv, mask, method="ce_gppo", entropy=h, old_entropy=old_h, erc=(0.95, 1.05) if erc else None
    )
    cols = token_columns.derive_columns(
        mask=mask,
        advantages=adv,
        logprobs=lp,
        old_logprobs=old,
        entropy=h,
        old_entropy=old_h,
        loss_columns=out.columns,
        eps_low=0.2,
        eps_high=0.2,
        tau=0.5,
    )
    cols = {k: x.detach() for k, x in cols.items()}
    cols["logit_grad_norm"] = torch.rand(b, t, generator=g)
    finite = packed_block.FiniteFlags(("logprobs", "entropy"), torch.tensor([True, True]))
    seq, group = torch.arange(b) * 7 + 100 * seed, torch.arange(b) // 2
    return cols, mask, out.loss.detach(), finite, seq, group, tokens, sens.detach()


@pytest.mark.parametrize("sample", [1.0, 0.5])
def test_stacked_snapshots_give_each_update_its_own_block(sample):
    # The writer thread builds a hand-over's same-shaped updates with one set of ops
    # (stack_snapshots). Row u of that block must equal, word for word, update u's block built
    # alone (update_block on its own tensors, the CUDA path): aggregates, quantiles, the entropy
    # budget, the sample and the packed columns, including an update with an infinite ratio.
    inputs = [_update_inputs(seed) for seed in range(4)]
    alone = [blocks.update_block(dict(a[0]), *a[1:7], 777, sample, a[7], 0.7) for a in inputs]
    snaps = [blocks.snapshot(*a[:7], a[7], 0.7) for a in inputs]
    assert len({s.signature() for s in snaps}) == 1
    stacked, layout = blocks.stack_snapshots(snaps).block(777, sample)
    assert stacked.shape == (4, layout.size)
    for u, (expected, expected_layout) in enumerate(alone):
        assert expected_layout == layout
        assert torch.equal(stacked[u], expected), f"update {u}"
    agg = packed_block.unpack(stacked[2].numpy(), layout).aggregates
    assert agg["n_nonfinite_ratio"] == 1.0 and np.isfinite(agg["ratio_mean"])
    # the updates differ: a batched op that mixed them would show here
    assert len({packed_block.unpack(stacked[u].numpy(), layout).aggregates["entropy_mean"] for u in range(4)}) == 4


def test_build_blocks_groups_same_shaped_updates_and_leaves_each_block_as_alone():
    # A hand-over with two shapes (B = 6 and B = 4), ERC and no-ERC updates, and a lone update:
    # build_blocks builds each group at once; every DeferredBlock then returns exactly the block
    # it builds alone.
    from entropylens.record.device.host_copy import DeferredBlock, build_blocks

    specs = [dict(seed=0), dict(seed=1), dict(seed=2, b=4), dict(seed=3, b=4), dict(seed=4, erc=False), dict(seed=5)]
    snaps = [blocks.snapshot(*a[:7], a[7], 1.0) for a in (_update_inputs(**s) for s in specs)]
    together = [DeferredBlock(s, 9, 1.0) for s in snaps]
    build_blocks([*together, "not a block"])
    assert all(c._block is not None for i, c in enumerate(together) if i != 4)  # the lone no-ERC one waits
    assert together[4]._block is None
    for snap, copy in zip(snaps, together):
        alone = DeferredBlock(snap, 9, 1.0)
        np.testing.assert_array_equal(copy.wait(), alone.wait())
        assert copy.layout == alone.layout


def test_batched_aggregates_and_quantiles_match_each_update():
    # step_aggregates / masked_quantiles / entropy_budget on [U, B, T] give row u = the [B, T] result
    # of update u, bit for bit; an update with no masked-in token gives NaN quantiles and 0 counts.
    inputs = [_update_inputs(seed) for seed in range(3)]
    inputs[1][1].zero_()  # update 1: every token masked out
    cols = [dict(a[0]) for a in inputs]
    for c, a in zip(cols, inputs):
        blocks.add_attribution(c, a[7], 0.7)
    stacked = {k: torch.stack([c[k] for c in cols]) for k in cols[0]}
    masks = torch.stack([a[1] for a in inputs])
    losses = torch.stack([a[2] for a in inputs])
    batched = aggregates.step_aggregates(stacked, masks, stacked["logit_grad_norm"], losses)
    for u, (c, a) in enumerate(zip(cols, inputs)):
        alone = aggregates.step_aggregates(c, a[1], c["logit_grad_norm"], a[2])
        assert torch.equal(batched[u].nan_to_num(123.0), alone.nan_to_num(123.0))
    q = aggregates.masked_quantiles(stacked["entropy_ratio"], masks, (0.05, 0.5, 0.95))
    assert q.shape == (3, 3) and torch.isnan(q[1]).all() and not torch.isnan(q[0]).any()
    ref = torch.quantile(cols[0]["entropy_ratio"][inputs[0][1]], torch.tensor([0.05, 0.5, 0.95]))
    torch.testing.assert_close(q[0], ref)
    agg = dict(zip(aggregates.AGG_NAMES, batched[1].tolist()))
    assert agg["n_tokens"] == 0.0 and agg["entropy_effect"] == 0.0


def test_snapshot_computes_missing_finite_flags_from_its_copies():
    # The CPU recorder leaves the input check to the snapshot (FiniteFlags(names, None)): each flag
    # is "every masked-in value of that input's column finite". Masked-out non-finite values pass.
    cols, mask, loss, _, seq, group, tokens, sens = _update_inputs(0)
    cols["entropy"] = cols["entropy"].clone()
    cols["old_logprob"] = cols["old_logprob"].clone()
    cols["advantage"] = cols["advantage"].clone()
    i, j = mask.nonzero()[0].tolist()  # a masked-in position
    oi, oj = (~mask).nonzero()[0].tolist()  # a masked-out one
    cols["entropy"][i, j] = float("inf")
    cols["old_logprob"][oi, oj] = float("nan")
    cols["advantage"][i, j] = float("nan")
    names = ("logprobs", "old_logprobs", "advantages", "entropy", "old_entropy")
    snap = blocks.snapshot(cols, mask, loss, packed_block.FiniteFlags(names, None), seq, group, tokens, sens)
    assert dict(zip(names, snap.finite.flags.tolist())) == {
        "logprobs": True,
        "old_logprobs": True,
        "advantages": False,
        "entropy": False,
        "old_entropy": True,
    }
