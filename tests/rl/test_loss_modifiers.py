"""policy_loss's TRL 1.16 modifiers: weights, token / sequence masks, IS weight, delta, sequence-level
ratio, bias-corrected KL, entropy weights, the new aggregations and float64 maths.

1. against a float64 transcription of TRL 1.16's ``GRPOTrainer._compute_loss`` (every combination);
2. region by region on hand-built tensors, the expected gradient worked out in comments;
3. float64 inputs classify band edges as float64 does;
4. the dropped gradient splits by cause (clip low / clip high / dual-clip + delta / ERC) and adds up.
"""

import itertools
import math

import pytest
import torch

from entropylens.rl.losses import policy_loss

F64 = torch.float64
TIGHT = dict(rtol=1e-12, atol=1e-15)


def grad(loss, x):
    return torch.autograd.grad(loss, x, retain_graph=True)[0]


# --- 1. TRL 1.16 ---------------------------------------------------------------------------------


def trl_compute_loss(
    per_token_logps,
    old_per_token_logps,
    advantages,
    mask,
    *,
    loss_type,
    epsilon_low,
    epsilon_high,
    beta=0.0,
    ref_per_token_logps=None,
    use_bias_correction_kl=False,
    entropy_mask=None,
    off_policy_mask=None,
    importance_sampling_ratio=None,
    delta=None,
    importance_sampling_level="token",
    ga=1,
    num_items_in_batch=None,
    num_processes=1,
    steps_per_generation=1,
    max_completion_length=None,
    entropies=None,
    entropy_coef=0.0,
):
    """TRL 1.16.x trl/trainer/grpo_trainer.py ``_compute_loss`` (training mode), its arithmetic only,
    transcribed line by line for the loss types grpo, bnpo, dr_grpo, dapo, luspo."""
    # l. 3058-3059: [B] advantages -> [B, 1]
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)
    # l. 3081-3091: the importance weights, token or sequence level
    log_ratio = per_token_logps - old_per_token_logps
    if importance_sampling_level == "token":
        log_importance_weights = log_ratio
    else:
        log_importance_weights = (log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
        log_importance_weights = log_importance_weights.unsqueeze(-1)
    coef_1 = torch.exp(log_importance_weights)  # l. 3093
    # l. 3096-3104: k3 KL, times coef_1 (with its gradient) under use_bias_correction_kl
    if beta != 0.0:
        per_token_kl = torch.exp(ref_per_token_logps - per_token_logps) - (ref_per_token_logps - per_token_logps) - 1
        if use_bias_correction_kl:
            per_token_kl = per_token_kl * coef_1
    # l. 3111-3121: two-sided clipping (grpo, bnpo, dr_grpo, dapo, luspo), delta clamps coef_1 after coef_2
    coef_2 = torch.clamp(coef_1, 1 - epsilon_low, 1 + epsilon_high)
    if delta is not None:
        coef_1 = torch.clamp(coef_1, max=delta)
    per_token_loss1 = coef_1 * advantages
    per_token_loss2 = coef_2 * advantages
    per_token_loss = -torch.min(per_token_loss1, per_token_loss2)
    # l. 3141-3151: off-policy mask, entropy mask, vLLM IS ratio, then + beta KL
    if off_policy_mask is not None:
        per_token_loss = per_token_loss * off_policy_mask
    if entropy_mask is not None:
        per_token_loss = per_token_loss * entropy_mask
    if importance_sampling_ratio is not None:
        per_token_loss = per_token_loss * importance_sampling_ratio
    if beta != 0.0:
        per_token_loss = per_token_loss + beta * per_token_kl
    # l. 3154-3185: the normalisation of each loss type (mode "train")
    if loss_type == "grpo":
        loss = ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean() / ga
    elif loss_type == "bnpo":
        loss = (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0) / ga
    elif loss_type == "dr_grpo":
        loss = (per_token_loss * mask).sum() / (per_token_loss.size(0) * max_completion_length) / ga
    elif loss_type == "dapo":
        normalizer = num_items_in_batch.clamp(min=1.0) / num_processes
        normalizer = normalizer * ga / steps_per_generation
        loss = (per_token_loss * mask).sum() / normalizer
    elif loss_type == "luspo":
        loss = (per_token_loss * mask).sum(-1).mean() / ga
    else:
        raise ValueError(loss_type)
    # l. 3190-3207: entropy bonus, a mean over mask * entropy_mask, / GA
    if entropy_coef:
        effective_mask = mask if entropy_mask is None else mask * entropy_mask
        entropy_loss = (entropies * effective_mask).sum() / effective_mask.sum().clamp(min=1.0) / ga
        loss = loss - entropy_coef * entropy_loss
    return loss


# rows (log-ratio offset, advantage): chosen so that, at sequence level too, every region occurs
#   0: s ~ 0.67, A < 0: clipped low        1: s ~ 0.67, A > 0: low side kept
#   2: s ~ 1,    inside                    3: s ~ 1.42, A > 0: clipped high
#   4: s ~ 1.82, A < 0: beyond delta 1.5   5: s ~ 1.28, A < 0: between 1 + eps_high and delta 1.5
#   6: s ~ 1.16, A > 0: above delta 1.1    7: no token at all
ROWS = [(-0.4, -1.0), (-0.4, 1.0), (0.0, 0.7), (0.35, 1.0), (0.6, -1.0), (0.25, -0.5), (0.15, 1.0), (0.0, 1.3)]
GA, TMAX, N_ITEMS, PROCS, SPG = 2, 6, 80.0, 2, 4


def trl_batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    b, t = len(ROWS), TMAX
    off = torch.tensor([o for o, _ in ROWS], dtype=F64).unsqueeze(1)
    old = -torch.rand(b, t, generator=g, dtype=F64) * 3 - 0.05
    lp = (old + off + 0.3 * torch.randn(b, t, generator=g, dtype=F64)).requires_grad_(True)
    adv = torch.tensor([a for _, a in ROWS], dtype=F64)
    mask = torch.ones(b, t, dtype=F64)
    mask[2, 4:] = 0
    mask[5, 3:] = 0
    mask[7] = 0
    ref = old + 0.2 * torch.randn(b, t, generator=g, dtype=F64)
    ent_mask = (torch.rand(b, t, generator=g) > 0.3) & mask.bool()
    opm = torch.tensor([[1.0], [0.0], [1.0], [1.0], [0.0], [1.0], [1.0], [1.0]], dtype=F64)  # [B, 1]
    is_tok = 0.5 + torch.rand(b, t, generator=g, dtype=F64)  # [B, T]
    is_seq = 0.5 + torch.rand(b, 1, generator=g, dtype=F64)  # [B, 1] (TRL's sequence_* IS modes)
    h = (torch.rand(b, t, generator=g, dtype=F64) * 2).requires_grad_(True)
    return lp, old, adv, mask, ref, ent_mask, opm, is_tok, is_seq, h


def trl_weights(loss_type, mask):
    """TRL's normaliser as aggregation weights (GA left to ``scale``) and the scale."""
    b = mask.shape[0]
    lengths = mask.sum(-1, keepdim=True).clamp(min=1.0)
    if loss_type == "grpo":
        return mask / (lengths * b), 1 / GA
    if loss_type == "bnpo":
        return mask / mask.sum().clamp(min=1.0), 1 / GA
    if loss_type == "dr_grpo":
        return mask / (b * TMAX), 1 / GA
    if loss_type == "luspo":
        return mask / b, 1 / GA
    return mask / (N_ITEMS / PROCS), SPG / GA  # dapo


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo", "luspo"])
def test_matches_trl_compute_loss(loss_type, level):
    lp, old, adv, mask, ref, ent_mask, opm, is_tok, is_seq, h = trl_batch()
    eps_low, eps_high = (0.2, 0.28) if loss_type == "dapo" else (0.2, 0.2)
    method = "dapo" if loss_type == "dapo" else "grpo"
    w, scale = trl_weights(loss_type, mask)
    n = 0
    for (beta, bias), tm, om, iw, delta in itertools.product(
        [(0.0, False), (0.04, False), (0.04, True)],
        [False, True],
        [False, True],
        [None, "token", "seq"],
        [None, 1.5, 1.1],
    ):
        is_w = {None: None, "token": is_tok, "seq": is_seq}[iw]
        ent_coef = 0.01 if om else 0.0  # the bonus in half the cases (TRL's mean over mask * entropy_mask)
        ref_loss = trl_compute_loss(
            lp,
            old,
            adv,
            mask,
            loss_type=loss_type,
            epsilon_low=eps_low,
            epsilon_high=eps_high,
            beta=beta,
            ref_per_token_logps=ref,
            use_bias_correction_kl=bias,
            entropy_mask=ent_mask if tm else None,
            off_policy_mask=opm if om else None,
            importance_sampling_ratio=is_w,
            delta=delta,
            importance_sampling_level=level,
            ga=GA,
            num_items_in_batch=torch.tensor(N_ITEMS, dtype=F64),
            num_processes=PROCS,
            steps_per_generation=SPG,
            max_completion_length=TMAX,
            entropies=h,
            entropy_coef=ent_coef,
        )
        eff = mask * ent_mask if tm else mask
        out = policy_loss(
            lp,
            old,
            adv,
            mask,
            method=method,
            eps_low=eps_low,
            eps_high=eps_high,
            weights=w,
            scale=scale,
            ref_logprobs=ref if beta else None,
            kl_coef=beta,
            kl_bias_correction=bias,
            token_mask=ent_mask if tm else None,
            seq_mask=opm if om else None,
            is_weight=is_w,
            delta=delta,
            ratio_level=level,
            entropy=h,
            entropy_coef=ent_coef,
            entropy_weights=eff / eff.sum().clamp(min=1.0) / GA,
        )
        case = (beta, bias, tm, om, iw, delta)
        torch.testing.assert_close(out.loss, ref_loss, **TIGHT, msg=lambda m: f"{case}: {m}")
        g_ref, g = grad(ref_loss, lp), grad(out.loss, lp)
        torch.testing.assert_close(g, g_ref, **TIGHT, msg=lambda m: f"{case}: {m}")
        torch.testing.assert_close(out.columns["grad_coef"], g, **TIGHT, msg=lambda m: f"{case}: {m}")
        if ent_coef:
            torch.testing.assert_close(grad(out.loss, h), grad(ref_loss, h), **TIGHT)
        assert out.columns["grad_coef"].dtype == F64
        n += 1
    assert n == 3 * 2 * 2 * 3 * 3


def test_trl_builtin_aggregations_and_token_advantages():
    # bnpo == token-mean, luspo == seq-mean-token-sum (B' = B without empty rows), with [B, T] advantages
    lp, old, adv, mask, ref, ent_mask, opm, is_tok, _, h = trl_batch(seed=1)
    mask[7, :2] = 1  # no empty row: B' = B
    adv_t = adv.unsqueeze(1) + 0.1 * torch.arange(TMAX, dtype=F64)  # per-token advantages
    for loss_type, agg in (("bnpo", "token-mean"), ("luspo", "seq-mean-token-sum")):
        for level in ("token", "sequence"):
            ref_loss = trl_compute_loss(
                lp,
                old,
                adv_t,
                mask,
                loss_type=loss_type,
                epsilon_low=0.2,
                epsilon_high=0.2,
                beta=0.04,
                ref_per_token_logps=ref,
                use_bias_correction_kl=True,
                entropy_mask=ent_mask,
                importance_sampling_ratio=is_tok,
                delta=1.5,
                importance_sampling_level=level,
                ga=GA,
            )
            out = policy_loss(
                lp,
                old,
                adv_t,
                mask,
                agg=agg,
                scale=1 / GA,
                ref_logprobs=ref,
                kl_coef=0.04,
                kl_bias_correction=True,
                token_mask=ent_mask,
                is_weight=is_tok,
                delta=1.5,
                ratio_level=level,
            )
            torch.testing.assert_close(out.loss, ref_loss, **TIGHT)
            g = grad(out.loss, lp)
            torch.testing.assert_close(g, grad(ref_loss, lp), **TIGHT)
            torch.testing.assert_close(out.columns["grad_coef"], g, **TIGHT)


# --- 2. region by region -------------------------------------------------------------------------
# Row 0 puts one token in each region (eps 0.2 / 0.2, delta 2, ERC band (0.95, 1.05)):
#   t0  r = 1.0   A = +1   inside                                g = -r A = -1
#   t1  r = 0.5   A = -1   clipped low                           grpo 0, gppo -(0.8)(-1) = 0.8
#   t2  r = 1.5   A = +1   clipped high                          grpo 0, gppo -(1.2)(1) = -1.2
#   t3  r = 3.0   A = -1   r > delta = 2 (not PPO-clipped)       0 (v = -A delta = 2)
#   t4  r = 1.0   A = +1   outside token_mask                    0 (v = 0)
#   t5  r = 1.0   A = +1   ERC-dropped (rho = 2)                 0 (v = -1 stays)
#   t6  r = 1.0   A = +1   is_weight 0.5                         0.5 * -1 = -0.5
#   t7  r = 1.5   A = -1   high side kept (1.2 < r < delta)      -r A = 1.5
#   t8  r = 1.25  A = +1   clipped at eps_high 0.2, inside at 0.28 (dapo: -1.25)
# Row 1: two tokens (r = 1, A = +1 / -1) of a sequence outside seq_mask: g = 0, v = 0.
# token-mean over the 11 masked-in tokens: w = 1/11; g above times 1/11.
R0 = [1.0, 0.5, 1.5, 3.0, 1.0, 1.0, 1.0, 1.5, 1.25]
A0 = [1.0, -1.0, 1.0, -1.0, 1.0, 1.0, 1.0, -1.0, 1.0]


def region_batch():
    t = len(R0)
    old = torch.log(
        torch.tensor(
            [[0.3, 0.6, 0.2, 0.1, 0.4, 0.5, 0.45, 0.3, 0.7], [0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5]], dtype=F64
        )
    )
    r = torch.tensor([R0, [1.0] * t], dtype=F64)
    lp = (old + torch.log(r)).requires_grad_(True)
    adv = torch.tensor([A0, [1.0, -1.0] + [0.0] * (t - 2)], dtype=F64)
    mask = torch.zeros(2, t, dtype=torch.bool)
    mask[0] = True
    mask[1, :2] = True
    h_old = torch.ones(2, t, dtype=F64)
    h = h_old.clone()
    h[0, 5] = 2.0
    token_mask = torch.ones(2, t, dtype=torch.bool)
    token_mask[0, 4] = False
    is_w = torch.ones(2, t, dtype=F64)
    is_w[0, 6] = 0.5
    kw = dict(
        entropy=h,
        old_entropy=h_old,
        erc=(0.95, 1.05),
        token_mask=token_mask,
        seq_mask=torch.tensor([True, False]),
        is_weight=is_w,
    )
    return lp, old, adv, mask, kw


@pytest.mark.parametrize(
    "method,extra,g_row0,v_row0",
    [
        ("grpo", {"delta": 2.0}, [-1, 0, 0, 0, 0, 0, -0.5, 1.5, 0], [-1, 0.8, -1.2, 2, 0, -1, -0.5, 1.5, -1.2]),
        ("dapo", {"delta": 2.0}, [-1, 0, 0, 0, 0, 0, -0.5, 1.5, -1.25], [-1, 0.8, -1.28, 2, 0, -1, -0.5, 1.5, -1.25]),
        # gppo / ce_gppo: v = g = -A k (k the bounded slope on clipped tokens); capped t3: v = -A delta, g = 0
        ("gppo", {"delta": 2.0}, [-1, 0.8, -1.2, 0, 0, 0, -0.5, 1.5, -1.2], [-1, 0.8, -1.2, 2, 0, -1, -0.5, 1.5, -1.2]),
        (
            "ce_gppo",
            {"delta": 2.0, "beta1": 0.5, "beta2": 1.0},
            [-1, 0.4, -1.2, 0, 0, 0, -0.5, 1.5, -1.2],
            [-1, 0.4, -1.2, 2, 0, -1, -0.5, 1.5, -1.2],
        ),
        # cispo (no delta): g = -clip(r, 0.8, 1.2) A: t3 1.2, t7 1.2; v = g logp
        ("cispo", {}, [-1, 0.8, -1.2, 1.2, 0, 0, -0.5, 1.2, -1.2], None),
    ],
)
def test_regions(method, extra, g_row0, v_row0):
    lp, old, adv, mask, kw = region_batch()
    out = policy_loss(
        lp, old, adv, mask, method=method, eps_low=0.2, eps_high=0.28 if method == "dapo" else 0.2, **kw, **extra
    )
    exp = torch.zeros(2, 9, dtype=F64)
    exp[0] = torch.tensor(g_row0, dtype=F64) / 11
    g = grad(out.loss, lp)
    torch.testing.assert_close(g, exp, rtol=1e-14, atol=1e-16)
    torch.testing.assert_close(out.columns["grad_coef"], g, rtol=1e-14, atol=1e-16)
    if v_row0 is not None:
        v = torch.zeros(2, 9, dtype=F64)
        v[0] = torch.tensor(v_row0, dtype=F64)
        torch.testing.assert_close(out.columns["token_loss"], v, rtol=1e-14, atol=1e-16)
        torch.testing.assert_close(out.loss, v.sum() / 11, rtol=1e-14, atol=1e-16)
    c = out.columns
    assert c["token_kept"][0].tolist() == [True] * 4 + [False] + [True] * 4
    assert c["seq_kept"].tolist() == [[True] * 9, [False] * 9]
    assert c["is_weight"][0, 6] == 0.5 and c["erc_kept"][0].tolist() == [True] * 5 + [False] + [True] * 3
    if method != "cispo":
        assert c["dual_clipped"][0].tolist() == [False] * 3 + [True] + [False] * 5
        assert out.config["delta"] == 2.0
    # grad_changed: the clipped t1, t2 (t8 outside dapo), the capped t3, the ERC-dropped t5; never the
    # token-masked t4 or the seq-masked row 1 (the policy term does not reach them: nothing to change)
    changed = {"cispo": [1, 2, 3, 5, 7, 8], "dapo": [1, 2, 3, 5]}.get(method, [1, 2, 3, 5, 8])
    assert c["grad_changed"][0].nonzero().flatten().tolist() == changed
    assert not c["grad_changed"][1].any()
    # the unclipped reference keeps the masks and the IS weight: -A r w P
    unc = torch.zeros(2, 9, dtype=F64)
    unc[0] = -adv[0] * torch.tensor(R0, dtype=F64) * torch.tensor([1, 1, 1, 1, 0, 1, 0.5, 1, 1], dtype=F64) / 11
    torch.testing.assert_close(c["grad_coef_unclipped"], unc, rtol=1e-14, atol=1e-16)


def test_delta_below_one_plus_eps_high_is_trls_clamp():
    # delta 1.1 < 1 + eps_high = 1.2 (TRL allows it; it recommends > 1 + eps). -min(min(r, 1.1) A, clip(r) A):
    #   r = 1.15, A = +1: min(1.1, 1.15) -> v = -1.1, g = 0 (capped although inside the band)
    #   r = 1.15, A = -1: A max(min(r, 1.1), 1.15) = -1.15 -> v = 1.15, g = -r A = 1.15 (unchanged)
    #   r = 1.5,  A = -1: A max(1.1, 1.2) -> v = 1.2, g = 0 (capped at max(delta, 1 + eps_high) = 1.2)
    #   r = 1.5,  A = +1: clipped high; v = -min(1.1, 1.2) = -1.1 (grpo: TRL's value), g = 0
    #   r = 1.05, A = +1: inside and below delta: g = -1.05
    r = torch.tensor([[1.15, 1.15, 1.5, 1.5, 1.05]], dtype=F64)
    adv = torch.tensor([[1.0, -1.0, -1.0, 1.0, 1.0]], dtype=F64)
    old = torch.full_like(r, -1.0)
    lp = (old + torch.log(r)).requires_grad_(True)
    mask = torch.ones_like(r, dtype=torch.bool)
    out = policy_loss(lp, old, adv, mask, method="grpo", delta=1.1)
    torch.testing.assert_close(grad(out.loss, lp), torch.tensor([[0, 1.15, 0, 0, -1.05]], dtype=F64) / 5)
    torch.testing.assert_close(out.columns["token_loss"], torch.tensor([[-1.1, 1.15, 1.2, -1.1, -1.05]], dtype=F64))
    assert out.columns["dual_clipped"].tolist() == [[True, False, True, False, False]]
    ref = trl_compute_loss(lp, old, adv, mask.double(), loss_type="bnpo", epsilon_low=0.2, epsilon_high=0.2, delta=1.1)
    torch.testing.assert_close(out.loss, ref, **TIGHT)
    # gppo keeps its clipped tokens as they are (value and bounded gradient) and caps the same free tokens
    gp = policy_loss(lp, old, adv, mask, method="gppo", delta=1.1)
    torch.testing.assert_close(grad(gp.loss, lp), torch.tensor([[0, 1.15, 0, -1.2, -1.05]], dtype=F64) / 5)
    # with dual_clip 1.3 too: A < 0 is capped at min(1.3, max(1.1, 1.2)) = 1.2
    both = policy_loss(lp, old, adv, mask, method="grpo", delta=1.1, dual_clip=1.3)
    torch.testing.assert_close(both.columns["token_loss"], out.columns["token_loss"])


def test_gspo_regions_and_sequence_level_grpo():
    # 8 sequences of 2 tokens, A per sequence; gspo (eps 3e-4 / 4e-4), seq-mean-token-mean: w = 1/(2*8) = 1/16
    #   row 0: log r [0, 0]      s = 1, A = +1, token 1 ERC-dropped      gspo g [-1, 0]
    #   row 1: log r [-.1, -.1]  s = e^-.1, A = -1: clipped low          [0, 0]
    #   row 2: log r [.1, .1]    s = e^.1,  A = +1: clipped high         [0, 0]
    #   row 3: log r [1, 1]      s = e > delta 2, A = -1: capped         [0, 0]   (v = -A delta = 2)
    #   row 4: log r [.2, .4]    s = e^.3 = 1.35, A = -1: kept           [s, s]
    #   row 5: log r [0, 0]      A = +1, token 1 outside token_mask      [-1, 0]
    #   row 6: log r [0, 0]      A = +1, outside seq_mask                [0, 0]
    #   row 7: log r [0, 0]      A = +1, is_weight [0.5, 2]              [-0.5, -2]
    lr = torch.tensor([[0, 0], [-0.1, -0.1], [0.1, 0.1], [1, 1], [0.2, 0.4], [0, 0], [0, 0], [0, 0]], dtype=F64)
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0, -1.0, 1.0, 1.0, 1.0], dtype=F64)
    old = torch.full_like(lr, math.log(0.4))
    lp = (old + lr).requires_grad_(True)
    mask = torch.ones_like(lr, dtype=torch.bool)
    h_old = torch.ones_like(lr)
    h = h_old.clone()
    h[0, 1] = 0.5  # rho 0.5: dropped
    tm = torch.ones_like(mask)
    tm[5, 1] = False
    sm = torch.ones(8, 1)
    sm[6] = 0.0
    iw = torch.ones_like(lr)
    iw[7] = torch.tensor([0.5, 2.0], dtype=F64)
    kw = dict(entropy=h, old_entropy=h_old, erc=(0.95, 1.05), token_mask=tm, seq_mask=sm, is_weight=iw, delta=2.0)
    s4 = math.exp(0.3)
    out = policy_loss(lp, old, adv, mask, method="gspo", **kw)
    exp = torch.tensor([[-1, 0], [0, 0], [0, 0], [0, 0], [s4, s4], [-1, 0], [0, 0], [-0.5, -2]], dtype=F64) / 16
    g = grad(out.loss, lp)
    torch.testing.assert_close(g, exp, rtol=1e-14, atol=1e-16)
    torch.testing.assert_close(out.columns["grad_coef"], g, rtol=1e-14, atol=1e-16)
    assert out.columns["dual_clipped"][:, 0].tolist() == [False, False, False, True, False, False, False, False]
    assert out.columns["token_loss"][3].tolist() == [2.0, 2.0]
    # TRL's form (grpo, ratio_level="sequence", the same eps and weights): the gradient runs through the
    # sequence mean, token t gets (m_t / L_i) sum_u w_u P_u K_u g_u: 1/2 of its sequence's sum
    #   row 0: (-1/16 + 0) / 2 = -1/32 on both tokens (the ERC-dropped one too)
    #   row 5: (-1/16 + 0) / 2 = -1/32 on both (the token-masked one too)
    #   row 7: (-0.5/16 - 2/16) / 2 = -1.25/16 on both;  row 4: (s/16 + s/16) / 2 = s/16 as gspo
    seq = policy_loss(
        lp,
        old,
        adv,
        mask,
        method="grpo",
        eps_low=3e-4,
        eps_high=4e-4,
        agg="seq-mean-token-mean",
        ratio_level="sequence",
        **kw,
    )
    exp_seq = (
        torch.tensor([[-0.5, -0.5], [0, 0], [0, 0], [0, 0], [s4, s4], [-0.5, -0.5], [0, 0], [-1.25, -1.25]], dtype=F64)
        / 16
    )
    g_seq = grad(seq.loss, lp)
    torch.testing.assert_close(g_seq, exp_seq, rtol=1e-14, atol=1e-16)
    torch.testing.assert_close(seq.columns["grad_coef"], g_seq, rtol=1e-14, atol=1e-16)
    torch.testing.assert_close(seq.loss, out.loss, rtol=1e-14, atol=1e-16)  # the same value
    # sequence level: a token is changed when its sequence's gradient is (row 0: ERC dropped a token)
    assert seq.columns["grad_changed"][:, 0].tolist() == [True, True, True, True, False, False, False, False]
    # where the per-token weights are uniform within each sequence (no token mask, ERC or IS), they agree
    plain = dict(delta=2.0, seq_mask=sm)
    a = policy_loss(lp, old, adv, mask, method="gspo", **plain)
    b = policy_loss(
        lp,
        old,
        adv,
        mask,
        method="grpo",
        eps_low=3e-4,
        eps_high=4e-4,
        agg="seq-mean-token-mean",
        ratio_level="sequence",
        **plain,
    )
    torch.testing.assert_close(b.loss, a.loss, **TIGHT)
    torch.testing.assert_close(grad(b.loss, lp), grad(a.loss, lp), **TIGHT)
    for name in ("grad_coef", "grad_coef_unclipped", "token_loss", "clip", "clipped", "dual_clipped", "grad_changed"):
        torch.testing.assert_close(b.columns[name], a.columns[name], **TIGHT)


def test_kl_bias_correction_by_hand():
    # one sequence, two tokens, A = 0 (only the KL term), token-mean w = 1/2, kl_coef 0.1, ref - logp = d
    #   plain k3:           g_t = w kl (1 - e^d_t)
    #   token level, x r_t:  g_t = w kl r_t (logp_t - ref_t)                 (= r (1 - e^d) + r k3)
    #   sequence level, x s: g_t = w kl s (1 - e^d_t) + (1/2) sum_u w kl s k3_u
    lr = torch.tensor([[0.2, -0.1]], dtype=F64)
    d = torch.tensor([[0.3, -0.2]], dtype=F64)
    old = torch.full_like(lr, -1.0)
    lp = (old + lr).requires_grad_(True)
    ref = lp.detach() + d
    mask = torch.ones_like(lr, dtype=torch.bool)
    adv = torch.zeros(1, dtype=F64)
    k3 = torch.exp(d) - d - 1
    for level, bias, exp in [
        ("token", False, 0.5 * 0.1 * (1 - torch.exp(d))),
        ("token", True, 0.5 * 0.1 * torch.exp(lr) * -d),
        ("sequence", True, 0.5 * 0.1 * math.exp(0.05) * (1 - torch.exp(d)) + 0.5 * 0.1 * math.exp(0.05) * k3.sum() / 2),
    ]:
        out = policy_loss(lp, old, adv, mask, ref_logprobs=ref, kl_coef=0.1, kl_bias_correction=bias, ratio_level=level)
        g = grad(out.loss, lp)
        torch.testing.assert_close(g, exp, rtol=1e-13, atol=1e-16)
        torch.testing.assert_close(out.columns["grad_coef"], g, rtol=1e-13, atol=1e-16)
        # the KL term is part of the objective: nothing changed, the unclipped reference equals grad_coef
        torch.testing.assert_close(out.columns["grad_coef_unclipped"], g, rtol=1e-13, atol=1e-16)
        assert not out.columns["grad_changed"].any() and out.config["kl_bias_correction"] is bias
    # the KL term is not masked by token_mask / seq_mask / is_weight
    base = policy_loss(lp, old, adv, mask, ref_logprobs=ref, kl_coef=0.1)
    masked = policy_loss(
        lp,
        old,
        adv,
        mask,
        ref_logprobs=ref,
        kl_coef=0.1,
        token_mask=torch.zeros_like(mask),
        seq_mask=torch.zeros(1),
        is_weight=torch.full_like(lr, 3.0),
    )
    torch.testing.assert_close(masked.loss, base.loss, **TIGHT)
    torch.testing.assert_close(masked.columns["grad_coef"], base.columns["grad_coef"], **TIGHT)


def test_new_aggregations_mirror_verl():
    # verl 0.9.1 core_algos.agg_loss: token-sum = sum(l m); seq-mean-token-sum-norm = sum_i(sum_t l m) / B' / lsf,
    # lsf = loss_scale_factor or mask.shape[-1]. Lengths 1 and 3 of T = 4 (+ one empty row): B' = 2.
    old = torch.log(torch.full((3, 4), 0.5, dtype=F64))
    lp = old.clone().requires_grad_(True)
    mask = torch.tensor([[1, 0, 0, 0], [1, 1, 1, 0], [0, 0, 0, 0]], dtype=torch.bool)
    adv = torch.tensor([-1.0, -1.0, 1.0], dtype=F64)  # r = 1: g = -A = 1 on rows 0, 1
    m = mask.double()
    for agg, lsf, w in [
        ("token-sum", None, m),
        ("seq-mean-token-sum-norm", None, m / 2 / 4),
        ("seq-mean-token-sum-norm", 10.0, m / 2 / 10),
    ]:
        out = policy_loss(lp, old, adv, mask, agg=agg, loss_scale_factor=lsf)
        torch.testing.assert_close(grad(out.loss, lp), w, **TIGHT)
        torch.testing.assert_close(out.columns["grad_coef"], w, **TIGHT)
        torch.testing.assert_close(out.loss, (w * m).sum(), **TIGHT)
        assert out.config["agg"] == agg
        if agg.endswith("norm"):
            assert out.config["loss_scale_factor"] == (lsf or 4.0)
    # explicit weights override agg (scale is applied on top)
    w = torch.rand(3, 4, dtype=F64)
    out = policy_loss(lp, old, adv, mask, agg="token-mean", weights=w, scale=0.5)
    torch.testing.assert_close(out.columns["grad_coef"], 0.5 * w * m, **TIGHT)
    assert out.config["agg"] == "weights"


def test_entropy_weights():
    lp, old, adv, mask, _ = region_batch()
    h = torch.full(mask.shape, 0.7, dtype=F64, requires_grad=True)
    ew = torch.rand(mask.shape, dtype=F64)
    out = policy_loss(lp, old, adv, mask, entropy=h, entropy_coef=0.01, entropy_weights=ew, scale=0.25)
    torch.testing.assert_close(grad(out.loss, h), -0.01 * ew * mask, **TIGHT)  # scale not applied on top
    base = policy_loss(lp, old, adv, mask, entropy=h, entropy_coef=0.01, scale=0.25)
    torch.testing.assert_close(grad(base.loss, h), -0.01 * 0.25 * mask.double() / 11, **TIGHT)  # default: scale * w


# --- 3. float64 kept ---------------------------------------------------------------------------------


def test_float64_band_edges():
    # ratios 1e-12 either side of each edge (eps 0.2: 0.8 and 1.2; delta 1.5); A chosen so the side is gated
    e = 1e-12
    r = torch.tensor([[0.8 - e, 0.8 + e, 1.2 + e, 1.2 - e, 1.5 + e, 1.5 - e]], dtype=F64)
    adv = torch.tensor([[-1.0, -1.0, 1.0, 1.0, -1.0, -1.0]], dtype=F64)
    old = torch.full_like(r, -0.5)
    lp = (old + torch.log(r)).requires_grad_(True)
    mask = torch.ones_like(r, dtype=torch.bool)
    # ERC band (0.95, 1.05) edges: rho 1e-12 outside / inside
    h_old = torch.ones_like(r)
    rho = torch.tensor([[1.05 + e, 1.05 - e, 0.95 - e, 0.95 + e, 1.0, 1.0]], dtype=F64)
    h = rho * (1 + 1e-8) - 1e-8  # rho = (H + 1e-8) / (H_old + 1e-8)
    out = policy_loss(lp, old, adv, mask, method="grpo", delta=1.5, entropy=h, old_entropy=h_old, erc=(0.95, 1.05))
    c = out.columns
    assert c["clip"].tolist() == [[-1, 0, 1, 0, 1, 1]]
    assert c["clipped"].tolist() == [[True, False, True, False, False, False]]
    assert c["dual_clipped"].tolist() == [[False, False, False, False, True, False]]
    assert c["erc_kept"].tolist() == [[False, True, False, True, True, True]]
    # g = -r A where not clipped / capped / ERC-dropped: t1, t3 (inside, ERC kept) and t5 (below delta)
    exp = torch.tensor([[0, 0.8 + e, 0, -1.2 + e, 0, 1.5 - e]], dtype=F64) / 6
    torch.testing.assert_close(grad(out.loss, lp), exp, rtol=1e-13, atol=0)
    assert all(c[k].dtype == F64 for k in ("ratio", "grad_coef", "grad_coef_unclipped", "token_loss", "entropy_ratio"))
    # float32 inputs keep today's float32 maths: 1e-12 is below float32 resolution, every edge is on it
    out32 = policy_loss(
        lp.detach().float(),
        old.float(),
        adv.float(),
        mask,
        method="grpo",
        delta=1.5,
        entropy=h.float(),
        old_entropy=h_old.float(),
        erc=(0.95, 1.05),
    )
    assert out32.columns["grad_coef"].dtype == torch.float32 and out32.loss.dtype == torch.float32
    assert out32.columns["clip"].tolist() != c["clip"].tolist()


# --- 4. the drop split ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "method,level",
    [
        ("grpo", "token"),
        ("dapo", "token"),
        ("gppo", "token"),
        ("ce_gppo", "token"),
        ("cispo", "token"),
        ("gspo", "token"),
        ("grpo", "sequence"),
        ("ce_gppo", "sequence"),
    ],
)
def test_drop_split_adds_up(method, level):
    g = torch.Generator().manual_seed(5)
    b, t = 6, 7
    old = -torch.rand(b, t, generator=g, dtype=F64) * 3 - 0.05
    lr = (
        0.35 * torch.randn(b, t, generator=g, dtype=F64)
        + torch.tensor([-0.4, -0.3, 0, 0.45, 0.5, 0.7], dtype=F64)[:, None]
    )
    lp = (old + lr).requires_grad_(True)
    adv = torch.tensor([-1.0, 1.0, 0.5, 1.0, -1.0, -0.7], dtype=F64)  # one per sequence
    mask = torch.rand(b, t, generator=g) > 0.15
    h_old = torch.rand(b, t, generator=g, dtype=F64) + 0.5
    h = h_old * (1 + 0.08 * torch.randn(b, t, generator=g, dtype=F64))
    eps = (3e-4, 4e-4) if method == "gspo" else (0.2, 0.2)
    kw = dict(
        entropy=h,
        old_entropy=h_old,
        erc=(0.95, 1.05),
        ref_logprobs=old + 0.1,
        kl_coef=0.05,
        token_mask=torch.rand(b, t, generator=g) > 0.2,
        is_weight=0.5 + torch.rand(b, t, generator=g, dtype=F64),
    )
    if method != "cispo":
        kw.update(delta=1.6, dual_clip=1.9)
    out = policy_loss(lp, old, adv, mask, method=method, eps_low=eps[0], eps_high=eps[1], ratio_level=level, **kw)
    c = out.columns
    torch.testing.assert_close(c["grad_coef"], grad(out.loss, lp), **TIGHT)
    total = c["grad_coef_unclipped"] - c["grad_coef"]
    by_erc = c["grad_coef_before_erc"] - c["grad_coef"]
    rest = c["grad_coef_unclipped"] - c["grad_coef_before_erc"]
    dual = c.get("dual_clipped", torch.zeros_like(mask))
    low = (c["clip"] == -1) & ~dual
    high = (c["clip"] == 1) & ~dual
    parts = {
        "clip_low": torch.where(low, rest, 0.0),
        "clip_high": torch.where(high, rest, 0.0),
        "dual_clip": torch.where(dual, rest, 0.0),
        "erc": by_erc,
    }
    # every token's drop is the sum of its parts (nothing outside the three classes before ERC)
    assert (rest[~(low | high | dual)] == 0).all()
    torch.testing.assert_close(sum(parts.values()), total, **TIGHT)
    torch.testing.assert_close(sum(p.sum() for p in parts.values()), total.sum(), **TIGHT)
    # every cause occurs in this batch, and only changed tokens drop anything
    assert [k for k, p in parts.items() if not (p != 0).any()] == (["dual_clip"] if method == "cispo" else [])
    assert (total[~c["grad_changed"]] == 0).all()
    if level == "token":  # ERC's share sits on the tokens ERC dropped
        assert (by_erc[c["erc_kept"]] == 0).all()


# --- columns, config, validation -----------------------------------------------------------------


def test_columns_only_with_their_modifier():
    lp, old, adv, mask, kw = region_batch()
    out = policy_loss(lp, old, adv, mask)
    for name in ("token_kept", "seq_kept", "is_weight", "grad_coef_before_erc", "dual_clipped"):
        assert name not in out.columns
    assert out.config["delta"] is None and out.config["ratio_level"] == "token"
    assert not out.config["kl_bias_correction"]
    out = policy_loss(lp, old, adv, mask, seq_mask=torch.tensor([[1.0], [0.0]]), is_weight=torch.ones(2, 1))
    assert out.columns["seq_kept"].shape == mask.shape and out.columns["seq_kept"].dtype == torch.bool
    assert out.columns["is_weight"].shape == mask.shape


def test_bad_modifier_inputs():
    lp, old, adv, mask, kw = region_batch()
    cases = [
        (dict(weights=torch.ones(2, 3)), "weights shape"),
        (dict(token_mask=torch.ones(2, 3, dtype=torch.bool)), "token_mask shape"),
        (dict(seq_mask=torch.ones(3)), "seq_mask shape"),
        (dict(is_weight=torch.ones(9)), "is_weight shape"),
        (dict(entropy_weights=torch.ones(1, 9)), "entropy_weights shape"),
        (dict(delta=1.0), "delta must be > 1"),
        (dict(delta=float("nan")), "delta must be finite"),
        (dict(method="cispo", delta=2.0), "delta applies to PPO-clip methods only"),
        (dict(ratio_level="seq"), "ratio_level: unknown"),
        (dict(method="gspo", ratio_level="sequence"), "ratio_level='sequence' does not apply to gspo"),
        (dict(loss_scale_factor=4.0), "loss_scale_factor applies only"),
        (dict(agg="seq-mean-token-sum-norm", loss_scale_factor=0.0), "loss_scale_factor must be > 0"),
    ]
    for extra, msg in cases:
        with pytest.raises(ValueError, match=msg):
            policy_loss(lp, old, adv, mask, **extra)
    bad = torch.ones(2, 9, dtype=F64)
    bad[0, 3] = float("nan")
    with pytest.raises(ValueError, match="^is_weight contains NaN or Inf at masked-in"):
        policy_loss(lp, old, adv, mask, is_weight=bad)
    bad[0, 3], bad[1, 5] = 1.0, float("nan")  # masked out: fine
    assert torch.isfinite(policy_loss(lp, old, adv, mask, is_weight=bad).loss)
    with pytest.raises(ValueError, match="^is_weight contains NaN"):
        policy_loss(lp, old, adv, mask, is_weight=torch.tensor([[float("inf")], [1.0]]))
    w = torch.ones(2, 9)
    w[0, 0] = float("inf")
    with pytest.raises(ValueError, match="^weights contains NaN"):
        policy_loss(lp, old, adv, mask, weights=w)


def test_overflowing_ratio_on_a_clipped_token_stays_finite():
    # float32: log r = 100 -> r = inf. A > 0: clipped high, v = -A (1 + eps_high) = -1.2, g = 0 (no 0 * inf);
    # the third token (log r = 0.1, inside) keeps g = -r A / 3 = -exp(0.1) / 3
    lr = torch.tensor([[100.0, 100.0, 0.1]])
    old = torch.full_like(lr, -1.0)
    lp = (old + lr).requires_grad_(True)
    out = policy_loss(lp, old, torch.ones(1, 3), torch.ones(1, 3, dtype=torch.bool), method="grpo")
    g = grad(out.loss, lp)
    exp = torch.tensor([[0.0, 0.0, -math.exp(0.1) / 3]])
    torch.testing.assert_close(g, exp)
    torch.testing.assert_close(out.columns["grad_coef"], g, rtol=0, atol=0)
    assert out.loss.item() == pytest.approx((-1.2 - 1.2 - math.exp(0.1)) / 3)
