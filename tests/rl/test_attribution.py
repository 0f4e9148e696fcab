"""First-order entropy attribution (stats.entropy_sensitivity, entropy_effect) against float64 autograd,
and -inf logits (vocabulary padding, banned tokens) in every reduction and the custom backward."""

import math

import pytest
import torch

from entropylens.rl import stats

# every test runs under both CPU row passes: the native C loop and the eager torch chunks
pytestmark = pytest.mark.usefixtures("row_pass")


def _logits_with_pa(v: int, p_a: float, temperature: float, a: int, seed: int) -> torch.Tensor:
    """float64 logits [V] whose tempered softmax gives the sampled token a probability p_a exactly:
    u_a = log(p_a / (1 - p_a)) + lse_{j != a}(u)."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(v, generator=g, dtype=torch.float64) * 2.0
    u = z / temperature
    rest = torch.cat([u[:a], u[a + 1 :]])
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
    torch.testing.assert_close(
        stats.sum_p_squared(z.float(), temperature=temperature).double(), ref_sq, rtol=1e-5, atol=0
    )
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
    # p_j = 0 there; the exp floor (stats module docstring) stands in exp(-87) = 1.6e-38 for it, so the
    # banned entries are -p_j (w + g_ent (log p_j + H)) with log p_j ~ -87 - log S: at most
    # 1.6e-38 * (2 + 2.5 * 100) ~ 4e-36 here, zero for every float32 purpose
    assert x.grad[:, banned].abs().max() < 1e-35


# ------------------------------------------------------------------ token columns and the budget
def _update(method="grpo", temperature=1.0, seed=0, **kw):
    """A real update: logits [B, T, V] -> policy_loss -> derive_columns -> the attribution columns."""
    from entropylens.record.device import blocks, token_columns
    from entropylens.rl.losses import policy_loss

    g = torch.Generator().manual_seed(seed)
    b, t, v = 6, 5, 11
    z = torch.randn(b, t, v, generator=g, dtype=torch.float64) * 2
    tok = torch.randint(0, v, (b, t), generator=g)
    old = (z + torch.randn(b, t, v, generator=g, dtype=torch.float64) * 0.6).float()  # an older policy
    old_lp, old_h = stats.logprobs_and_entropy(old, tok, temperature=temperature)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.7, 0.0, 1.3])
    mask = torch.ones(b, t, dtype=torch.bool)
    mask[2, 3:] = False
    x = z.float().clone().requires_grad_(True)
    lp, h, s = stats.logprobs_and_entropy(x, tok, temperature=temperature, sensitivity=True)
    out = policy_loss(lp, old_lp, adv, mask, method=method, entropy=h, old_entropy=old_h, **kw)
    cols = token_columns.derive_columns(
        mask=mask,
        advantages=adv,
        logprobs=lp,
        old_logprobs=old_lp,
        entropy=h,
        old_entropy=old_h,
        loss_columns=out.columns,
        eps_low=0.2,
        eps_high=0.2,
        tau=0.5,
    )
    blocks.add_attribution(cols, s, temperature)
    return z.float().double(), tok, mask, out, cols, x


def _dh_along(z64, tok, grad_z, temperature):
    """Per position: d/d eta H(softmax((z - eta G)/T)) at eta = 0 = -(dH/dz) . G, float64 autograd."""
    zz = z64.clone().requires_grad_(True)
    la = torch.log_softmax(zz / temperature, -1)
    h = -(la.exp() * la).sum(-1)  # [B, T]
    (dh_dz,) = torch.autograd.grad(h.sum(), zz)  # rows are independent
    return -(dh_dz * grad_z).sum(-1)


@pytest.mark.parametrize("temperature", [0.7, 1.0, 1.3])
@pytest.mark.parametrize(
    "method,kw",
    [
        ("grpo", {}),
        ("ce_gppo", {"beta1": 0.5, "beta2": 1.0}),
        ("dapo", {"erc": (0.95, 1.05)}),
        ("grpo", {"dual_clip": 3.0}),
    ],
)
def test_entropy_effect_columns_against_autograd_of_the_loss(method, kw, temperature):
    z64, tok, mask, out, cols, x = _update(method, temperature, **kw)
    # the real loss's gradient on the logits, per position (a token's loss reaches only its own row)
    (gz,) = torch.autograd.grad(out.loss, x)
    ref = _dh_along(z64, tok, gz.double(), temperature)  # dH_t per unit step along -dLoss/dz_t
    torch.testing.assert_close(cols["entropy_effect"].double()[mask], ref[mask], rtol=2e-4, atol=1e-9)
    # the unclipped surrogate -A r (same weights): its logit gradient minus the real one
    w = out.columns["grad_coef_unclipped"].double()  # = dLoss_unclipped / dlogp (weights included)
    p = torch.softmax(z64 / temperature, -1)
    onehot = torch.nn.functional.one_hot(tok, z64.shape[-1]).double()
    g_unclipped_z = w.unsqueeze(-1) * (onehot - p) / temperature  # dlogp/dz = (e_a - p)/T
    ref_drop = _dh_along(z64, tok, g_unclipped_z - gz.double(), temperature)
    changed = out.columns["grad_changed"] & mask
    assert changed.any(), "the fixture must change some gradients"
    got = cols["entropy_effect_dropped"]
    torch.testing.assert_close(got.double()[changed], ref_drop[changed], rtol=2e-4, atol=1e-9)
    assert torch.isnan(got[~changed]).all()


def test_entropy_budget_sums():
    from entropylens.rl import aggregates
    from entropylens.schema import CLIP_HIGH, CLIP_LOW, QUADRANT_CODES, QUADRANTS

    _, _, mask, out, cols, _ = _update("grpo", 1.0, seed=3, erc=(0.95, 1.05))
    budget = dict(zip(aggregates.BUDGET_NAMES, aggregates.entropy_budget(cols, mask).tolist()))
    eff, drop = cols["entropy_effect"].double(), cols["entropy_effect_dropped"].double()
    drop0 = torch.nan_to_num(drop, nan=0.0)
    q, clip = cols["quadrant"], cols["clip"]
    assert budget["entropy_effect"] == pytest.approx(eff[mask].sum().item(), rel=1e-9, abs=1e-15)
    assert budget["entropy_effect_dropped"] == pytest.approx(drop0[mask].sum().item(), rel=1e-9, abs=1e-15)
    for name in QUADRANTS:
        sel = mask & (q == QUADRANT_CODES[name])
        slug = name.replace("&", "_").lower()
        assert budget[f"entropy_effect_{slug}"] == pytest.approx(eff[sel].sum().item(), rel=1e-9, abs=1e-15)
        assert budget[f"entropy_effect_dropped_{slug}"] == pytest.approx(drop0[sel].sum().item(), rel=1e-9, abs=1e-15)
    for side, code in (("low", CLIP_LOW), ("high", CLIP_HIGH)):
        sel = mask & (clip == code)
        assert budget[f"entropy_effect_dropped_{side}"] == pytest.approx(drop0[sel].sum().item(), rel=1e-9, abs=1e-15)
    # by cause: ERC's own share (g_e - g) s / T^2 (the split itself: tests/rl/test_dropped_effect_split.py)
    z64, tok = _update("grpo", 1.0, seed=3, erc=(0.95, 1.05))[:2]
    s = stats.entropy_sensitivity(z64.float(), tok).double()  # T = 1
    by_erc = (out.columns["grad_coef_before_erc"].double() - cols["grad_coef"].double()) * s
    sel = mask & cols["grad_changed"]
    assert budget["entropy_effect_dropped_erc"] == pytest.approx(by_erc[sel].sum().item(), rel=1e-6, abs=1e-12)
    assert (~cols["erc_kept"] & mask).any() and budget["entropy_effect_dropped_erc"] != 0
    # a ZA token (advantage 0) has grad_coef 0: no effect, nothing dropped
    assert (cols["entropy_effect"][4] == 0).all()


def test_policy_update_records_the_attribution(tmp_path):
    """integrations.torch.policy_update computes s in its logits pass and the rows carry entropy_effect."""
    from entropylens import Recorder
    from entropylens.integrations.torch import policy_update
    from entropylens.read.query import connect

    g = torch.Generator().manual_seed(5)
    logits = (torch.randn(4, 3, 9, generator=g) * 2).requires_grad_(True)
    tok = torch.randint(0, 9, (4, 3), generator=g)
    old_lp, old_h = stats.logprobs_and_entropy(logits.detach() + 0.3 * torch.randn(4, 3, 9, generator=g), tok)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
    mask = torch.ones(4, 3, dtype=torch.bool)
    with Recorder(tmp_path, run="pu", config={"method": "grpo"}) as rec:
        out = policy_update(rec, 0, 0, logits, tok, mask, adv, old_lp, old_entropy=old_h, temperature=0.8)
        out.loss.backward()
    s = stats.entropy_sensitivity(logits.detach(), tok, temperature=0.8)
    want = (out.columns["grad_coef"] * s / 0.8**2).reshape(-1).sort().values
    got = connect(tmp_path).execute("SELECT entropy_effect FROM tokens ORDER BY entropy_effect").fetchnumpy()
    torch.testing.assert_close(torch.tensor(got["entropy_effect"]), want, rtol=1e-5, atol=1e-9)


def test_one_hot_distance_against_float64_including_p_near_one():
    """logprobs_and_entropy(..., one_hot_distance=True): d = ||e_a - p||_2 from the sensitivity's split
    sums, float64 reference; p_a up to 1 - 1e-6 (where sqrt(1 - 2p + sum p^2) in float32 cancels to
    0 or noise), -inf logits, chunked, with and without grad."""
    v, a, t = 50, 7, 0.8
    rows = [_logits_with_pa(v, p_a, t, a, seed) for seed, p_a in enumerate([1e-6, 0.05, 0.5, 0.99, 0.9999, 1 - 1e-6])]
    z = torch.stack(rows)  # [6, V] float64
    z[:, 3] = float("-inf")  # a banned token
    p = torch.softmax(z / t, -1)
    e_a = torch.zeros_like(p)
    e_a[:, a] = 1.0
    want = (e_a - p).norm(dim=-1)  # float64
    tok = torch.full((6,), a)
    for grad in (False, True):
        zz = z.float().requires_grad_(grad)
        lp, h, s, d = stats.logprobs_and_entropy(
            zz, tok, temperature=t, sensitivity=True, one_hot_distance=True, chunk_size=4
        )
        torch.testing.assert_close(d.double(), want, rtol=2e-5, atol=0)
        lp2, h2, s2 = stats.logprobs_and_entropy(zz, tok, temperature=t, sensitivity=True, chunk_size=4)
        assert torch.equal(lp, lp2) and torch.equal(h, h2) and torch.equal(s, s2)  # the same pass, bit for bit
    # hand-worked: z = (0, log 3), a = 1 -> p = (1/4, 3/4), e_a - p = (-1/4, 1/4), d = sqrt(2)/4
    d = stats.logprobs_and_entropy(
        torch.tensor([[0.0, math.log(3.0)]]), torch.tensor([1]), sensitivity=True, one_hot_distance=True
    )[3]
    assert abs(d.item() - math.sqrt(2) / 4) < 1e-7
    with pytest.raises(ValueError, match="one_hot_distance"):
        stats.logprobs_and_entropy(z.float(), tok, one_hot_distance=True)


@pytest.mark.parametrize("entropy_coef", [0.0, 0.01])
def test_policy_update_logit_grad_norm_is_the_gradients_norm(tmp_path, entropy_coef):
    """policy_update's logits path: logit_grad_norm (the closed form |g|/T * d from the sensitivity pass,
    or with an entropy bonus the backward hook) equals ||dLoss/dz_t|| from plain autograd, at GA scale,
    a temperature, p_a near 1 and -inf logits."""
    from entropylens import Recorder
    from entropylens.integrations.torch import policy_update
    from entropylens.read.query import connect
    from entropylens.rl.losses import policy_loss

    g = torch.Generator().manual_seed(11)
    b, t_len, v, temp = 4, 5, 30, 0.9
    z = torch.randn(b, t_len, v, generator=g) * 2
    tok = torch.randint(1, v, (b, t_len), generator=g)
    z[0, 0, tok[0, 0]] += 25.0  # p_a ~ 1 - 1e-11: the naive 1 - 2p + sum p^2 cancels
    z[:, :, 0] = float("-inf")  # a banned token
    logits = z.clone().requires_grad_(True)
    old_lp, old_h = stats.logprobs_and_entropy(z + 0.2 * torch.randn(b, t_len, v, generator=g), tok)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
    mask = torch.ones(b, t_len, dtype=torch.bool)
    mask[3, 3:] = False
    with Recorder(tmp_path, run="pu", config={"method": "ce_gppo"}) as rec:
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
            temperature=temp,
            method="ce_gppo",
            beta1=0.5,
            beta2=1.0,
            scale=0.25,
            entropy_coef=entropy_coef,
            seq_ids=torch.arange(b),
        )
        assert rec.has_hook == bool(entropy_coef)  # the hook only where H's gradient reaches the logits
        out.loss.backward()
    got = torch.tensor(
        connect(tmp_path)
        .execute("SELECT logit_grad_norm FROM tokens ORDER BY seq, pos")
        .fetchnumpy()["logit_grad_norm"]
    )
    # float64 autograd of the same loss (float32 autograd itself cancels at p_a ~ 1: g (1 - p_a) from g - g p_a)
    z64 = z.double().requires_grad_(True)
    lp64 = torch.log_softmax(z64 / temp, -1)
    h64 = -(lp64.exp() * lp64.clamp(min=-1e4)).sum(-1)
    out64 = policy_loss(
        lp64.gather(-1, tok.unsqueeze(-1)).squeeze(-1),
        old_lp.double(),
        adv.double(),
        mask,
        entropy=h64 if entropy_coef else h64.detach(),
        old_entropy=old_h.double(),
        method="ce_gppo",
        beta1=0.5,
        beta2=1.0,
        scale=0.25,
        entropy_coef=entropy_coef,
    )
    out64.loss.backward()
    want = z64.grad.norm(dim=-1)[mask]  # [n] row-major = (seq, pos) order
    torch.testing.assert_close(got.double(), want, rtol=2e-5, atol=1e-12 if not entropy_coef else 1e-9)
    # and the float32 autograd gradient away from p_a ~ 1
    torch.testing.assert_close(got[1:], logits.grad.norm(dim=-1)[mask][1:], rtol=2e-5, atol=1e-9)


def test_claims_8_and_9_rules_on_hand_made_runs():
    from entropylens.demo.toy import claims

    def run(cfg, eff, drop, probe=None):
        m = {
            "config": cfg,
            "effect_q": dict(zip(("PA&HP", "PA&LP", "NA&HP", "NA&LP"), eff)),
            "dropped_q": dict(zip(("PA&HP", "PA&LP", "NA&HP", "NA&LP"), drop)),
        }
        if probe:
            m["probe_q"] = dict(zip(("PA&HP", "PA&LP", "NA&HP", "NA&LP"), probe))
        return m

    # every run has the law's signs (-, +, +, -): claim 8 reproduced; PA&LP's effect negative in every
    # run of the second set: that quadrant disagrees -> partly
    good = {
        f"r{i}": run(
            "grpo",
            (-1 - 0.1 * i, 1 + 0.1 * i, 0.5 + 0.1 * i, -2 - 0.1 * i),
            (0.01, 0.3 + 0.1 * i, 0.02, -0.5 - 0.1 * i),
        )
        for i in range(3)
    }
    assert claims.claim_quadrant_signs_attributed(good).verdict == "reproduced"
    bad = {k: {**v, "effect_q": {**v["effect_q"], "PA&LP": -1.0 - i}} for i, (k, v) in enumerate(good.items())}
    assert claims.claim_quadrant_signs_attributed(bad).verdict == "partly reproduced"
    # with probes, a quadrant must agree in both measures
    probed = {
        k: {**v, "probe_q": {"PA&HP": -0.1, "PA&LP": 0.1, "NA&HP": -0.1 - i, "NA&LP": -0.1}}
        for i, (k, v) in enumerate(good.items())
    }
    c8 = claims.claim_quadrant_signs_attributed(probed)
    assert c8.verdict == "partly reproduced" and "NA&HP (law +)" in c8.evidence
    # claim 9: (|0.3..0.5| + |0.5..0.7|) / total > 0.5, PA&LP > 0, NA&LP < 0 in every run: reproduced
    assert claims.claim_clip_drop(good).verdict == "reproduced"
    flipped = {k: {**v, "dropped_q": {**v["dropped_q"], "NA&LP": 0.5}} for k, v in good.items()}
    assert claims.claim_clip_drop(flipped).verdict == "partly reproduced"
    ce_only = {k: {**v, "config": "ce_gppo"} for k, v in good.items()}  # not PPO-clip: no runs count
    assert claims.claim_clip_drop(ce_only).verdict.startswith("inconclusive")


@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_head_stats_sensitivity_equals_the_logits_pass(temperature):
    g = torch.Generator().manual_seed(9)
    hidden = torch.randn(3, 5, 16, generator=g)
    weight = torch.randn(40, 16, generator=g)
    bias = torch.randn(40, generator=g)
    bias[[0, 7]] = float("-inf")  # banned tokens through the bias
    tok = torch.randint(1, 7, (3, 5), generator=g)
    tok[0, 0] = 39
    lp, h, sq, s = stats.head_stats(
        hidden, weight, tok, bias=bias, temperature=temperature, chunk_size=4, sensitivity=True
    )
    logits = hidden @ weight.T + bias
    ref = stats.entropy_sensitivity(logits, tok, temperature=temperature)
    assert torch.isfinite(s).all()
    torch.testing.assert_close(s, ref, rtol=1e-4, atol=1e-6)
    lp3, h3, sq3 = stats.head_stats(hidden, weight, tok, bias=bias, temperature=temperature)  # unchanged API
    torch.testing.assert_close(lp3, lp)


def test_policy_update_from_hidden_states_records_the_attribution(tmp_path):
    from entropylens import Recorder
    from entropylens.integrations.torch import policy_update
    from entropylens.read.query import connect

    g = torch.Generator().manual_seed(6)
    head = torch.nn.Linear(8, 13, bias=False)
    hidden = torch.randn(2, 4, 8, generator=g, requires_grad=True)
    tok = torch.randint(0, 13, (2, 4), generator=g)
    with torch.no_grad():
        old_lp, old_h = stats.logprobs_and_entropy(head(hidden) + 0.2, tok)
    with Recorder(tmp_path, run="h", config={"method": "grpo"}) as rec:
        out = policy_update(
            rec,
            0,
            0,
            None,
            tok,
            torch.ones(2, 4, dtype=torch.bool),
            torch.tensor([1.0, -1.0]),
            old_lp,
            old_entropy=old_h,
            hidden=hidden,
            head=head,
        )
        out.loss.backward()
    s = stats.entropy_sensitivity(head(hidden).detach(), tok)
    want = (out.columns["grad_coef"] * s).reshape(-1).sort().values
    got = connect(tmp_path).execute("SELECT entropy_effect FROM tokens ORDER BY entropy_effect").fetchnumpy()
    torch.testing.assert_close(torch.tensor(got["entropy_effect"]), want, rtol=1e-4, atol=1e-8)


# ------------------------------------------------------------------ far tails: the exp floor
class _ExpArgs(torch.overrides.TorchFunctionMode):
    """Records the smallest argument of every exp over a [*, V] tensor (the vocabulary-wide ones)."""

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab, self.mins = vocab, []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if (
            func in (torch.exp, torch.Tensor.exp, torch.Tensor.exp_)
            and args[0].dim() >= 2
            and args[0].shape[-1] == self.vocab
        ):
            self.mins.append(float(args[0].min()))
        return func(*args, **(kwargs or {}))


def _far_tail_logits(temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 logits [4, 60] whose tempered shifted values reach far below -87 (finite: -100 .. -1e4,
    and -inf); row 0 samples a token at z = -150 (log p ~ -150 / T, exact), row 1 a -inf-free normal one."""
    g = torch.Generator().manual_seed(5)
    z = torch.randn(4, 60, generator=g, dtype=torch.float64) * 2
    z[:, 40:45] = torch.tensor([-100.0, -300.0, -1e4, -95.0, -88.0], dtype=torch.float64)
    z[1:, 50:53] = float("-inf")
    z[3, :30] = -200.0  # a row whose tail is half the vocabulary
    z[0, 41] = -150.0
    tok = torch.tensor([41, 3, 7, 55])
    return z, tok


@pytest.mark.parametrize("temperature", [0.6, 1.0])
def test_far_tail_logits_against_float64(temperature, row_pass):
    """Logits far below the max (a wide distribution at a low temperature, -inf padding): every
    vocabulary-wide exp takes a floored argument (torch's CPU exp is 5-25x slower below -87.3), and the
    values still equal float64 autograd's: log p of a token in the tail exactly, H, s, d_t, sum p^2, and
    the gradient (its floored entries are below 1e-35 where the true one is ~0)."""
    z, tok = _far_tail_logits(temperature)
    keep = ~torch.isinf(z)
    zf = z.float()
    x = zf.clone().requires_grad_(True)
    with _ExpArgs(z.shape[-1]) as spy:
        lp, h, s, d = stats.logprobs_and_entropy(
            x, tok, temperature=temperature, entropy_grad=True, sensitivity=True, one_hot_distance=True, chunk_size=3
        )
        (lp * torch.tensor([0.5, -1.0, 2.0, 0.25])).sum().add(h.sum() * 0.7).backward()
    if row_pass == "eager":
        assert spy.mins and min(spy.mins) >= -87.0  # forward, sensitivity and backward
    else:  # the forward's exps run in the C loop (floored there: the values below test it); no torch exp
        assert spy.mins == [] or min(spy.mins) >= -87.0
    # float64 reference on the float32 logits
    zd = zf.double().requires_grad_(True)
    la = torch.log_softmax(zd / temperature, -1)
    p = la.exp()
    ref_lp = la.gather(1, tok.unsqueeze(1)).squeeze(1)
    ref_h = -(p * torch.where(p > 0, la, torch.zeros_like(la))).sum(-1)
    (ref_lp * torch.tensor([0.5, -1.0, 2.0, 0.25], dtype=torch.float64)).sum().add(ref_h.sum() * 0.7).backward()
    assert lp[0].item() == pytest.approx(ref_lp[0].item(), rel=1e-6)  # log p ~ -150 / T: the tail token
    torch.testing.assert_close(lp.double(), ref_lp.detach(), rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(h.double(), ref_h.detach(), rtol=0, atol=1e-5)
    for i in range(4):
        ref_s = (
            _autograd_dh_deta(zf[i].double().nan_to_num(neginf=-1e30), int(tok[i]), 1.0, temperature) * temperature**2
        )  # -1e30: p = 0, log p finite
        assert s[i].item() == pytest.approx(ref_s, rel=1e-4, abs=1e-8)
    e_a = torch.nn.functional.one_hot(tok, z.shape[-1]).double()
    ref_d = (e_a - p.detach()).norm(dim=-1)
    torch.testing.assert_close(d.double(), ref_d, rtol=1e-5, atol=0)
    torch.testing.assert_close(x.grad[keep].double(), zd.grad[keep], rtol=1e-5, atol=1e-7)
    assert x.grad[~keep].abs().max() < 1e-35
    torch.testing.assert_close(
        stats.sum_p_squared(zf, temperature=temperature).double(), (p.detach() ** 2).sum(-1), rtol=1e-5, atol=0
    )


@pytest.mark.parametrize("temperature", [0.6, 1.0])
def test_far_tail_head_stats_against_float64(temperature):
    """head_stats on the same tails through the bias (a -inf bias bans a token; a sampled banned token
    gives log p = -inf and a finite s, which would be NaN without the floor), floored exps, float64 values."""
    z, tok = _far_tail_logits(temperature)
    g = torch.Generator().manual_seed(6)
    hidden = torch.randn(4, 8, generator=g)
    weight = torch.randn(60, 8, generator=g) * 0.1
    bias = z[2].float()  # the far tail and three -inf entries, as the head's bias
    tok = torch.tensor([41, 3, 51, 55])  # row 2 samples a banned token
    hh = hidden.clone().requires_grad_(True)
    with _ExpArgs(60) as spy:
        lp, h, sq, s = stats.head_stats(hh, weight, tok, bias=bias, temperature=temperature, sensitivity=True)
        (lp[[0, 1, 3]].sum() + h.sum()).backward()
    assert spy.mins and min(spy.mins) >= -87.0
    logits = (hidden @ weight.T + bias).double()
    hd = hidden.double().requires_grad_(True)
    la = torch.log_softmax((hd @ weight.double().T + bias.double()) / temperature, -1)
    p = la.exp()
    ref_lp = la.gather(1, tok.unsqueeze(1)).squeeze(1)
    ref_h = -(p * torch.where(p > 0, la, torch.zeros_like(la))).sum(-1)
    (ref_lp[[0, 1, 3]].sum() + ref_h.sum()).backward()
    assert lp[2].item() == float("-inf")
    torch.testing.assert_close(lp[[0, 1, 3]].double(), ref_lp[[0, 1, 3]].detach(), rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(h.double(), ref_h.detach(), rtol=0, atol=1e-5)
    torch.testing.assert_close(sq.double(), (p.detach() ** 2).sum(-1), rtol=1e-5, atol=0)
    assert torch.isfinite(s).all()
    for i in range(4):
        ref_s = (
            _autograd_dh_deta(logits[i].float().double().nan_to_num(neginf=-1e30), int(tok[i]), 1.0, temperature)
            * temperature**2
        )
        assert s[i].item() == pytest.approx(ref_s, rel=1e-4, abs=1e-8)
    torch.testing.assert_close(hh.grad.double(), hd.grad, rtol=1e-5, atol=1e-7)


# ------------------------------------------------------------------ large logit offsets: lse's rounding
def _offset_reference(z: torch.Tensor, tok, temperature, w_lp, w_h):
    """float64 autograd of sum(w_lp log p_a + w_h H) on the float32 logits z [N, V]: (grad [N, V], the loss)."""
    zd = z.double().requires_grad_(True)
    la = torch.log_softmax(zd / temperature, -1)
    loss = (la.gather(1, tok[:, None]).squeeze(1) * w_lp.double() + (-(la.exp() * la).sum(-1)) * w_h.double()).sum()
    loss.backward()
    return zd.grad


@pytest.mark.parametrize("offset,temperature", [(0.0, 0.5), (30.0, 0.5), (100.0, 0.5), (1e4, 1.0), (1e4, 0.5)])
def test_backward_at_large_logit_offsets_against_float64(offset, temperature):
    """A constant added to every logit changes nothing mathematically. In the backward's log p = z/T - lse,
    lse = m + log S rounded to float32 is off by half an ulp (~1e-3 nats at |lse| ~ 2e4), an error that
    grows with the offset (4e-3 at 1e4, T = 0.5; torch's log_softmax: 2e-7); the residual is folded
    into the row coefficients (stats._lse_fix), so the gradient is float32-level at every offset. T = 0.5 and 1
    divide exactly, so the reference sees the same tempered logits."""
    g = torch.Generator().manual_seed(12)
    z = (torch.randn(6, 50, generator=g, dtype=torch.float64) * 2 + offset).float()
    tok = torch.randint(0, 50, (6,), generator=g)
    w_lp, w_h = torch.randn(6, generator=g), torch.randn(6, generator=g)
    ref = _offset_reference(z, tok, temperature, w_lp, w_h)
    x = z.clone().requires_grad_(True)
    lp, h = stats.logprobs_and_entropy(x, tok, temperature=temperature, entropy_grad=True, chunk_size=4)
    (lp * w_lp + h * w_h).sum().backward()
    assert (x.grad.double() - ref).abs().max() < 2e-6  # 1.3e-6 at offset 0; before: 1.2e-5 .. 4.1e-3
    # the same through head_stats, with logits exact in float32 (small integers plus the offset in the bias)
    hid = torch.randint(-3, 4, (6, 8), generator=g).float()
    weight = torch.randint(-2, 3, (50, 8), generator=g).float() / 4
    bias = torch.full((50,), offset) + torch.randint(-8, 9, (50,), generator=g).float() / 8
    logits = hid @ weight.T + bias
    assert torch.equal(logits.double(), hid.double() @ weight.double().T + bias.double())  # exact
    hh = hid.clone().requires_grad_(True)
    lp2, h2, _ = stats.head_stats(hh, weight, tok, bias=bias, temperature=temperature)
    (lp2 * w_lp + h2 * w_h).sum().backward()
    ref_z = _offset_reference(logits, tok, temperature, w_lp, w_h)
    torch.testing.assert_close(hh.grad.double(), ref_z @ weight.double(), rtol=0, atol=2e-6)  # before: up to 1.6e-3
