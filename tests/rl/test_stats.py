"""stats.py against float64 references and hand-worked numbers."""

import math

import pytest
import torch

from entropylens.rl import stats
from entropylens.schema import NA_HP, NA_LP, PA_HP, PA_LP, ZA

# every test runs under both CPU row passes: the native C loop and the eager torch chunks
pytestmark = pytest.mark.usefixtures("row_pass")


def ref_logp_entropy(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0):
    z = logits.double() / temperature
    logp_all = torch.log_softmax(z, dim=-1)
    logp = logp_all.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    ent = -(logp_all.exp() * logp_all).sum(-1)
    return logp, ent


def test_worked_entropy_two_tokens():
    # H(0.85, 0.15) = -(0.85 ln 0.85 + 0.15 ln 0.15) = 0.85*0.16252 + 0.15*1.89712 = 0.13814 + 0.28457 = 0.4227
    z = torch.log(torch.tensor([[0.85, 0.15]]))
    h = stats.entropy_from_logits(z)
    assert h.item() == pytest.approx(0.4227, abs=1e-4)


def test_erc_motivating_case():
    # old: the sampled token has 0.85 and the rest sits on one token (0.15) -> H_old = 0.4227.
    # new: sampled 0.82 (r = 0.82/0.85 = 0.9647, inside [0.8, 1.2]) and the rest spreads
    #      0.06 x 3 = 0.18 -> H = -(0.82 ln 0.82 + 3 * 0.06 ln 0.06) = 0.1627 + 0.5064 = 0.6692.
    # rho = 0.6692 / 0.4227 = 1.583, outside (0.95, 1.05): ERC drops it, PPO-clip does not.
    from entropylens.rl.losses import policy_loss

    old = torch.log(torch.tensor([[[0.85, 0.15, 1e-12, 1e-12]]]))
    new = torch.log(torch.tensor([[[0.82, 0.06, 0.06, 0.06]]]))
    tok = torch.tensor([[0]])
    old_lp, old_h = stats.logprobs_and_entropy(old, tok)
    new_lp = new.clone().requires_grad_(True)
    lp, h = stats.logprobs_and_entropy(new_lp, tok)
    assert old_h.item() == pytest.approx(0.4227, abs=1e-3)
    assert h.item() == pytest.approx(0.6692, abs=1e-3)
    out = policy_loss(
        lp,
        old_lp,
        torch.tensor([1.0]),
        torch.ones(1, 1, dtype=torch.bool),
        entropy=h,
        old_entropy=old_h,
        erc=(0.95, 1.05),
    )
    assert out.columns["ratio"].item() == pytest.approx(0.82 / 0.85, abs=1e-5)
    assert out.columns["clip"].item() == 0 and not out.columns["clipped"].item()
    assert out.columns["entropy_ratio"].item() == pytest.approx(1.583, abs=2e-3)
    assert not out.columns["erc_kept"].item()
    assert out.columns["grad_coef"].item() == 0.0
    (g,) = torch.autograd.grad(out.loss, new_lp)
    assert torch.count_nonzero(g) == 0


@pytest.mark.parametrize("offset", [0.0, 10.0, 20.0, 40.0])
def test_large_vocab_against_float64(offset):
    torch.manual_seed(0)
    v = 151936
    logits = torch.randn(6, v) * 3.0 + offset
    logits[:, 7] += torch.linspace(0, 25, 6)  # some rows peaked, some flat
    tokens = torch.tensor([7, 1, 2, 7, 151935, 7])
    lp, h = stats.logprobs_and_entropy(logits, tokens, chunk_size=4)
    rlp, rh = ref_logp_entropy(logits, tokens)
    assert (lp.double() - rlp).abs().max().item() <= 1e-4
    assert (h.double() - rh).abs().max().item() <= 1e-4
    h2 = stats.entropy_from_logits(logits)
    assert (h2.double() - rh).abs().max().item() <= 1e-4


def test_bf16_input_accumulates_in_float32():
    torch.manual_seed(1)
    logits = (torch.randn(3, 5, 32000) * 4).to(torch.bfloat16)
    tokens = torch.randint(0, 32000, (3, 5))
    lp, h = stats.logprobs_and_entropy(logits, tokens)
    assert lp.dtype == torch.float32 and h.dtype == torch.float32
    rlp, rh = ref_logp_entropy(logits.double(), tokens)  # the bf16 values, exactly, in float64
    assert (lp.double() - rlp).abs().max().item() <= 1e-4
    assert (h.double() - rh).abs().max().item() <= 1e-4


def test_chunked_equals_unchunked_and_temperature():
    torch.manual_seed(2)
    logits = torch.randn(4, 9, 50) * 2
    tokens = torch.randint(0, 50, (4, 9))
    a = stats.logprobs_and_entropy(logits, tokens, chunk_size=1, temperature=0.7)
    b = stats.logprobs_and_entropy(logits, tokens, chunk_size=1000, temperature=0.7)
    torch.testing.assert_close(a[0], b[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(a[1], b[1], rtol=0, atol=1e-6)
    rlp, rh = ref_logp_entropy(logits, tokens, temperature=0.7)
    torch.testing.assert_close(a[0].double(), rlp, rtol=0, atol=1e-5)
    torch.testing.assert_close(a[1].double(), rh, rtol=0, atol=1e-5)


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_logprob_gradient_equals_plain_autograd(temperature):
    torch.manual_seed(3)
    logits = (torch.randn(2, 7, 33) * 3).double()
    tokens = torch.randint(0, 33, (2, 7))
    w = torch.randn(2, 7).double()
    x1 = logits.clone().requires_grad_(True)
    lp, _ = stats.logprobs_and_entropy(x1, tokens, temperature=temperature, chunk_size=3)
    (lp * w).sum().backward()
    x2 = logits.clone().requires_grad_(True)
    ref = torch.log_softmax(x2 / temperature, -1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    (ref * w).sum().backward()
    torch.testing.assert_close(x1.grad, x2.grad, rtol=1e-5, atol=1e-6)


def test_entropy_gradient_when_asked():
    torch.manual_seed(4)
    logits = torch.randn(3, 4, 21).double()
    tokens = torch.randint(0, 21, (3, 4))
    x1 = logits.clone().requires_grad_(True)
    lp, h = stats.logprobs_and_entropy(x1, tokens, entropy_grad=True, chunk_size=5)
    assert h.requires_grad
    (lp.sum() * 0.3 + h.sum() * 1.7).backward()
    x2 = logits.clone().requires_grad_(True)
    la = torch.log_softmax(x2, -1)
    ref_lp = la.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    ref_h = -(la.exp() * la).sum(-1)
    (ref_lp.sum() * 0.3 + ref_h.sum() * 1.7).backward()
    torch.testing.assert_close(x1.grad, x2.grad, rtol=1e-5, atol=1e-6)
    # default: entropy carries no grad
    _, h0 = stats.logprobs_and_entropy(logits.clone().requires_grad_(True), tokens)
    assert not h0.requires_grad


def test_sum_p_squared():
    z = torch.log(torch.tensor([[0.5, 0.25, 0.25]]))
    # 0.25 + 0.0625 + 0.0625 = 0.375
    assert stats.sum_p_squared(z).item() == pytest.approx(0.375, abs=1e-6)


def _autograd_lgn(logits64, tokens, coef, temperature=1.0):
    """||d(sum coef * logp)/dz|| per position, float64 autograd."""
    x = logits64.clone().requires_grad_(True)
    lp = torch.log_softmax(x / temperature, -1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    (lp * coef.double()).sum().backward()
    return x.grad.norm(dim=-1)


@pytest.mark.parametrize("temperature", [1.0, 0.8])
def test_logit_grad_norm_against_float64_autograd(temperature):
    torch.manual_seed(5)
    logits = torch.randn(2, 6, 40).double() * 2
    logits[0, 0, 3] = 25.0  # p_a > 0.999999
    logits[1, 2, 5] = 14.0  # 1 - p_a ~ 1e-4
    tokens = torch.randint(0, 40, (2, 6))
    tokens[0, 0], tokens[1, 2] = 3, 5
    coef = torch.randn(2, 6)
    ref = _autograd_lgn(logits, tokens, coef, temperature)
    got = stats.logit_grad_norm(logits.float(), tokens, coef, temperature=temperature, chunk_size=4)
    torch.testing.assert_close(got.double(), ref, rtol=2e-4, atol=0)


def test_logit_grad_norm_stable_where_naive_fails():
    # One dominant logit: 1 - p_a ~ 8e-4. Naive float32 1 - exp(logp) loses most digits.
    v = 1000
    logits64 = torch.zeros(1, v, dtype=torch.float64)
    logits64[0, 0] = math.log(999 / 8e-4 * (1 - 8e-4))  # p_0 = 1 - 8e-4 exactly by construction
    tokens = torch.tensor([0])
    coef = torch.tensor([1.0])
    ref = _autograd_lgn(logits64, tokens, coef).item()
    got = stats.logit_grad_norm(logits64.float(), tokens, coef).item()
    assert got == pytest.approx(ref, rel=1e-3)
    # DESIGN identity: |g| sqrt(1 - 2 p_a + sum p^2), in float64 it agrees too
    lp = torch.log_softmax(logits64, -1)
    p_a = lp[0, 0].exp()
    ident = math.sqrt(1 - 2 * p_a + (lp.exp() ** 2).sum())
    assert ident == pytest.approx(ref, rel=1e-6)


def test_quadrant_table():
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0, 0.0, 0.0, 2.0, -0.5])
    prob = torch.tensor([0.9, 0.1, 0.9, 0.1, 0.9, 0.1, 0.5, 0.5])
    q = stats.quadrant(adv, prob, tau=0.5)
    assert q.dtype == torch.int8
    assert q.tolist() == [PA_HP, PA_LP, NA_HP, NA_LP, ZA, ZA, PA_HP, NA_HP]  # p == tau counts as HP


def test_clip_region():
    r = torch.tensor([0.5, 0.8, 0.81, 1.0, 1.2, 1.21, 3.0])
    assert stats.clip_region(r, 0.2, 0.2).tolist() == [-1, 0, 0, 0, 0, 1, 1]
    assert stats.clip_region(r, 0.2, 0.2).dtype == torch.int8


def test_bad_inputs():
    with pytest.raises(ValueError, match="tokens shape"):
        stats.logprobs_and_entropy(torch.randn(2, 3, 5), torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="vocabulary"):
        stats.logprobs_and_entropy(torch.randn(2, 3, 5), torch.full((2, 3), 5))
    with pytest.raises(ValueError, match="temperature"):
        stats.entropy_from_logits(torch.randn(2, 5), temperature=0.0)
