"""tokens.entropy_effect with an entropy bonus: policy_update's logits path includes the bonus's own term
(checked against float64 autograd of the real entropy change of each position); where that term is
not measured (hidden + head, record_update by hand) entropy_effect and its budget sums are null, and
entropy_effect_dropped (the bonus cancels in it) stays."""

import math

import pytest
import torch

from entropylens import Recorder
from entropylens.integrations.torch import entropy_gradient_sq, policy_update
from entropylens.read.query import connect
from entropylens.rl import stats
from entropylens.rl.losses import policy_loss

KW = dict(method="ce_gppo", beta1=0.5, beta2=1.0, erc=(0.95, 1.05), scale=0.5)


def _batch(seed=0, b=4, t=6, v=30):
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(b, t, v, generator=g) * 2
    tok = torch.randint(1, v, (b, t), generator=g)
    z[:, :, 0] = float("-inf")  # a banned token
    z[0, 0, tok[0, 0]] += 12.0  # p_a near 1
    old_lp, old_h = stats.logprobs_and_entropy(z + 0.5 * torch.randn(b, t, v, generator=g), tok)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
    mask = torch.ones(b, t, dtype=torch.bool)
    mask[3, 4:] = False
    return z, tok, old_lp, old_h, adv, mask


def _tokens(path, cols):
    return connect(path).execute(f"SELECT {', '.join(cols)} FROM tokens ORDER BY seq, pos").fetchall()


def test_entropy_gradient_sq_hand_worked_and_autograd():
    # p = (0.75, 0.25): H = 0.562335, log p + H = (0.274653, -0.823959);
    # q = 0.75^2 * 0.274653^2 + 0.25^2 * 0.823959^2 = 0.0424322 + 0.0424322 = 0.0848644
    z = torch.log(torch.tensor([[0.75, 0.25, 0.0]]))  # log 0 = -inf: adds nothing
    assert entropy_gradient_sq(z).item() == pytest.approx(0.0848644, abs=2e-6)
    # q = T^2 ||dH/dz||^2, float64 autograd, chunked
    g = torch.Generator().manual_seed(1)
    zz = (torch.randn(5, 3, 17, generator=g, dtype=torch.float64) * 2).requires_grad_(True)
    la = torch.log_softmax(zz / 0.7, -1)
    (dh,) = torch.autograd.grad(-(la.exp() * la).sum(), zz)
    want = dh.square().sum(-1) * 0.7**2
    torch.testing.assert_close(
        entropy_gradient_sq(zz.detach().float(), temperature=0.7, chunk_size=2).double(), want, rtol=1e-5, atol=1e-9
    )


@pytest.mark.parametrize("temperature", [1.0, 0.8])
def test_policy_update_effect_includes_the_bonus_term_exactly(tmp_path, temperature):
    coef = 0.05
    z, tok, old_lp, old_h, adv, mask = _batch()
    logits = z.clone().requires_grad_(True)
    with Recorder(tmp_path, run="b", config={"method": "ce_gppo"}) as rec:
        out = policy_update(
            rec,
            0,
            0,
            logits,
            tok,
            mask,
            adv,
            old_lp,
            old_entropy=old_h,
            temperature=temperature,
            seq_ids=torch.arange(4),
            entropy_coef=coef,
            **KW,
        )
        out.loss.backward()
    got = torch.tensor([r[0] for r in _tokens(tmp_path, ["entropy_effect"])], dtype=torch.float64)
    # float64 autograd: the real loss's logit gradient G_t and the position's entropy gradient dH_t/dz_t;
    # the first-order entropy change per unit step along -G_t is -(dH_t/dz_t) . G_t
    z64 = z.double().requires_grad_(True)
    la = torch.log_softmax(z64 / temperature, -1)
    h64 = -(la.exp() * la.clamp(min=-1e4)).sum(-1)
    lp64 = la.gather(-1, tok.unsqueeze(-1)).squeeze(-1)
    loss64 = policy_loss(
        lp64, old_lp.double(), adv.double(), mask, entropy=h64, old_entropy=old_h.double(), entropy_coef=coef, **KW
    ).loss
    (gz,) = torch.autograd.grad(loss64, z64, retain_graph=True)
    (dh,) = torch.autograd.grad(h64.sum(), z64)
    want = -(dh * gz).sum(-1)[mask]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-9)
    # the bonus's own term is a real part of it (the policy term alone is off by more than the tolerance)
    s = stats.entropy_sensitivity(z, tok, temperature=temperature)
    policy_only = (out.columns["grad_coef"] * s / temperature**2)[mask].double()
    assert (want - policy_only).abs().max() > 100 * 1e-4 * want.abs().max()
    # the steps budget is the sum of the tokens', and entropy_effect_dropped is unchanged by the bonus
    con = connect(tmp_path)
    budget, dropped = con.execute("SELECT entropy_effect, entropy_effect_dropped FROM steps").fetchone()
    assert budget == pytest.approx(want.sum().item(), rel=1e-4, abs=1e-9)
    assert dropped is not None and math.isfinite(dropped)


def test_where_the_bonus_term_is_not_measured_effect_is_null(tmp_path):
    coef = 0.05
    z, tok, old_lp, old_h, adv, mask = _batch(seed=2)
    # 1. policy_update from hidden states + head: no logits, the bonus term is not measured
    g = torch.Generator().manual_seed(3)
    head = torch.nn.Linear(8, 30, bias=False)
    hidden = torch.randn(4, 6, 8, generator=g, requires_grad=True)
    with Recorder(tmp_path, run="head", config={"method": "ce_gppo"}) as rec:
        out = policy_update(
            rec,
            0,
            0,
            None,
            tok,
            mask,
            adv,
            old_lp,
            old_entropy=old_h,
            hidden=hidden,
            head=head,
            seq_ids=torch.arange(4),
            entropy_coef=coef,
            **KW,
        )
        out.loss.backward()
    # 2. by hand: policy_loss with the bonus, record_update with the sensitivity and without the term
    x = z.clone().requires_grad_(True)
    lp, h, s = stats.logprobs_and_entropy(x, tok, entropy_grad=True, sensitivity=True)
    out2 = policy_loss(lp, old_lp, adv, mask, entropy=h, old_entropy=old_h, entropy_coef=coef, **KW)
    with Recorder(tmp_path, run="hand", config={"method": "ce_gppo"}) as rec:
        rec.record_update(
            0,
            0,
            mask=mask,
            advantages=adv,
            logprobs=lp,
            old_logprobs=old_lp,
            entropy=h,
            old_entropy=old_h,
            seq_ids=torch.arange(4),
            loss=out2,
            entropy_sensitivity=s,
        )
    con = connect(tmp_path)
    for run in ("head", "hand"):
        n, eff, drop = con.execute(f"""SELECT count(*), count(entropy_effect), count(entropy_effect_dropped)
                                       FROM tokens WHERE run = '{run}'""").fetchone()
        assert n == mask.sum().item() and eff == 0 and drop > 0, run
        row = con.execute(f"""SELECT entropy_effect, entropy_effect_pa_hp, entropy_effect_low, entropy_effect_dropped,
                              entropy_effect_dropped_erc FROM steps WHERE run = '{run}'""").fetchone()
        assert row[:3] == (None, None, None) and row[3] is not None and row[4] is not None, run
    # the dropped effect is exact with the bonus: (g_u - g) s / T^2 on the changed tokens
    ch = out2.columns["grad_changed"] & mask
    want = ((out2.columns["grad_coef_unclipped"] - out2.columns["grad_coef"]) * s)[ch].double().sum().item()
    got = con.execute("SELECT entropy_effect_dropped FROM steps WHERE run = 'hand'").fetchone()[0]
    assert got == pytest.approx(want, rel=1e-5)


def test_a_given_bonus_column_is_added(tmp_path):
    """record_update by hand with the loss column entropy_effect_bonus: entropy_effect = g s / T^2 + it."""
    z, tok, old_lp, old_h, adv, mask = _batch(seed=4)
    x = z.clone().requires_grad_(True)
    lp, h, s = stats.logprobs_and_entropy(x, tok, entropy_grad=True, sensitivity=True)
    out = policy_loss(lp, old_lp, adv, mask, entropy=h, old_entropy=old_h, entropy_coef=0.01, **KW)
    bonus = torch.full(mask.shape, 0.125)
    out.columns["entropy_effect_bonus"] = bonus
    with Recorder(tmp_path, run="given") as rec:
        rec.record_update(
            0,
            0,
            mask=mask,
            advantages=adv,
            logprobs=lp,
            old_logprobs=old_lp,
            entropy=h,
            old_entropy=old_h,
            seq_ids=torch.arange(4),
            loss=out,
            entropy_sensitivity=s,
        )
    got = torch.tensor([r[0] for r in _tokens(tmp_path, ["entropy_effect"])])
    want = (out.columns["grad_coef"] * s + bonus)[mask]
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-8)
