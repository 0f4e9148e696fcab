"""stats.head_stats: a fused LM head (hidden states -> log-probs, entropies, sum p^2) against float64
autograd through the full logits hidden @ weight.T."""

import numpy as np
import pytest
import torch

from entropylens.rl.stats import head_stats


def _reference(h, w, b, tok, t):
    z = (h @ w.T + (b if b is not None else 0.0)) / t  # [.., V]: the logits head_stats never builds
    logp_all = z.log_softmax(-1)
    p = logp_all.exp()
    return logp_all.gather(-1, tok.unsqueeze(-1)).squeeze(-1), -(p * logp_all).sum(-1), p.square().sum(-1)


@pytest.mark.parametrize("bias,t,chunk", [(True, 0.7, 4), (False, 1.0, 1), (True, 1.3, None)])
def test_head_stats_values_and_gradients_equal_float64_autograd(bias, t, chunk):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(3, 5, 8, dtype=torch.float64, generator=g).requires_grad_()
    w = torch.randn(50, 8, dtype=torch.float64, generator=g).requires_grad_()
    b = torch.randn(50, dtype=torch.float64, generator=g).requires_grad_() if bias else None
    tok = torch.randint(0, 50, (3, 5), generator=g)
    g_lp, g_h = torch.randn(3, 5, dtype=torch.float64, generator=g), torch.randn(3, 5, dtype=torch.float64, generator=g)
    leaves = [x for x in (h, w, b) if x is not None]

    lp, ent, sq = head_stats(h, w, tok, bias=b, temperature=t, chunk_size=chunk)
    got = torch.autograd.grad((lp * g_lp + ent * g_h).sum(), leaves)
    lp_r, ent_r, sq_r = _reference(h, w, b, tok, t)
    want = torch.autograd.grad((lp_r * g_lp + ent_r * g_h).sum(), leaves)

    torch.testing.assert_close(lp, lp_r, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ent, ent_r, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(sq, sq_r, rtol=1e-12, atol=1e-12)
    assert not sq.requires_grad
    for a, e in zip(got, want):
        torch.testing.assert_close(a, e, rtol=1e-10, atol=1e-12)


def test_head_stats_logprob_gradient_alone_and_float32():
    g = torch.Generator().manual_seed(1)
    h = torch.randn(7, 16, generator=g).requires_grad_()
    w = torch.randn(300, 16, generator=g).requires_grad_()
    tok = torch.randint(0, 300, (7,), generator=g)
    lp, ent, sq = head_stats(h, w, tok, chunk_size=3)
    assert lp.dtype == ent.dtype == sq.dtype == torch.float32
    gh, gw = torch.autograd.grad(lp.sum(), (h, w))
    h64, w64 = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    lp_r, _, _ = _reference(h64, w64, None, tok, 1.0)
    rh, rw = torch.autograd.grad(lp_r.sum(), (h64, w64))
    torch.testing.assert_close(gh.double(), rh, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(gw.double(), rw, rtol=1e-4, atol=1e-5)


def test_head_stats_closed_form_logit_gradient_norm():
    # ||dL/dz_t|| = |g_t| / T * sqrt(1 - 2 p_t + sum_j p_j^2) for L = sum_t g_t logp_t, against autograd on z
    g = torch.Generator().manual_seed(2)
    h = torch.randn(6, 4, dtype=torch.float64, generator=g)
    w = torch.randn(11, 4, dtype=torch.float64, generator=g)
    tok = torch.randint(0, 11, (6,), generator=g)
    coef = torch.randn(6, dtype=torch.float64, generator=g)
    t = 0.8
    lp, _, sq = head_stats(h, w, tok, temperature=t)
    closed = coef.abs() / t * torch.sqrt(1 - 2 * lp.exp() + sq)
    z = (h @ w.T).requires_grad_()
    (gz,) = torch.autograd.grad(((z / t).log_softmax(-1).gather(-1, tok[:, None]).squeeze(-1) * coef).sum(), z)
    torch.testing.assert_close(closed, gz.norm(dim=-1), rtol=1e-12, atol=1e-12)


def test_head_stats_minus_inf_bias_and_bad_input():
    h = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)
    w = torch.randn(5, 3, dtype=torch.float64)
    b = torch.tensor([0.0, 0.0, float("-inf"), 0.0, 0.0], dtype=torch.float64)  # a banned token
    tok = torch.tensor([0, 1])
    lp, ent, sq = head_stats(h, w, tok, bias=b)
    lp_r, ent_r, _ = _reference(h, w[[0, 1, 3, 4]], None, torch.tensor([0, 1]), 1.0)  # the same, without it
    torch.testing.assert_close(ent, ent_r)
    (gh,) = torch.autograd.grad((lp + ent).sum(), h)
    assert torch.isfinite(gh).all()
    with pytest.raises(ValueError, match="tokens must lie in"):
        head_stats(h, w, torch.tensor([0, 5]))
    with pytest.raises(ValueError, match="do not match"):
        head_stats(h, w.T, tok)


def test_policy_update_from_hidden_states_records_the_same_rows_as_from_logits(tmp_path):
    # the same update twice: from logits (hook on the logits) and from hidden states + head (no logits,
    # closed-form norm); with scale 0.5 (gradient accumulation 2) both must see the back-propagated loss
    from entropylens.integrations.torch import policy_update
    from entropylens.read.query import connect
    from entropylens.record.recorder import Recorder

    g = torch.Generator().manual_seed(3)
    b, t, hdim, v = 3, 5, 8, 40
    head = torch.nn.Linear(hdim, v, bias=True)
    hidden0 = torch.randn(b, t, hdim, generator=g)
    tokens = torch.randint(0, v, (b, t), generator=g)
    mask = torch.ones(b, t, dtype=torch.bool)
    mask[0, 3:] = False
    adv = torch.tensor([1.0, -0.5, 0.25])
    with torch.no_grad():
        old_lp = (head(hidden0) / 0.9).log_softmax(-1).gather(-1, tokens[..., None]).squeeze(-1) - 0.1
    kw = dict(method="ce_gppo", temperature=0.9, seq_ids=torch.arange(b), scale=0.5)
    grads = {}
    for mode in ("logits", "hidden"):
        with Recorder(tmp_path, mode, config={"method": "ce_gppo"}) as rec:
            hidden = hidden0.clone().requires_grad_()
            if mode == "logits":
                out = policy_update(rec, 0, 0, head(hidden), tokens, mask, adv, old_lp, **kw)
            else:
                out = policy_update(rec, 0, 0, None, tokens, mask, adv, old_lp, hidden=hidden, head=head, **kw)
            out.loss.backward()
            grads[mode] = hidden.grad.clone()
            rec.record_step(0, update=0, grad_norm=1.0, lr=0.1)
    a = connect(tmp_path / "logits").execute("SELECT * FROM tokens ORDER BY seq, pos").df()
    h = connect(tmp_path / "hidden").execute("SELECT * FROM tokens ORDER BY seq, pos").df()
    assert len(a) == len(h) == int(mask.sum())
    for c in ("logprob", "entropy", "grad_coef", "logit_grad_norm"):
        np.testing.assert_allclose(h[c], a[c], rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(grads["hidden"], grads["logits"], rtol=1e-5, atol=1e-7)
