"""pack / unpack: one block per update, every part where its Layout says, rows selected on the host."""

import numpy as np
import pytest
import torch

from entropylens import tokenbatch
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
    aggs = torch.arange(len(tokenbatch.AGG_NAMES), dtype=torch.float64) / 8  # 0, 0.125, ... exact in float64
    finite = {"logprobs": torch.tensor(True), "entropy": torch.tensor(False)}
    packed, layout = tokenbatch.pack(cols, selected, aggs, finite, seq=torch.tensor([10, 11]),
                                     group=torch.tensor([5, 6]), tokens=torch.tensor([[7, 8, 9], [1, 2, 3]]))
    assert packed.dtype == torch.int32 and packed.shape == (layout.size,)
    # sizes in int32 words: aggregates 2 each, 2 finite flags x 2, 4 float columns x 6, 6 token ids,
    # 6 flags, 2 seq ids, 2 group ids
    assert layout.size == 2 * len(tokenbatch.AGG_NAMES) + 4 + 24 + 6 + 6 + 2 + 2
    host = tokenbatch.unpack(packed.numpy(), layout)
    assert host.finite == {"logprobs": True, "entropy": False}
    assert tokenbatch.read_finite(packed.numpy(), layout) == host.finite
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
    cols = {"logprob": torch.zeros(1, 2), "quadrant": torch.zeros(1, 2, dtype=torch.int8),
            "clip": torch.zeros(1, 2, dtype=torch.int8), "clipped": torch.zeros(1, 2, dtype=torch.bool)}
    packed, layout = tokenbatch.pack(cols, selected, torch.zeros(len(tokenbatch.AGG_NAMES)), {},
                                     seq=torch.tensor([3]), group=torch.tensor([-1]), tokens=None)
    rows = tokenbatch.unpack(packed.numpy(), layout).rows()
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
    cols = tokenbatch.derive_columns(mask=mask, advantages=torch.ones(1), logprobs=logp, old_logprobs=old,
                                     entropy=None, old_entropy=None, loss_columns=None, eps_low=0.2,
                                     eps_high=0.2, tau=0.5)
    lgn = torch.tensor([[1.0, float("inf"), float("nan"), 3.0]])
    agg = tokenbatch.step_metrics(cols, mask, lgn=lgn)
    assert agg["n_tokens"].item() == 4 and agg["n_pa_hp"].item() == 4
    assert agg["n_nonfinite_ratio"].item() == 1
    assert agg["ratio_mean"].item() == pytest.approx(4 / 3, rel=1e-6)
    assert agg["kl_k3"].item() == pytest.approx((1 - np.log(2.0)) / 3, rel=1e-5)
    assert agg["n_nonfinite_lgn"].item() == 2
    assert agg["lgn_mean_pa_hp"].item() == pytest.approx(2.0)
    # without non-finite values the counts are 0
    agg2 = tokenbatch.step_metrics(cols, mask & torch.tensor([[True, True, False, True]]), lgn=torch.ones(1, 4))
    assert agg2["n_nonfinite_ratio"].item() == 0 and agg2["n_nonfinite_lgn"].item() == 0
    assert agg2["ratio_mean"].item() == pytest.approx(4 / 3, rel=1e-6)


@pytest.mark.parametrize("sample", [1.0, 0.5])
def test_snapshot_block_equals_update_block_and_ignores_later_changes(sample):
    # The CPU path: the training thread takes a snapshot (three stacked copies) and the writer thread
    # builds the block from it later. That block must equal, word for word, update_block on the
    # original tensors (the CUDA path), with ERC, the attribution, tokens, a loss value and a sample,
    # even after the caller overwrote its tensors in place.
    from entropylens.losses import policy_loss
    from entropylens.stats import logprobs_and_entropy

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
    cols = tokenbatch.derive_columns(mask=mask, advantages=adv, logprobs=lp, old_logprobs=old, entropy=h,
                                     old_entropy=old_h, loss_columns=out.columns, eps_low=0.2, eps_high=0.2, tau=0.5)
    cols["logit_grad_norm"] = torch.rand(b, t, generator=g)
    finite = tokenbatch.FiniteFlags(("logprobs", "entropy"), torch.tensor([True, False]))
    seq, group = torch.arange(b) * 7, torch.arange(b) // 2
    expected, layout = tokenbatch.update_block(dict(cols), mask, out.loss, finite, seq, group, tokens, 12345, sample,
                                               sens, 0.7)
    snap = tokenbatch.snapshot(cols, mask, out.loss, finite, seq, group, tokens, sens, 0.7)
    for x in (*cols.values(), mask, seq, group, tokens, sens):
        x.detach().zero_()  # the caller reuses its buffers
    got, got_layout = snap.block(12345, sample)
    assert got_layout == layout
    assert torch.equal(got, expected)
    host = tokenbatch.unpack(expected.numpy(), layout)
    assert "entropy_effect" in host.columns and "entropy_effect_dropped" in host.columns
    assert host.selected.sum() < host.masked.sum() if sample < 1 else (host.selected == host.masked).all()
