"""Every method, every region: hand-worked gradients, autograd, and the closed-form grad_coef.

The shared fixture puts one token in each region (eps 0.2 / 0.2 unless said):
  t0  r = 1.0   A = +1   inside
  t1  r = 0.5   A = +1   low side, A > 0: PPO keeps the gradient
  t2  r = 0.5   A = -1   low side, A < 0: PPO-clip drops it (clipped_low)
  t3  r = 1.5   A = +1   high side, A > 0: PPO-clip drops it (clipped_high)
  t4  r = 1.5   A = -1   high side, A < 0: kept
  t5  r = 20    A = -1   high side, A < 0: dual-clip territory (c = 10)
  t6  r = 1.25  A = +1   clipped at eps_high 0.2, inside at DAPO's 0.28
token-mean over 7 tokens: w = 1/7 each.
"""

import math

import pytest
import torch

from entropylens.rl import stats
from entropylens.rl.cov import COV_METHODS
from entropylens.rl.losses import METHODS, policy_loss

# the methods whose region rules these tests spell out (Clip-Cov / KL-Cov: tests/rl/test_cov_losses.py)
METHODS = tuple(m for m in METHODS if m not in COV_METHODS)

R = [1.0, 0.5, 0.5, 1.5, 1.5, 20.0, 1.25]
A = [1.0, 1.0, -1.0, 1.0, -1.0, -1.0, 1.0]


def fixture(dtype=torch.float64):
    old = torch.log(torch.tensor([[0.3, 0.6, 0.2, 0.4, 0.5, 0.01, 0.7]], dtype=dtype))
    logp = (old + torch.log(torch.tensor([R], dtype=dtype))).requires_grad_(True)
    adv = torch.tensor([A], dtype=dtype)
    mask = torch.ones(1, 7, dtype=torch.bool)
    return logp, old, adv, mask


def check(method, expected_g, **kw):
    logp, old, adv, mask = fixture()
    out = policy_loss(logp, old, adv, mask, method=method, **kw)
    (auto,) = torch.autograd.grad(out.loss, logp)
    exp = torch.tensor([expected_g], dtype=torch.float64) / 7.0
    torch.testing.assert_close(auto, exp, rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(out.columns["grad_coef"].double(), exp, rtol=1e-6, atol=1e-9)
    return out


def test_grpo_regions():
    # g = -r A inside and on the kept side; 0 where clipped (t2, t3, t6 at eps_high 0.2)
    # t0 -1*1 = -1; t1 -0.5*1 = -0.5; t4 -1.5*-1 = 1.5; t5 -20*-1 = 20
    out = check("grpo", [-1.0, -0.5, 0.0, 0.0, 1.5, 20.0, 0.0])
    assert out.columns["clip"].tolist() == [[0, -1, -1, 1, 1, 1, 1]]
    assert out.columns["clipped"].tolist() == [[False, False, True, True, False, False, True]]
    # forward value = max(-A r, -A clip(r)):  [-1, -0.5, 0.8, -1.2, 1.5, 20, -1.2] / 7
    assert out.loss.item() == pytest.approx((-1 - 0.5 + 0.8 - 1.2 + 1.5 + 20 - 1.2) / 7)
    m = out.scalars()
    assert m["clip_low_frac"] == pytest.approx(1 / 7)
    assert m["clip_high_frac"] == pytest.approx(2 / 7)
    assert m["region_low_frac"] == pytest.approx(2 / 7)
    assert m["region_high_frac"] == pytest.approx(4 / 7)


def test_grpo_forward_matches_max_form():
    logp, old, adv, mask = fixture()
    out = policy_loss(logp, old, adv, mask, method="grpo")
    r = torch.exp(logp - old)
    ref = torch.maximum(-adv * r, -adv * r.clamp(0.8, 1.2)).mean()
    assert out.loss.item() == pytest.approx(ref.item())
    (g_ref,) = torch.autograd.grad(ref, logp)
    (g,) = torch.autograd.grad(policy_loss(logp, old, adv, mask, method="grpo").loss, logp)
    torch.testing.assert_close(g, g_ref)


def test_dual_clip():
    # t5: A < 0, r = 20 > c = 10 -> l = -c A = 10, g = 0. t4 (r = 1.5 < 10) unaffected.
    out = check("grpo", [-1.0, -0.5, 0.0, 0.0, 1.5, 0.0, 0.0], dual_clip=10.0)
    assert out.columns["token_loss"][0, 5].item() == pytest.approx(10.0)
    assert out.columns["dual_clipped"].tolist() == [[False] * 5 + [True, False]]


def test_dapo_clip_higher():
    # eps_high 0.28: t6 (r = 1.25) is inside now: g = -1.25
    out = check("dapo", [-1.0, -0.5, 0.0, 0.0, 1.5, 20.0, -1.25])
    assert out.config["eps_high"] == 0.28


def test_gppo_keeps_bounded_gradient():
    # clipped_low t2: g = -(1-0.2) A = -0.8 * -1 = 0.8; clipped_high t3, t6: g = -(1+0.2) * 1 = -1.2
    out = check("gppo", [-1.0, -0.5, 0.8, -1.2, 1.5, 20.0, -1.2])
    # same forward value as PPO-clip
    logp, old, adv, mask = fixture()
    assert out.loss.item() == pytest.approx(policy_loss(logp, old, adv, mask, method="grpo").loss.item())


def test_ce_gppo_betas():
    # beta1 (low side) 0.5: t2 g = -0.5 * 0.8 * -1 = 0.4; beta2 (high side) 1: t3, t6 g = -1.2
    check("ce_gppo", [-1.0, -0.5, 0.4, -1.2, 1.5, 20.0, -1.2], beta1=0.5, beta2=1.0)
    # beta1 0.75, beta2 0.25: t2 0.75 * 0.8 = 0.6; t3 -0.25 * 1.2 = -0.3
    check("ce_gppo", [-1.0, -0.5, 0.6, -0.3, 1.5, 20.0, -0.3], beta1=0.75, beta2=0.25)


def test_ce_gppo_limits():
    logp, old, adv, mask = fixture()

    def grad(**kw):
        return torch.autograd.grad(policy_loss(logp, old, adv, mask, **kw).loss, logp)[0]

    # beta1 = beta2 = 1 is GPPO (gradient and value)
    torch.testing.assert_close(grad(method="ce_gppo", beta1=1.0, beta2=1.0), grad(method="gppo"))
    # beta1 = beta2 = 0 gives PPO-clip's gradient
    torch.testing.assert_close(grad(method="ce_gppo", beta1=0.0, beta2=0.0), grad(method="grpo"))


def test_cispo_never_zero():
    # g = -clip(r, 0.8, 1.2) A: [-1, -0.8, 0.8, -1.2, 1.2, 1.2, -1.2]
    out = check("cispo", [-1.0, -0.8, 0.8, -1.2, 1.2, 1.2, -1.2])
    assert (out.columns["grad_coef"] != 0).all()


def test_gspo_sequence_ratio():
    # seq0: log r = [0, 0] -> s = 1 (inside), A = +1, L = 2; seq1: log r = [0.1, -0.1, 0.3] ->
    # s = exp(0.1) = 1.10517 > 1 + 4e-4, A = -1 (kept side): g = -A s.
    # seq-mean-token-mean, 2 sequences: seq0 w = 1/(2*2) = 0.25 -> g = -0.25;
    # seq1 w = 1/(3*2) -> g = 1.10517 / 6 = 0.184195.
    old = torch.log(torch.full((2, 3), 0.5, dtype=torch.float64))
    lr = torch.tensor([[0.0, 0.0, 0.0], [0.1, -0.1, 0.3]], dtype=torch.float64)
    logp = (old + lr).requires_grad_(True)
    mask = torch.tensor([[True, True, False], [True, True, True]])
    out = policy_loss(logp, old, torch.tensor([1.0, -1.0], dtype=torch.float64), mask, method="gspo")
    (g,) = torch.autograd.grad(out.loss, logp)
    s = math.exp(0.1)
    exp = torch.tensor([[-0.25, -0.25, 0.0], [s / 6, s / 6, s / 6]], dtype=torch.float64)
    torch.testing.assert_close(g, exp)
    torch.testing.assert_close(out.columns["grad_coef"].double(), exp)
    assert out.columns["clip"].tolist() == [[0, 0, 0], [1, 1, 1]]
    # with A = +1 on seq1 the whole sequence is clipped: no gradient
    out2 = policy_loss(logp, old, torch.tensor([1.0, 1.0], dtype=torch.float64), mask, method="gspo")
    (g2,) = torch.autograd.grad(out2.loss, logp)
    assert g2[1].abs().sum().item() == 0.0
    assert out2.columns["clipped"][1].all()


def test_erc_zeroes_exactly_out_of_band_and_keeps_value():
    logp, old, adv, mask = fixture()
    h_old = torch.ones(1, 7, dtype=torch.float64)
    # rho = [1.0, 0.94, 0.96, 1.04, 1.06, 1.0, 2.0] -> band (0.95, 1.05) keeps t0, t2, t3, t5
    h = torch.tensor([[1.0, 0.94, 0.96, 1.04, 1.06, 1.0, 2.0]], dtype=torch.float64)
    base = policy_loss(logp, old, adv, mask, method="gppo", entropy=h, old_entropy=h_old)
    out = policy_loss(logp, old, adv, mask, method="gppo", entropy=h, old_entropy=h_old, erc=(0.95, 1.05))
    assert out.loss.item() == pytest.approx(base.loss.item())  # forward value untouched
    keep = torch.tensor([[True, False, True, True, False, True, False]])
    assert out.columns["erc_kept"].tolist() == keep.tolist()
    (g,) = torch.autograd.grad(out.loss, logp)
    (g0,) = torch.autograd.grad(base.loss, logp)
    torch.testing.assert_close(g, torch.where(keep, g0, torch.zeros_like(g0)))
    torch.testing.assert_close(out.columns["grad_coef"].double(), g)
    assert out.scalars()["erc_drop_frac"] == pytest.approx(3 / 7)
    # dropped tokens stay in the denominator: the kept tokens' grad is still 1/7-weighted
    assert g[0, 0].item() == pytest.approx(-1.0 / 7)


def test_aggregations():
    # lengths 1 and 3. token-mean: 1/4 each. seq-mean-token-mean: seq0 1/(1*2) = 0.5, seq1 1/(3*2).
    # seq-mean-token-sum: 1/2 each.  (r = 1 everywhere, A = -1 -> g = -r A = 1)
    old = torch.log(torch.full((2, 3), 0.5, dtype=torch.float64))
    logp = old.clone().requires_grad_(True)
    mask = torch.tensor([[True, False, False], [True, True, True]])
    adv = torch.tensor([-1.0, -1.0], dtype=torch.float64)
    for agg, exp in [
        ("token-mean", [[0.25, 0, 0], [0.25, 0.25, 0.25]]),
        ("seq-mean-token-mean", [[0.5, 0, 0], [1 / 6, 1 / 6, 1 / 6]]),
        ("seq-mean-token-sum", [[0.5, 0, 0], [0.5, 0.5, 0.5]]),
    ]:
        out = policy_loss(logp, old, adv, mask, agg=agg)
        (g,) = torch.autograd.grad(out.loss, logp)
        torch.testing.assert_close(g, torch.tensor(exp, dtype=torch.float64))
        torch.testing.assert_close(out.columns["grad_coef"].double(), g)


def test_entropy_bonus_and_kl():
    logp, old, adv, mask = fixture()
    h = torch.full((1, 7), 0.7, dtype=torch.float64, requires_grad=True)
    ref = old + 0.1
    out = policy_loss(logp, old, adv, mask, entropy=h, entropy_coef=0.003, ref_logprobs=ref, kl_coef=0.05)
    g_lp, g_h = torch.autograd.grad(out.loss, [logp, h])
    # entropy bonus: dLoss/dH = -0.003 / 7 on every token
    torch.testing.assert_close(g_h, torch.full_like(h, -0.003 / 7))
    torch.testing.assert_close(out.columns["grad_coef"].double(), g_lp)
    # k3 term: d/dlogp kl (exp(ref - logp) - (ref - logp) - 1) = kl (1 - exp(ref - logp))
    base = policy_loss(logp, old, adv, mask)
    (g_base,) = torch.autograd.grad(base.loss, logp)
    torch.testing.assert_close(g_lp - g_base, 0.05 * (1 - torch.exp(ref - logp.detach())) / 7)


def test_quadrant_columns_and_metrics():
    logp, old, adv, mask = fixture()
    out = policy_loss(logp, old, adv, mask, tau=0.5)
    # p = exp(old) = [0.3, 0.6, 0.2, 0.4, 0.5, 0.01, 0.7]; A = [+, +, -, +, -, -, +]
    # -> PA&LP, PA&HP, NA&LP, PA&LP, NA&HP, NA&LP, PA&HP
    assert out.columns["quadrant"].tolist() == [[2, 1, 4, 2, 3, 4, 1]]
    torch.testing.assert_close(out.columns["prob"].double(), torch.exp(old))
    m = out.scalars()
    assert m["n_pa_lp"] == 2 and m["n_tokens"] == 7
    # clipped: t2 (NA&LP), t3 (PA&LP), t6 (PA&HP): PA&LP 1 of 2, NA&LP 1 of 2, PA&HP 1 of 2, NA&HP 0
    assert m["clip_frac_pa_lp"] == pytest.approx(0.5)
    assert m["clip_frac_na_hp"] == 0.0


@pytest.mark.parametrize("method", METHODS)
def test_logit_grad_norm_matches_autograd_of_actual_loss(method):
    # ||dLoss/dz|| from float64 autograd through logits -> logprobs -> policy_loss equals
    # stats.logit_grad_norm(logits, tokens, grad_coef) (|g| sqrt(1 - 2p + sum p^2)), p_a > 0.999 included.
    torch.manual_seed(7)
    B, T, V = 3, 5, 30
    logits_old = torch.randn(B, T, V).double() * 2
    logits_old[0, 0, 4] = 12.0
    tokens = torch.randint(0, V, (B, T))
    tokens[0, 0] = 4
    logits = (logits_old + 0.4 * torch.randn(B, T, V).double()).requires_grad_(True)
    with torch.no_grad():
        old_lp, _ = stats.logprobs_and_entropy(logits_old, tokens)
    lp, _ = stats.logprobs_and_entropy(logits, tokens)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[2, 3:] = False
    out = policy_loss(lp.double(), old_lp.double(), torch.tensor([1.0, -0.5, 2.0]).double(), mask, method=method)
    (gz,) = torch.autograd.grad(out.loss, logits)
    ref = gz.norm(dim=-1)
    got = stats.logit_grad_norm(logits.detach(), tokens, out.columns["grad_coef"])
    torch.testing.assert_close(got.double(), ref, rtol=1e-4, atol=1e-9)


def test_empty_mask_gives_zero_loss():
    logp, old, adv, _ = fixture()
    mask = torch.zeros(1, 7, dtype=torch.bool)
    out = policy_loss(logp, old, adv, mask, method="ce_gppo")
    assert out.loss.item() == 0.0 and not torch.isnan(out.loss)
    (g,) = torch.autograd.grad(out.loss, logp)
    assert g.abs().sum().item() == 0.0
    scal = out.scalars()  # counts over no tokens are 0, sums 0; means and fractions over no tokens NaN (null)
    assert scal["n_tokens"] == 0 and scal["n_pa_lp"] == 0 and scal["n_nonfinite_ratio"] == 0
    assert math.isnan(scal["clipped_frac"]) and math.isnan(scal["ratio_mean"]) and math.isnan(scal["clip_frac_na_lp"])
    assert all(not math.isnan(v) for k, v in scal.items() if k.startswith("n_") or k.startswith("entropy_effect"))


def test_bad_inputs():
    logp, old, adv, mask = fixture()
    with pytest.raises(ValueError, match="valid methods: grpo, dapo, gppo, ce_gppo, cispo, gspo"):
        policy_loss(logp, old, adv, mask, method="ppo2")
    with pytest.raises(ValueError, match="old_logprobs shape"):
        policy_loss(logp, old[:, :3], adv, mask)
    with pytest.raises(ValueError, match="advantages"):
        policy_loss(logp, old, torch.ones(3), mask)
    bad = old.clone()
    bad[0, 2] = float("nan")
    with pytest.raises(ValueError, match="old_logprobs contains NaN"):
        policy_loss(logp, bad, adv, mask)
    # NaN only at a masked-out position is fine (padding)
    m2 = mask.clone()
    m2[0, 2] = False
    assert torch.isfinite(policy_loss(logp, bad, adv, m2).loss)
    with pytest.raises(ValueError, match="erc needs entropy"):
        policy_loss(logp, old, adv, mask, erc=(0.95, 1.05))
    with pytest.raises(ValueError, match="eps_low"):
        policy_loss(logp, old, adv, mask, eps_low=1.5)
    with pytest.raises(ValueError, match="eps_high"):
        policy_loss(logp, old, adv, mask, eps_high=-0.1)
    with pytest.raises(ValueError, match="dual_clip"):
        policy_loss(logp, old, adv, mask, dual_clip=0.5)
    with pytest.raises(ValueError, match="agg"):
        policy_loss(logp, old, adv, mask, agg="mean")
    with pytest.raises(ValueError, match="entropy_coef needs entropy"):
        policy_loss(logp, old, adv, mask, entropy_coef=0.01)


# --- extreme ratios, scale, the unclipped reference ---------------------------------------------


@pytest.mark.parametrize("method", METHODS)
def test_extreme_log_ratios_give_finite_exact_gradients(method):
    # log r from -200 to +50: in float32 exp(-110) underflows to 0, so the naive GPPO form
    # -A (1-eps) / sg(r) * r would be 0/0 = NaN. A alternates -1, +1, so both clipped sides occur:
    #   log r = -200, A = -1: r = 0 < 0.8, clipped_low: gppo g = -(1-0.2)(-1) = 0.8 (grpo 0)
    #   log r = +50,  A = +1: r = 5.2e21 > 1.2, clipped_high: gppo g = -(1.2)(1) = -1.2 (grpo 0)
    #   A = +1 at r ~ 0 (kept low side): g = -r A ~ 0; A = -1 at r = e^50 (kept high side): g = e^50.
    lr = torch.linspace(-200.0, 50.0, 26, dtype=torch.float64)
    lr = torch.cat([lr, torch.tensor([-110.0, -110.0], dtype=torch.float64)]).unsqueeze(0)  # [1, 28]
    n = lr.shape[1]
    old = torch.full((1, n), -1.0, dtype=torch.float64)
    logp = (old + lr).requires_grad_(True)
    adv = torch.tensor([[(-1.0) ** (i + 1) for i in range(n)]], dtype=torch.float64)  # -1, +1, ...
    mask = torch.ones(1, n, dtype=torch.bool)
    out = policy_loss(
        logp, old, adv, mask, method=method, beta1=0.5, beta2=1.0, agg="token-mean", eps_low=0.2, eps_high=0.2
    )
    (g,) = torch.autograd.grad(out.loss, logp)
    assert torch.isfinite(out.loss) and torch.isfinite(g).all()
    for name in ("grad_coef", "grad_coef_unclipped", "token_loss"):
        assert torch.isfinite(out.columns[name]).all(), name
    # the expected slope per token, in float64 from the region rules (module docstring)
    r = torch.exp(lr)
    a = adv
    low = (r < 0.8) & (a < 0)
    high = (r > 1.2) & (a > 0)
    if method in ("grpo", "dapo", "gspo"):
        exp_g = torch.where(low | high, torch.zeros_like(r), -r * a)
    elif method == "gppo":
        exp_g = torch.where(low, -0.8 * a, torch.where(high, -1.2 * a, -r * a))
    elif method == "ce_gppo":
        exp_g = torch.where(low, -0.5 * 0.8 * a, torch.where(high, -1.0 * 1.2 * a, -r * a))
    elif method == "sapo":  # gate weight 4 sig (1 - sig) at tau 1 / 1.05; verl's clamp |log r| <= 20: g = 0 beyond
        sig = torch.sigmoid(torch.where(a > 0, 1.0, 1.05) * (r - 1.0))
        exp_g = torch.where(lr.abs() > 20.0, torch.zeros_like(r), -4.0 * sig * (1.0 - sig) * r * a)
    else:  # cispo
        exp_g = -r.clamp(0.8, 1.2) * a
    if method == "gspo":  # one sequence: s = exp(mean log r) = exp(-80.23) -> whole sequence low side
        s = torch.exp(lr.mean())
        exp_g = torch.where(a < 0, torch.zeros_like(r), -s * a)
    torch.testing.assert_close(g, exp_g / n, rtol=1e-5, atol=1e-30)
    torch.testing.assert_close(out.columns["grad_coef"].double(), g, rtol=1e-5, atol=1e-30)


def test_scale_multiplies_loss_and_grad_coef():
    # scale 0.25 (e.g. 4 gradient-accumulation steps): loss, autograd and grad_coef all x 0.25
    logp, old, adv, mask = fixture()
    base = policy_loss(logp, old, adv, mask, method="ce_gppo")
    out = policy_loss(logp, old, adv, mask, method="ce_gppo", scale=0.25)
    assert out.loss.item() == pytest.approx(0.25 * base.loss.item())
    (g,) = torch.autograd.grad(out.loss, logp)
    (g0,) = torch.autograd.grad(base.loss, logp)
    torch.testing.assert_close(g, 0.25 * g0)
    torch.testing.assert_close(out.columns["grad_coef"].double(), g)
    torch.testing.assert_close(out.columns["grad_coef_unclipped"], 0.25 * base.columns["grad_coef_unclipped"])
    assert out.scalars()["loss"] == pytest.approx(out.loss.item())
    with pytest.raises(ValueError, match="scale"):
        policy_loss(logp, old, adv, mask, scale=0.0)


def _unclipped_reference_grad(method, logp, old, adv, mask, w, scale, ref=None, kl_coef=0.0):
    """float64 autograd of the unclipped surrogate: sum c w (-A rho) (+ c w kl k3), rho = r, or gspo's
    token form sg(s_i) exp(log r - sg(log r)); cispo's -A sg(r) logp has the same gradient as -A r."""
    lr = logp - old
    if method == "gspo":
        s = torch.exp((lr.detach() * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True))
        rho = s * torch.exp(lr - lr.detach())
    else:
        rho = torch.exp(lr)
    a = adv if adv.dim() == 2 else adv.unsqueeze(1)
    per_token = -a * rho
    if ref is not None:
        d = ref - logp
        per_token = per_token + kl_coef * (torch.exp(d) - d - 1.0)
    (g,) = torch.autograd.grad((scale * w * per_token * mask).sum(), logp)
    return g


@pytest.mark.parametrize("method", METHODS)
def test_grad_coef_unclipped_is_autograd_of_unclipped_surrogate(method):
    logp, old, adv, mask = fixture()
    h_old = torch.ones(1, 7, dtype=torch.float64)
    h = torch.tensor([[1.0, 0.94, 0.96, 1.04, 1.06, 1.0, 2.0]], dtype=torch.float64)  # ERC drops t1, t4, t6
    ref = old + 0.1
    kw = dict(entropy=h, old_entropy=h_old, erc=(0.95, 1.05), ref_logprobs=ref, kl_coef=0.05, scale=0.5)
    if method not in ("cispo", "sapo"):  # no clipped surrogate: no dual-clip
        kw["dual_clip"] = 10.0
    out = policy_loss(logp, old, adv, mask, method=method, **kw)
    w = torch.full((1, 7), 1 / 7, dtype=torch.float64)  # token-mean (gspo: one sequence of 7 -> 1/7 too)
    g_ref = _unclipped_reference_grad(method, logp, old, adv, mask, w, 0.5, ref, 0.05)
    torch.testing.assert_close(out.columns["grad_coef_unclipped"].double(), g_ref, rtol=1e-6, atol=1e-9)
    # grad_coef itself stays autograd of the real loss
    (g,) = torch.autograd.grad(out.loss, logp)
    torch.testing.assert_close(out.columns["grad_coef"].double(), g, rtol=1e-6, atol=1e-9)
    # where nothing changed the gradient, the two coincide
    same = ~out.columns["grad_changed"]
    torch.testing.assert_close(out.columns["grad_coef"][same], out.columns["grad_coef_unclipped"][same])


def test_grad_changed_token_by_token():
    # fixture regions (module docstring): clipped t2 (low), t3, t6 (high, eps 0.2); t5 r = 20 > c = 10
    logp, old, adv, mask = fixture()
    F, T = False, True
    for method, kw, expected in [
        ("grpo", {}, [F, F, T, T, F, F, T]),
        ("gppo", {}, [F, F, T, T, F, F, T]),  # bounded slope -0.8 A / -1.2 A instead of -r A
        ("ce_gppo", {}, [F, F, T, T, F, F, T]),
        ("grpo", {"dual_clip": 10.0}, [F, F, T, T, F, T, T]),
        ("dapo", {}, [F, F, T, T, F, F, F]),  # eps_high 0.28: t6 (r = 1.25) inside
        ("cispo", {}, [F, T, T, T, T, T, T]),  # clip(r) != r at every r outside [0.8, 1.2]
    ]:
        out = policy_loss(logp, old, adv, mask, method=method, **kw)
        assert out.columns["grad_changed"].tolist() == [expected], (method, kw)
        diff = (out.columns["grad_coef"] - out.columns["grad_coef_unclipped"]).abs() > 1e-9
        # every changed token here really has a different coefficient, every other one the same
        assert diff.tolist() == [expected], (method, kw)
    # ERC: out-of-band tokens t1, t4, t6 changed too (their gradient is zeroed)
    h_old = torch.ones(1, 7, dtype=torch.float64)
    h = torch.tensor([[1.0, 0.94, 0.96, 1.04, 1.06, 1.0, 2.0]], dtype=torch.float64)
    out = policy_loss(logp, old, adv, mask, method="gppo", entropy=h, old_entropy=h_old, erc=(0.95, 1.05))
    assert out.columns["grad_changed"].tolist() == [[F, T, T, T, T, F, T]]
    # masked-out tokens are never changed, and their coefficients are 0
    m2 = mask.clone()
    m2[0, 2] = False
    out = policy_loss(logp, old, adv, m2, method="grpo")
    assert not out.columns["grad_changed"][0, 2] and out.columns["grad_coef_unclipped"][0, 2] == 0


@pytest.mark.parametrize("method", METHODS)
def test_grad_coef_is_autograd_bit_for_bit_in_float32(method):
    # float32 maths: grad_coef is the very product autograd computes, (c w P f) s, with the TRL modifiers
    # too; without them grpo's gradient has the bits of the plain form -A exp(log r) (today's autograd)
    g = torch.Generator().manual_seed(3)
    b, t = 4, 9
    old = -torch.rand(b, t, generator=g) * 4 - 0.01
    logp = (old + 0.4 * torch.randn(b, t, generator=g)).requires_grad_(True)
    adv = torch.randn(b, generator=g)
    mask = torch.rand(b, t, generator=g) > 0.2
    h_old = torch.rand(b, t, generator=g) + 0.5
    h = h_old * (1 + 0.05 * torch.randn(b, t, generator=g))
    kws = [
        dict(),
        dict(
            entropy=h,
            old_entropy=h_old,
            erc=(0.95, 1.05),
            token_mask=torch.rand(b, t, generator=g) > 0.3,
            seq_mask=torch.tensor([1.0, 0.0, 1.0, 1.0]),
            is_weight=torch.rand(b, t, generator=g) + 0.5,
            weights=torch.rand(b, t, generator=g),
            scale=0.5,
        ),
    ]
    if method not in ("cispo", "sapo"):
        kws[1].update(delta=1.3, dual_clip=2.0)
    for kw in kws:
        out = policy_loss(logp, old, adv, mask, method=method, **kw)
        (auto,) = torch.autograd.grad(out.loss, logp)
        assert torch.equal(out.columns["grad_coef"], auto), kw.keys()
    if method == "grpo":
        r = torch.exp(torch.where(mask, logp - old, 0.0))
        a = adv.unsqueeze(1).expand(b, t)
        low, high = (r < 0.8) & (a < 0), (r > 1.2) & (a > 0)
        plain = torch.where(low, -a * 0.8, torch.where(high, -a * 1.2, -a * r))
        w = mask.float() / mask.sum()
        (want,) = torch.autograd.grad((torch.where(mask, plain, 0.0) * w).sum(), logp)
        assert torch.equal(torch.autograd.grad(policy_loss(logp, old, adv, mask).loss, logp)[0], want)
