"""SAPO (verl 0.9.1's ``sapo`` policy loss, TRL's loss_type="sapo"): the soft gate in policy_loss, its
columns (sapo_weight, clip / clipped / grad_changed), the plain loop recording it.

Equality with verl's own ``compute_policy_loss_sapo`` on the same float64 batch runs inside the verl venv:
tests/verl_env/verl_checks.py::test_entropylens_sapo_equals_verl_sapo (driven by
tests/integrations/test_verl.py::test_sapo_equals_verls_sapo_and_records_in_the_cpu_harness)."""

import math

import pytest
import torch

from entropylens import Recorder
from entropylens.read.query import connect
from entropylens.rl.losses import policy_loss


def _sig(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def test_gate_hand_worked():
    # One sequence of 4 tokens, seq-mean-token-mean: aggregation weight 1/4 each. tau = 1 (A > 0), 1.05 (A <= 0).
    #   t  r    A     tau   sigma = sig(tau (r-1))   value -A (4/tau) sigma          w = 4 sigma (1-sigma)  g = -A w r
    #   0  1.0  1.0   1     sig(0) = 0.5             -1 * 4 * .5 = -2.0              4 * .5 * .5 = 1        -1.0
    #   1  1.5  2.0   1     sig(0.5) = 0.6224593     -2 * 4 * .6224593 = -4.979675   0.9400148              -2*.9400148*1.5 = -2.820045
    #   2  0.5  -1.0  1.05  sig(-0.525) = 0.3716838  4/1.05 * .3716838 = 1.415938    0.9341398              .9341398*.5 = 0.467070
    #   3  2.0  -0.5  1.05  sig(1.05) = 0.7407749    .5*4/1.05*.7407749 = 1.411000   0.7681098              .5*.7681098*2 = 0.768110
    r = torch.tensor([[1.0, 1.5, 0.5, 2.0]], dtype=torch.float64)
    adv = torch.tensor([[1.0, 2.0, -1.0, -0.5]], dtype=torch.float64)
    old = torch.full((1, 4), -1.0, dtype=torch.float64)
    logp = (old + torch.log(r)).requires_grad_(True)
    out = policy_loss(logp, old, adv, torch.ones(1, 4, dtype=torch.bool), method="sapo")
    assert out.config["agg"] == "seq-mean-token-mean" and out.config["sapo_tau_neg"] == 1.05
    values = [-2.0, -4.979675, 1.415938, 1.411000]
    weights = [1.0, 0.9400148, 0.9341398, 0.7681098]
    slopes = [-1.0, -2.820045, 0.467070, 0.768110]
    assert out.loss.item() == pytest.approx(sum(values) / 4, abs=1e-6)
    assert out.columns["token_loss"][0].tolist() == pytest.approx(values, abs=1e-6)
    assert out.columns["sapo_weight"][0].tolist() == pytest.approx(weights, abs=1e-7)
    (g,) = torch.autograd.grad(out.loss, logp)
    assert (g[0] * 4).tolist() == pytest.approx(slopes, abs=1e-6)
    assert (out.columns["grad_coef"][0] * 4).tolist() == pytest.approx(slopes, abs=1e-6)
    # the formulas the table used, from math.exp: sigma of t1
    assert _sig(0.5) == pytest.approx(0.6224593)
    # no hard clip; clip is the side of 1; the gate changed every token off r = 1 (t0 unchanged)
    assert out.columns["clipped"].tolist() == [[False] * 4]
    assert out.columns["clip"].tolist() == [[0, 1, -1, 1]]
    assert out.columns["grad_changed"].tolist() == [[False, True, True, True]]
    # unclipped reference -A r: t1 -2 * 1.5 = -3 -> grad_coef = w * unclipped
    assert (out.columns["grad_coef_unclipped"][0] * 4).tolist() == pytest.approx([-1.0, -3.0, 0.5, 1.0])
    assert out.scalars()["sapo_weight_mean"] == pytest.approx(sum(weights) / 4, abs=1e-7)
    assert out.scalars()["clipped_frac"] == 0.0


def _region_batch(dtype=torch.float64):
    """Two sequences covering every region: r = 1, r < 1 and r > 1 with A > 0, A < 0, A = 0, and
    |log r| > 20 (verl's clamp), with a masked tail."""
    lr = torch.tensor([[0.0, -0.7, 0.6, 25.0, -25.0, 1.4, 0.0], [0.3, -0.3, 2.5, -22.0, 0.05, 0.0, 9.0]], dtype=dtype)
    old = -torch.linspace(0.1, 3.0, 14, dtype=dtype).reshape(2, 7)
    adv = torch.tensor([[1.5, 1.5, 1.5, 1.5, 1.5, 1.5, 1.5], [-0.8, -0.8, -0.8, -0.8, 0.0, 0.0, -0.8]], dtype=dtype)
    mask = torch.ones(2, 7, dtype=torch.bool)
    mask[1, -1] = False
    return (old + lr).requires_grad_(True), old, adv, mask


def _reference(logp, old, adv, mask, tau_pos, tau_neg, clamp, level="token"):
    """float64 autograd of the formula as verl (token level, clamp) and TRL (no clamp, sequence level)
    write it: -A sigmoid(tau (q - 1)) 4 / tau, seq-mean-token-mean."""
    m = mask.double()
    lr = torch.where(mask, logp - old, 0.0)
    if level == "sequence":
        lr = (lr * m).sum(-1, keepdim=True) / m.sum(-1, keepdim=True)
    if clamp is not None:
        lr = lr.clamp(-clamp, clamp)
    q = torch.exp(lr)
    tau = torch.where(adv > 0, torch.tensor(tau_pos, dtype=adv.dtype), torch.tensor(tau_neg, dtype=adv.dtype))
    per_token = -adv * torch.sigmoid(tau * (q - 1.0)) * (4.0 / tau)
    loss = ((per_token * m).sum(-1) / m.sum(-1)).mean()
    (g,) = torch.autograd.grad(loss, logp)
    return loss, g


@pytest.mark.parametrize(
    "level, clamp, taus", [("token", 20.0, (1.0, 1.05)), ("token", None, (0.5, 2.0)), ("sequence", None, (1.0, 1.05))]
)
def test_region_gradients_equal_float64_autograd(level, clamp, taus):
    logp, old, adv, mask = _region_batch()
    out = policy_loss(
        logp,
        old,
        adv,
        mask,
        method="sapo",
        sapo_tau_pos=taus[0],
        sapo_tau_neg=taus[1],
        sapo_log_ratio_clamp=clamp,
        ratio_level=level,
    )
    (g,) = torch.autograd.grad(out.loss, logp)
    ref_loss, g_ref = _reference(logp, old, adv, mask, *taus, clamp, level)
    torch.testing.assert_close(out.loss, ref_loss, rtol=1e-13, atol=0)
    lr = (logp - old).detach()
    regions = {
        "r = 1": (lr == 0) & (adv != 0),
        "r < 1, A > 0": (lr < 0) & (lr > -20) & (adv > 0),
        "r > 1, A > 0": (lr > 0) & (lr < 20) & (adv > 0),
        "r < 1, A < 0": (lr < 0) & (lr > -20) & (adv < 0),
        "r > 1, A < 0": (lr > 0) & (lr < 20) & (adv < 0),
        "A = 0": adv == 0,
        "|log r| > 20": lr.abs() > 20,
    }
    for name, region in regions.items():
        region = region & mask
        assert region.any(), name
        torch.testing.assert_close(g[region], g_ref[region], rtol=1e-12, atol=1e-300, msg=name)
        torch.testing.assert_close(out.columns["grad_coef"][region], g[region], rtol=1e-12, atol=1e-300, msg=name)
    assert (g[~mask] == 0).all() and (g[adv == 0] == 0).all() if level == "token" else True
    if level == "token" and clamp is not None:  # the clamp's zero gradient, and w = 0 there
        beyond = (lr.abs() > 20) & mask
        assert (g[beyond] == 0).all() and (out.columns["sapo_weight"][beyond] == 0).all()
    if level == "token":  # grad_coef = sapo_weight * grad_coef_unclipped (-A r w_agg)
        gated = out.columns["sapo_weight"] * out.columns["grad_coef_unclipped"]
        torch.testing.assert_close(out.columns["grad_coef"], gated, rtol=1e-12, atol=1e-300)


def test_sapo_refuses_what_it_is_not():
    logp, old, adv, mask = _region_batch()
    with pytest.raises(ValueError, match="dual_clip does not apply to sapo"):
        policy_loss(logp, old, adv, mask, method="sapo", dual_clip=3.0)
    with pytest.raises(ValueError, match="delta applies to PPO-clip methods only"):
        policy_loss(logp, old, adv, mask, method="sapo", delta=1.5)
    with pytest.raises(ValueError, match="sapo_tau_pos and sapo_tau_neg must be > 0"):
        policy_loss(logp, old, adv, mask, method="sapo", sapo_tau_neg=0.0)
    with pytest.raises(ValueError, match="sapo_log_ratio_clamp must be > 0"):
        policy_loss(logp, old, adv, mask, method="sapo", sapo_log_ratio_clamp=-1.0)


def test_plain_loop_records_sapo_weight_and_the_dropped_effect_by_side(tmp_path):
    """integrations.torch.policy_update with method='sapo': tokens.sapo_weight and steps.sapo_weight_mean
    read back as computed; the dropped effect splits by the side of 1 (clip_low + clip_high == dropped)."""
    from entropylens.integrations.torch import policy_update

    g = torch.Generator().manual_seed(5)
    b, t, v = 4, 6, 11
    z_old = torch.randn(b, t, v, generator=g)
    tok = torch.randint(0, v, (b, t), generator=g)
    mask = torch.ones(b, t, dtype=torch.bool)
    mask[2, 4:] = False
    adv = torch.tensor([1.0, -1.0, 0.5, -0.3])
    with torch.no_grad():
        from entropylens.integrations.torch import old_policy_pass

        old_lp, old_h = old_policy_pass(z_old, tok)
    logits = (z_old + 0.8 * torch.randn(b, t, v, generator=g)).requires_grad_(True)
    with Recorder(tmp_path, run="sapo", config={"method": "sapo"}) as rec:
        out = policy_update(
            rec, 0, 0, logits, tok, mask, adv, old_lp, old_entropy=old_h, seq_ids=torch.arange(b), method="sapo"
        )
        out.loss.backward()
    con = connect(tmp_path)
    got = con.execute("select seq, pos, sapo_weight, clipped from tokens order by seq, pos").fetchall()
    assert len(got) == int(mask.sum())
    w = out.columns["sapo_weight"]
    for seq, pos, wt, clipped in got:
        assert wt == pytest.approx(float(w[seq, pos]), rel=1e-6) and clipped is False
    mean, clipped_frac, drop, low, high = con.execute(
        "select sapo_weight_mean, clipped_frac, entropy_effect_dropped, entropy_effect_dropped_clip_low, "
        "entropy_effect_dropped_clip_high from steps where n_tokens is not null"
    ).fetchone()
    assert mean == pytest.approx(float(w[mask].mean()), rel=1e-6) and clipped_frac == 0.0
    assert 0.0 < mean < 1.0 and abs(drop) > 0 and low + high == pytest.approx(drop, rel=1e-5)
