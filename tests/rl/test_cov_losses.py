"""Clip-Cov and KL-Cov (entropylens.rl.cov, policy_loss methods clip_cov / kl_cov): the covariance term by
hand, gradients region by region against float64 autograd, the seeded selection, the recorded columns.
(Equality with verl's own clip_cov / kl_cov: tests/verl_env/verl_checks.py::test_cov_losses_equal_verls.)"""

from __future__ import annotations

import pytest
import torch

from entropylens.rl.aggregates import step_metrics
from entropylens.rl.cov import kl_cov_select, token_covariance
from entropylens.rl.losses import policy_loss


def test_covariance_by_hand():
    # A = [2, 0, -2 | 4 masked out], logp = [-1, -2, -3 | 9 masked out]
    # mean A = (2 + 0 - 2) / 3 = 0; mean logp = (-1 - 2 - 3) / 3 = -2
    # cov = (2 - 0)(-1 + 2) = 2; (0)(0) = 0; (-2)(-3 + 2) = 2; masked: 0
    a = torch.tensor([[2.0, 0.0, -2.0, 4.0]], dtype=torch.float64)
    lp = torch.tensor([[-1.0, -2.0, -3.0, 9.0]], dtype=torch.float64)
    m = torch.tensor([[True, True, True, False]])
    assert token_covariance(a, lp, m).tolist() == [[2.0, 0.0, 2.0, 0.0]]
    # A = [1, 1, -1], logp = [0, -3, -3]: mean A = 1/3, mean logp = -2
    # cov = (2/3)(2) = 4/3; (2/3)(-1) = -2/3; (-4/3)(-1) = 4/3
    a2 = torch.tensor([[1.0, 1.0, -1.0]], dtype=torch.float64)
    lp2 = torch.tensor([[0.0, -3.0, -3.0]], dtype=torch.float64)
    got = token_covariance(a2, lp2, torch.ones(1, 3, dtype=torch.bool))
    torch.testing.assert_close(got, torch.tensor([[4 / 3, -2 / 3, 4 / 3]], dtype=torch.float64), rtol=0, atol=1e-15)
    # KL-Cov's top share: n = 3, ratio 0.5 -> k = max(1, int(1.5)) = 1: the first of the two 4/3 ties or
    # the other; with ratio 0.34 -> k = 1 too; ratio 1 -> all 3
    assert kl_cov_select(got, torch.ones(1, 3, dtype=torch.bool), 1.0).all()


def _batch(seed=0, b=6, t=12):
    """float64 tokens in every region: ratios far below / inside / above the clip band, A of both signs and
    0, large |A| so that many covariances fall in Clip-Cov's band (1, 5), a masked tail."""
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(b, t, generator=g, dtype=torch.float64) * 4 - 0.05
    log_r = (torch.rand(b, t, generator=g, dtype=torch.float64) - 0.5) * 1.6
    logp = (old + log_r).requires_grad_(True)
    adv = torch.tensor([3.0, -3.0, 2.0, -2.5, 0.0, 4.0], dtype=torch.float64)[:b].unsqueeze(1).expand(b, t).clone()
    mask = torch.ones(b, t, dtype=torch.bool)
    mask[1, -4:] = False
    mask[3, -2:] = False
    return old, logp, adv, mask


def _grad(out, logp):
    (g,) = torch.autograd.grad(out.loss, logp)
    return g


def test_clip_cov_gradient_by_region_against_autograd():
    old, logp, adv, mask = _batch()
    out = policy_loss(
        logp,
        old,
        adv,
        mask,
        method="clip_cov",
        clip_cov_ratio=0.05,
        clip_cov_lb=1.0,
        clip_cov_ub=5.0,
        generator=torch.Generator().manual_seed(7),
    )
    g = _grad(out, logp)
    c = out.columns
    n = int(mask.sum())  # token-mean: w = 1 / n
    r = torch.exp(logp.detach() - old)
    sel, clipped = c["cov_clipped"], c["clipped"]
    # the selection: max(int(0.05 * n), 1) tokens, all in the band, none PPO-clipped
    assert int(sel.sum()) == max(int(0.05 * n), 1) and n == 66
    assert ((c["cov"] > 1) & (c["cov"] < 5))[sel].all() and not (sel & clipped).any()
    kept = mask & ~sel & ~clipped
    for name, region in (("selected", sel), ("clipped", clipped), ("kept", kept)):
        assert region.any(), name
    torch.testing.assert_close(g[sel], torch.zeros_like(g[sel]), rtol=0, atol=0)  # corr = 0: no gradient
    torch.testing.assert_close(g[clipped], torch.zeros_like(g[clipped]), rtol=0, atol=0)  # PPO-clip
    torch.testing.assert_close(g[kept], (-adv * r / n)[kept], rtol=1e-14, atol=0)  # -A r w
    torch.testing.assert_close(c["grad_coef"], g, rtol=1e-14, atol=0)
    assert (c["token_loss"][sel] == 0).all()  # the value is multiplied by 0 too (verl's corr)
    # grad_changed: PPO-clipped and selected tokens with A != 0; dropped = unclipped - kept gradient
    assert torch.equal(c["grad_changed"], (clipped | (sel & (adv != 0))) & mask)
    torch.testing.assert_close(c["grad_coef_unclipped"][sel], (-adv * r / n)[sel], rtol=1e-14, atol=0)
    m = out.scalars()
    assert m["cov_clipped_frac"] == pytest.approx(int(sel.sum()) / n)


def test_clip_cov_selection_is_seeded_and_the_global_generator_is_verls_default():
    old, logp, adv, mask = _batch(seed=3)
    kw = dict(method="clip_cov", clip_cov_ratio=0.05)
    a = policy_loss(logp, old, adv, mask, generator=torch.Generator().manual_seed(1), **kw).columns["cov_clipped"]
    b = policy_loss(logp, old, adv, mask, generator=torch.Generator().manual_seed(1), **kw).columns["cov_clipped"]
    assert torch.equal(a, b)
    picks = {
        tuple(
            policy_loss(logp, old, adv, mask, generator=torch.Generator().manual_seed(s), **kw)
            .columns["cov_clipped"]
            .nonzero()
            .flatten()
            .tolist()
        )
        for s in range(6)
    }
    assert len(picks) > 1  # the draw does depend on the seed
    torch.manual_seed(1)
    c = policy_loss(logp, old, adv, mask, **kw).columns["cov_clipped"]
    assert torch.equal(a, c)  # no generator: the global one, seeded the same way


def test_kl_cov_gradient_by_region_against_autograd():
    old, logp, adv, mask = _batch(seed=1)
    coef = 0.3
    out = policy_loss(
        logp, old, adv, mask, method="kl_cov", kl_cov_ratio=0.1, ppo_kl_coef=coef, agg="seq-mean-token-mean"
    )
    g = _grad(out, logp)
    c = out.columns
    n = int(mask.sum())
    k = max(1, int(0.1 * n))
    pen = c["kl_cov_penalised"]
    assert int(pen.sum()) == k
    # the top-k by cov over the masked-in tokens
    top = torch.where(mask, c["cov"], torch.full_like(c["cov"], -float("inf"))).flatten().topk(k).indices
    assert sorted(pen.flatten().nonzero().flatten().tolist()) == sorted(top.tolist())
    lengths = mask.sum(-1, keepdim=True).double()
    w = mask / (lengths * mask.shape[0])  # seq-mean-token-mean, every sequence has tokens
    lr = logp.detach() - old
    r = torch.exp(lr)
    assert not c["clipped"].any() and (c["clip"] == 0).all()  # KL-Cov clips nothing
    torch.testing.assert_close(g[pen], (w * (-adv * r + coef * torch.sign(lr)))[pen], rtol=1e-13, atol=0)
    torch.testing.assert_close(g[mask & ~pen], (w * -adv * r)[mask & ~pen], rtol=1e-13, atol=0)
    torch.testing.assert_close(c["grad_coef"], g, rtol=1e-13, atol=0)
    # value: -A r + coef |log r| on the penalised tokens
    torch.testing.assert_close(
        out.loss, (w * (-adv * r + torch.where(pen, coef * lr.abs(), 0.0))).sum(), rtol=1e-13, atol=0
    )
    assert torch.equal(c["grad_changed"], pen & (lr != 0))
    assert out.scalars()["kl_cov_frac"] == pytest.approx(k / n)


def test_cov_methods_refuse_what_verl_does_not_define():
    old, logp, adv, mask = _batch()
    with pytest.raises(ValueError, match="ratio_level"):
        policy_loss(logp, old, adv, mask, method="clip_cov", ratio_level="sequence")
    with pytest.raises(ValueError, match="dual_clip and delta"):
        policy_loss(logp, old, adv, mask, method="kl_cov", dual_clip=3.0)
    with pytest.raises(ValueError, match="kl_cov_ratio"):
        policy_loss(logp, old, adv, mask, method="kl_cov", kl_cov_ratio=0.0)
    with pytest.raises(ValueError, match="clip_cov_lb"):
        policy_loss(logp, old, adv, mask, method="clip_cov", clip_cov_lb=5.0, clip_cov_ub=1.0)


def test_clip_cov_with_dual_clip_never_selects_a_capped_token_and_the_drop_splits_by_cause():
    old, logp, adv, mask = _batch(seed=2)
    with torch.no_grad():
        logp[1, :3] = old[1, :3] + 1.5  # A < 0, r = e^1.5 > 3: dual-clipped
    out = policy_loss(
        logp,
        old,
        adv,
        mask,
        method="clip_cov",
        clip_cov_ratio=0.2,
        dual_clip=3.0,
        generator=torch.Generator().manual_seed(0),
    )
    c = out.columns
    assert c["dual_clipped"].any() and c["cov_clipped"].any()
    assert not (c["dual_clipped"] & c["cov_clipped"]).any()
    # the dropped entropy effect, with a made-up sensitivity s: the six causes add up to the total
    cols = {k: v.float() if v.is_floating_point() else v for k, v in c.items()}
    s = torch.linspace(-1, 1, mask.numel()).reshape(mask.shape)
    from entropylens.record.device.blocks import add_attribution

    add_attribution(cols, s, 1.0)
    m = {k: float(v) for k, v in step_metrics(cols, mask).items()}
    parts = ["clip_low", "clip_high", "dual_clip", "clip_cov"]
    assert "entropy_effect_dropped_kl_cov" not in m and "entropy_effect_dropped_erc" not in m
    assert sum(m[f"entropy_effect_dropped_{p}"] for p in parts) == pytest.approx(m["entropy_effect_dropped"], rel=1e-5)
    want = float(((c["grad_coef_unclipped"] - c["grad_coef"]) * s.double())[c["cov_clipped"]].sum())
    assert m["entropy_effect_dropped_clip_cov"] == pytest.approx(want, rel=1e-5)


def test_recorded_run_has_the_cov_columns(tmp_path):
    from entropylens.read import query
    from entropylens.record.recorder import Recorder

    old, logp, adv, mask = _batch(seed=4)
    rec = Recorder(tmp_path, "r", config={"method": "kl_cov"})
    out = policy_loss(logp, old.float(), adv, mask, method="kl_cov", kl_cov_ratio=0.1)
    rec.record_update(0, 0, mask=mask, advantages=adv, logprobs=logp.detach(), old_logprobs=old, loss=out)
    rec.record_step(0)
    rec.close()
    con = query.connect(tmp_path / "r")
    rows = con.execute("select cov, advantage, logprob, kl_cov_penalised, cov_clipped from tokens").fetchall()
    assert len(rows) == int(mask.sum())
    a = torch.tensor([r[1] for r in rows], dtype=torch.float64)
    lp = torch.tensor([r[2] for r in rows], dtype=torch.float64)
    want = (a - a.mean()) * (lp - lp.mean())
    torch.testing.assert_close(torch.tensor([r[0] for r in rows], dtype=torch.float64), want, rtol=1e-4, atol=1e-5)
    assert sum(bool(r[3]) for r in rows) == int(out.columns["kl_cov_penalised"].sum())
    assert all(r[4] is None for r in rows)  # no clip_cov: null
    frac, cc = con.execute("select kl_cov_frac, cov_clipped_frac from steps").fetchone()
    assert frac == pytest.approx(int(out.columns["kl_cov_penalised"].sum()) / int(mask.sum())) and cc is None


def _logit_batch():
    """A seeded [6, 10, 11] logits batch for policy_update: (logits (grad), tokens, mask, adv [6], old logprobs)."""
    g = torch.Generator().manual_seed(5)
    b, t, v = 6, 10, 11
    logits = (torch.randn(b, t, v, generator=g) * 2).requires_grad_(True)
    tokens = torch.randint(0, v, (b, t), generator=g)
    mask = torch.ones(b, t, dtype=torch.bool)
    adv = torch.tensor([3.0, -3.0, 2.0, -2.0, 4.0, -1.0])
    old = (
        torch.log_softmax(logits.detach() + 0.3 * torch.randn(b, t, v, generator=g), -1)
        .gather(-1, tokens.unsqueeze(-1))
        .squeeze(-1)
    )
    return logits, tokens, mask, adv, old


def test_plain_loop_policy_update_records_clip_cov(tmp_path):
    from entropylens.integrations.torch import policy_update
    from entropylens.read import query
    from entropylens.record.recorder import Recorder

    logits, tokens, mask, adv, old = _logit_batch()
    rec = Recorder(tmp_path, "loop", config={"method": "clip_cov"})
    out = policy_update(
        rec,
        0,
        0,
        logits,
        tokens,
        mask,
        adv,
        old,
        method="clip_cov",
        clip_cov_ratio=0.1,
        clip_cov_lb=0.0,
        generator=torch.Generator().manual_seed(0),
    )
    out.loss.backward()
    rec.record_step(0)
    rec.close()
    sel = out.columns["cov_clipped"]
    assert int(sel.sum()) == 6  # max(int(0.1 * 60), 1), the band (0, 5) holding more tokens than that
    con = query.connect(tmp_path / "loop")
    n_sel, zero_g, frac, drop = con.execute(
        "select count(*) filter (where cov_clipped), count(*) filter (where cov_clipped and grad_coef = 0), "
        "(select cov_clipped_frac from steps), (select entropy_effect_dropped_clip_cov from steps) from tokens"
    ).fetchone()
    assert n_sel == zero_g == 6 and frac == pytest.approx(0.1) and drop is not None


@pytest.mark.parametrize("method, cause", [("clip_cov", "dropped_clip_cov"), ("kl_cov", "dropped_kl_cov")])
def test_entropy_budget_names_the_cov_cause_and_the_parts_add_up(tmp_path, method, cause):
    """entropy_budget_by_step's by-cause columns add up to step_dropped for Clip-Cov and KL-Cov too (a new
    user's report once said 'the parts add up' while leaving these two out), and the report's caption names
    the cause."""
    from entropylens.integrations.torch import policy_update
    from entropylens.read import query
    from entropylens.record.recorder import Recorder
    from entropylens.report.captions import _cause_note
    from entropylens.report.runset import from_connection

    logits, tokens, mask, adv, old = _logit_batch()
    kw = (
        dict(clip_cov_ratio=0.1, clip_cov_lb=0.0, generator=torch.Generator().manual_seed(0))
        if method == "clip_cov"
        else dict(kl_cov_ratio=0.2)
    )
    with Recorder(tmp_path, method, config={"method": method}) as rec:
        out = policy_update(rec, 0, 0, logits, tokens, mask, adv, old, method=method, **kw)
        out.loss.backward()
        rec.record_step(0)
    con = query.connect(tmp_path)
    df = query.run_analysis(con, "entropy_budget_by_step")
    row = df.iloc[0]
    parts = [
        c
        for c in (
            "dropped_clip_low",
            "dropped_clip_high",
            "dropped_dual_clip",
            "dropped_clip_cov",
            "dropped_kl_cov",
            "dropped_erc",
        )
        if row[c] == row[c]
    ]
    assert cause in parts and row[cause] != 0
    assert sum(row[c] for c in parts) == pytest.approx(row["step_dropped"], rel=1e-5, abs=1e-9)
    note = _cause_note(df, from_connection(con))
    assert ("Clip-Cov" if method == "clip_cov" else "KL-Cov") in note, note
