"""The writer thread's block building (blocks.py on CPU tensors): its cheaper ops give the values of the
plain definitions."""

from __future__ import annotations

import numpy as np
import torch

from entropylens.rl import aggregates


def test_masked_quantiles_on_cpu_are_torch_quantile_of_the_masked_values():
    g = torch.Generator().manual_seed(0)
    x = torch.rand(3, 4, 37, generator=g) * 3  # [U, B, T]
    x[0, 0, :5] = torch.tensor([0.5, 0.5, 2.0, 2.0, 0.5])  # ties
    mask = torch.rand(3, 4, 37, generator=g) < 0.6
    mask[2] = False
    mask[2, 1, 3] = True  # one token: every quantile is that token
    qs = (0.0, 0.05, 0.5, 0.95, 1.0)
    got = aggregates.masked_quantiles(x, mask, qs)  # [U, 5]
    for u in range(3):
        want = torch.quantile(x[u][mask[u]].double(), torch.tensor(qs, dtype=torch.float64))
        assert torch.allclose(got[u].double(), want, rtol=1e-6, atol=0), (u, got[u], want)
        assert got[u][0] == x[u][mask[u]].min() and got[u][-1] == x[u][mask[u]].max()  # ranks 0 and n-1 exactly
    assert got[2].tolist() == [x[2, 1, 3].item()] * len(qs)
    empty = aggregates.masked_quantiles(x[0], torch.zeros(4, 37, dtype=torch.bool), qs)
    assert torch.isnan(empty).all()


def test_quadrant_sums_and_budget_groups_equal_their_definitions():
    # per-quadrant value sums (step_aggregates) and the budget's quadrant / clip-side sums against
    # sums written out token by token in float64
    g = torch.Generator().manual_seed(1)
    b, t = 6, 11
    mask = torch.rand(b, t, generator=g) < 0.7
    quad = torch.randint(0, 5, (b, t), generator=g)
    clip = torch.randint(-1, 2, (b, t), generator=g)
    cols = {
        "quadrant": quad,
        "clip": clip,
        "clipped": torch.rand(b, t, generator=g) < 0.2,
        "logprob": -torch.rand(b, t, generator=g),
        "old_logprob": -torch.rand(b, t, generator=g),
        "entropy": torch.rand(b, t, generator=g),
        "old_entropy": torch.rand(b, t, generator=g),
        "entropy_effect": torch.randn(b, t, generator=g),
    }
    cols["ratio"] = torch.exp(cols["logprob"] - cols["old_logprob"])
    lgn = torch.rand(b, t, generator=g)
    agg = dict(zip(aggregates.AGG_NAMES, aggregates.step_aggregates(cols, mask, lgn, None).tolist()))
    m = mask.numpy()
    q, c, h, eff, lg = (
        quad.numpy(),
        clip.numpy(),
        cols["entropy"].double().numpy(),
        cols["entropy_effect"].double().numpy(),
        lgn.double().numpy(),
    )
    n = m.sum()
    assert agg["n_tokens"] == n
    assert np.isclose(agg["entropy_mean"], h[m].sum() / n, rtol=1e-12)
    for code, slug in enumerate(("za", "pa_hp", "pa_lp", "na_hp", "na_lp")):
        sel = m & (q == code)
        assert agg[f"n_{slug}"] == sel.sum()
        if code:
            assert np.isclose(agg[f"lgn_mean_{slug}"], lg[sel].sum() / max(sel.sum(), 1), rtol=1e-12)
            assert np.isclose(agg[f"entropy_effect_{slug}"], eff[sel].sum(), rtol=1e-12, atol=1e-12)
    assert np.isclose(agg["entropy_effect"], eff[m].sum(), rtol=1e-12)
    assert np.isclose(agg["entropy_effect_low"], eff[m & (c < 0)].sum(), rtol=1e-12, atol=1e-12)
    assert np.isclose(agg["entropy_effect_high"], eff[m & (c > 0)].sum(), rtol=1e-12, atol=1e-12)
