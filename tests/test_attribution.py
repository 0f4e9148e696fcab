"""First-order entropy attribution (stats.entropy_sensitivity, entropy_effect) against float64 autograd,
and -inf logits (vocabulary padding, banned tokens) in every reduction and the custom backward."""

import math

import pytest
import torch

from entropylens import stats


def _logits_with_pa(v: int, p_a: float, temperature: float, a: int, seed: int) -> torch.Tensor:
    """float64 logits [V] whose tempered softmax gives the sampled token a probability p_a exactly:
    u_a = log(p_a / (1 - p_a)) + lse_{j != a}(u)."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(v, generator=g, dtype=torch.float64) * 2.0
    u = z / temperature
    rest = torch.cat([u[:a], u[a + 1:]])
    z[a] = (math.log(p_a / (1 - p_a)) + torch.logsumexp(rest, 0).item()) * temperature
    return z


def _autograd_dh_deta(z: torch.Tensor, a: int, g: float, temperature: float) -> float:
    """d/d eta of H(softmax((z - eta (g/T)(e_a - p)) / T)) at eta = 0, float64 autograd."""
    p = torch.softmax(z / temperature, -1).detach()
    e_a = torch.zeros_like(z)
    e_a[a] = 1.0
    eta = torch.zeros((), dtype=torch.float64, requires_grad=True)
    zz = z - eta * (g / temperature) * (e_a - p)
    lp = torch.log_softmax(zz / temperature, -1)
    h = -(lp.exp() * lp).sum()
    (d,) = torch.autograd.grad(h, eta)
    return d.item()


@pytest.mark.parametrize("temperature", [0.7, 1.0, 1.3])
@pytest.mark.parametrize("p_a", [1e-6, 1e-3, 0.05, 0.3, 0.5, 0.8, 0.99, 0.999])
def test_entropy_effect_is_autograd_derivative(temperature, p_a):
    v, a, g = 50, 7, -0.37
    rows = [_logits_with_pa(v, p_a, temperature, a, seed) for seed in range(4)]
    z = torch.stack(rows)  # [4, V] float64
    tok = torch.full((4,), a)
    s = stats.entropy_sensitivity(z.float(), tok, temperature=temperature, chunk_size=3)  # float32 input
    eff = stats.entropy_effect(torch.full((4,), g), s, temperature=temperature)
    for i in range(4):
        # the float32 logits' own derivative (what the function sees), float64 autograd
        ref = _autograd_dh_deta(z[i].float().double(), a, g, temperature)
        assert eff[i].item() == pytest.approx(ref, rel=2e-4, abs=1e-9), (p_a, temperature, i)
    assert eff.dtype == torch.float32


def test_sensitivity_near_one_does_not_cancel():
    # p_a = 1 - 1e-5: s ~ p_a (1 - p_a)(log p_a + H) - ...; a naive p_a (log p_a + H) - sum p^2 (...)
    # in float32 subtracts two numbers ~1e-4 apart by ~1e-9 and keeps no digit. Ours splits off a.
    v, a, t = 1000, 3, 1.0
    z = _logits_with_pa(v, 1 - 1e-5, t, a, seed=11)
    ref = _autograd_dh_deta(z.float().double(), a, 1.0, t)
    s = stats.entropy_sensitivity(z.float().unsqueeze(0), torch.tensor([a]))
    assert s.item() == pytest.approx(ref, rel=1e-3)


def test_hand_worked_two_tokens():
    # p = (0.75, 0.25), a = 0: H = -(0.75 ln .75 + .25 ln .25) = 0.215762 + 0.346574 = 0.562335
    # log p_0 + H = -0.287682 + 0.562335 = 0.274653;  log p_1 + H = -1.386294 + 0.562335 = -0.823959
    # s = 0.75 * 0.274653 - (0.5625 * 0.274653 + 0.0625 * -0.823959)
    #   = 0.205990 - (0.154492 - 0.051497) = 0.205990 - 0.102995 = 0.102995
    z = torch.log(torch.tensor([[0.75, 0.25]]))
    s = stats.entropy_sensitivity(z, torch.tensor([0]))
    assert s.item() == pytest.approx(0.102995, abs=2e-6)
    # A > 0 gives g = dLoss/dlogp < 0: the step raises p_0 toward (1, 0) and H falls, dH = g s < 0
    eff = stats.entropy_effect(torch.tensor([-1.0]), s)
    assert eff.item() < 0


def test_sensitivity_matches_fused_pass_with_and_without_grad():
    torch.manual_seed(0)
    logits = torch.randn(3, 5, 77) * 3
    tokens = torch.randint(0, 77, (3, 5))
    s_ref = stats.entropy_sensitivity(logits, tokens, temperature=0.9, chunk_size=4)
    lp0, h0 = stats.logprobs_and_entropy(logits, tokens, temperature=0.9)
    lp, h, s = stats.logprobs_and_entropy(logits, tokens, temperature=0.9, sensitivity=True, chunk_size=2)
    torch.testing.assert_close(s, s_ref, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(lp, lp0, rtol=0, atol=1e-5)
    torch.testing.assert_close(h, h0, rtol=0, atol=1e-5)
    x = logits.clone().requires_grad_(True)
    lp_g, h_g, s_g = stats.logprobs_and_entropy(x, tokens, temperature=0.9, sensitivity=True)
    assert lp_g.requires_grad and not s_g.requires_grad
    torch.testing.assert_close(s_g, s_ref, rtol=1e-5, atol=1e-7)
    lp_g.sum().backward()  # the backward still works with the extra output
    assert torch.isfinite(x.grad).all()


# ------------------------------------------------------------------------------- -inf logits
def _with_neg_inf(seed=0, b=4, v=40, banned=(0, 5, 39)):
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(b, v, generator=g, dtype=torch.float64) * 3
    z[:, list(banned)] = float("-inf")
    keep = [j for j in range(v) if j not in banned]
    return z, keep


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_neg_inf_logits_forward_against_finite_part(temperature):
    z, keep = _with_neg_inf()
    tok = torch.tensor([1, 7, 38, 20])
    tok_keep = torch.tensor([keep.index(int(t)) for t in tok])
    zf = z[:, keep]  # the finite part: the same distribution
    lp, h, s = stats.logprobs_and_entropy(z.float(), tok, temperature=temperature, sensitivity=True, chunk_size=3)
    la = torch.log_softmax(zf.float().double() / temperature, -1)
    ref_lp = la.gather(1, tok_keep.unsqueeze(1)).squeeze(1)
    ref_h = -(la.exp() * la).sum(-1)
    assert torch.isfinite(h).all() and torch.isfinite(s).all()
    torch.testing.assert_close(lp.double(), ref_lp, rtol=0, atol=1e-5)
    torch.testing.assert_close(h.double(), ref_h, rtol=0, atol=1e-5)
    for i in range(4):
        ref_s = _autograd_dh_deta(zf[i].float().double(), int(tok_keep[i]), 1.0, temperature) * temperature**2
        assert s[i].item() == pytest.approx(ref_s, rel=1e-4, abs=1e-8)
    h2 = stats.entropy_from_logits(z.float(), temperature=temperature)
    torch.testing.assert_close(h2.double(), ref_h, rtol=0, atol=1e-5)
    # sum p^2 and the logit-gradient norm too
    ref_sq = (la.exp() ** 2).sum(-1)
    torch.testing.assert_close(stats.sum_p_squared(z.float(), temperature=temperature).double(), ref_sq,
                               rtol=1e-5, atol=0)
    lgn = stats.logit_grad_norm(z.float(), tok, torch.ones(4), temperature=temperature)
    assert torch.isfinite(lgn).all()


@pytest.mark.parametrize("g_ent", [0.0, 2.5])
def test_neg_inf_logits_backward_against_finite_part(g_ent):
    z, keep = _with_neg_inf(seed=1)
    tok = torch.tensor([2, 3, 4, 30])
    w = torch.tensor([0.5, -1.0, 2.0, 0.25], dtype=torch.float64)
    x = z.clone().requires_grad_(True)
    lp, h = stats.logprobs_and_entropy(x, tok, entropy_grad=True, chunk_size=2)
    (lp * w).sum().add((h * g_ent).sum()).backward()
    xr = z[:, keep].clone().requires_grad_(True)
    tok_keep = torch.tensor([keep.index(int(t)) for t in tok])
    la = torch.log_softmax(xr, -1)
    ref = (la.gather(1, tok_keep.unsqueeze(1)).squeeze(1) * w).sum() + g_ent * (-(la.exp() * la).sum(-1)).sum()
    ref.backward()
    assert torch.isfinite(x.grad).all()
    torch.testing.assert_close(x.grad[:, keep], xr.grad, rtol=1e-5, atol=1e-7)
    banned = [j for j in range(z.shape[1]) if j not in keep]
    assert (x.grad[:, banned] == 0).all()
