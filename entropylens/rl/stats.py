"""Pure tensor functions for per-token statistics. No I/O; device-agnostic; float32 accumulation.

Notation: z logits [..., V]; u = z / T (temperature T); a the sampled token;
lse = logsumexp(u); p = softmax(u); logp_a = u_a - lse; H = lse - sum_j p_j u_j.

Every reduction over the vocabulary runs over chunks of positions, so the extra memory is
O(chunk x V) float32, never a second [N, V] tensor.

Every exp over the vocabulary takes a floored argument (``_exp_floor``: -87 in float32, just above
log of the smallest normal float, -708 in float64). Below it torch's CPU exp leaves its vector path
(several times slower per element whose result underflows: docs/performance.md), and
such elements are common: -inf logits (vocabulary padding, banned tokens) and the far tail of a
wide distribution at a low temperature. The floored terms are at most exp(-87) = 1.6e-38 each, so
over V <= 10^6 tokens they move S = sum_j exp(u_j) >= 1 (the max term is 1) and its companions by
< 1e-31 relative: far below float32 resolution. The sampled token's log-probability is gathered
before the floor, so it stays exact (-inf logits: the lowest finite float32). -inf logits are then
finite, so 0 * -inf = NaN never arises. (A row whose logits are all -inf has no distribution and
stays NaN.)
"""

from __future__ import annotations

import torch

from ..schema import CLIP_HIGH, CLIP_LOW, CLIP_NONE, NA_HP, NA_LP, PA_HP, PA_LP, ZA
from . import native

# Bytes of one float32 [chunk, V] buffer (two are live). On CPU a chunk that fits in L2 keeps the
# several passes over it in cache; on an accelerator larger chunks amortise kernel launches.
_CHUNK_BYTES_CPU = 2 * 2**20
_CHUNK_BYTES_DEVICE = 128 * 2**20


def chunk_rows(n_rows: int, vocab: int, chunk_size: int | None, device: torch.device | None = None) -> int:
    if chunk_size is not None:
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        return chunk_size
    budget = _CHUNK_BYTES_CPU if device is None or device.type == "cpu" else _CHUNK_BYTES_DEVICE
    return max(1, min(n_rows, budget // (4 * max(vocab, 1))))


def _check_logits_tokens(logits: torch.Tensor, tokens: torch.Tensor | None, temperature: float) -> None:
    if logits.dim() < 1 or logits.shape[-1] < 1:
        raise ValueError(f"logits must have a vocabulary dimension, got shape {tuple(logits.shape)}")
    if not logits.is_floating_point():
        raise ValueError(f"logits must be floating point, got {logits.dtype}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if tokens is not None:
        if tuple(tokens.shape) != tuple(logits.shape[:-1]):
            raise ValueError(
                f"tokens shape {tuple(tokens.shape)} does not match logits shape {tuple(logits.shape)}[:-1]"
            )
        if tokens.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8, torch.int8):
            raise ValueError(f"tokens must be an integer tensor, got {tokens.dtype}")
        if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= logits.shape[-1]):
            raise ValueError(f"tokens must lie in [0, {logits.shape[-1]}) (the vocabulary size)")


_F32_LOWEST = torch.finfo(torch.float32).min


def _exp_floor(dtype: torch.dtype) -> float:
    """The floor of every exp argument over the vocabulary (module docstring): exp of it is still a
    normal float (float32: exp(-87) = 1.6e-38 > 1.18e-38, the smallest normal), which torch's CPU exp
    computes on its fast path; float64's fast range reaches -708."""
    return -708.0 if dtype == torch.float64 else -87.0


_EXP_FLOOR = _exp_floor(torch.float32)


class _ChunkBuffers:
    """Reusable float32 [chunk, V] buffers: the shifted logits, their exponentials and (for the
    entropy sensitivity) one product buffer."""

    def __init__(self, rows: int, vocab: int, device: torch.device, products: bool = False):
        self.u = torch.empty(rows, vocab, dtype=torch.float32, device=device)
        self.e = torch.empty(rows, vocab, dtype=torch.float32, device=device)
        self.t = torch.empty(rows, vocab, dtype=torch.float32, device=device) if products else None

    def load(
        self,
        z: torch.Tensor,
        temperature: float,
        tok: torch.Tensor | None,
        m_out: torch.Tensor | None = None,
        u_a_out: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """u <- max(z/T - max(z/T), floor) (``_EXP_FLOOR``: exp stays on its fast path; -inf -> floor);
        returns (u [n,V], max [n], u_a [n] or None) with u a view into the buffer and u_a the sampled
        token's shifted logit taken before the floor (-inf stays -inf here). ``m_out`` / ``u_a_out``
        ([n] views of the caller's per-row buffers) receive max and u_a directly."""
        n = z.shape[0]
        u = self.u[:n]
        u.copy_(z)
        if temperature != 1.0:
            u.div_(temperature)
        m = torch.amax(u, dim=-1, out=m_out) if m_out is not None else u.amax(dim=-1)  # [n]
        u.sub_(m.unsqueeze(-1))
        u_a = None
        if tok is not None:
            idx = tok.unsqueeze(1)
            u_a = (
                torch.gather(u, 1, idx, out=u_a_out.unsqueeze(1)) if u_a_out is not None else u.gather(1, idx)
            ).squeeze(1)  # [n]
        u.clamp_(min=_EXP_FLOOR)
        return u, m, u_a


def _chunk_sums(
    flat: torch.Tensor,
    flat_tok: torch.Tensor | None,
    temperature: float,
    rows: int,
    sums: torch.Tensor,
    want_entropy: bool,
    split: bool,
    want_sens: bool,
) -> None:
    """The eager pass of :func:`_forward`: the per-row sums (``sums`` rows m, u_a, S, dot, e_a, R, Q)
    one [rows, V] float32 chunk at a time, each a handful of vectorised torch ops."""
    n, v = flat.shape
    m_all, ua_all, s_all, dot_all = sums[0], sums[1], sums[2], sums[3]
    buf = _ChunkBuffers(min(rows, n), v, flat.device, products=want_sens)
    for s in range(0, n, rows):
        e_ = min(s + rows, n)
        tok = None if flat_tok is None else flat_tok[s:e_]
        u, _, _ = buf.load(flat[s:e_], temperature, tok, m_all[s:e_], ua_all[s:e_])  # u: [c, V]
        ex = torch.exp(u, out=buf.e[: e_ - s])  # [c, V]
        if split:
            assert tok is not None  # split: _forward sets it only with tokens
            idx = tok.unsqueeze(1)  # [c, 1]
            torch.gather(ex, 1, idx, out=sums[4, s:e_].unsqueeze(1))  # e_a
            ex.scatter_(1, idx, 0.0)  # e_j for j != a
            torch.sum(ex, dim=-1, out=s_all[s:e_])  # S_rest
            if not want_sens:
                torch.sum(ex.mul_(u), dim=-1, out=dot_all[s:e_])  # dot_rest
                continue
            assert buf.t is not None  # want_sens: the buffers hold the products one
            prod = torch.mul(ex, u, out=buf.t[: e_ - s])  # e_j u_j, j != a
            torch.sum(prod, dim=-1, out=dot_all[s:e_])  # dot_rest
            torch.sum(prod.mul_(ex), dim=-1, out=sums[5, s:e_])  # R_rest   (reduction 1)
            torch.sum(ex.mul_(ex), dim=-1, out=sums[6, s:e_])  # Q_rest   (reduction 2)
            continue
        torch.sum(ex, dim=-1, out=s_all[s:e_])  # S
        if want_entropy:
            torch.sum(ex.mul_(u), dim=-1, out=dot_all[s:e_])  # sum_j e_j u_j


def _forward(
    flat: torch.Tensor,
    flat_tok: torch.Tensor | None,
    temperature: float,
    rows: int,
    want_entropy: bool,
    sens_out: torch.Tensor | None = None,
    dist_out: torch.Tensor | None = None,
    lse_lo_out: torch.Tensor | None = None,
    split: bool = False,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
    """One pass over the logits. Returns (logp [N] or None, entropy [N] or None, lse [N]), all float32.
    The per-row sums come from the native row pass on CPU (:mod:`entropylens.rl.native`: float32 /
    bfloat16 logits, one vectorised loop per row) or else from :func:`_chunk_sums` (eager, per chunk).
    With ``sens_out`` ([N] float32, needs tokens) the same pass also fills the entropy
    sensitivity s (see :func:`entropy_sensitivity`; two more reductions per row), and with
    ``dist_out`` too ([N]) ||e_a - p||_2 from the same sums (see :func:`_sensitivity_from_sums`).
    ``lse_lo_out`` ([N] float32) receives lse's float32 rounding residual (:func:`_lse_residual`).
    ``split`` (needs tokens; implied by ``sens_out``): S and sum_j e_j u_j are summed with the sampled
    token's term split off (S = S_rest + e_a), as the sensitivity needs: the training pass always sums
    this way, so its log-probs, entropies and gradients are the same bits with or without the
    sensitivity (recording never changes training).

    Each chunk only writes its rows' sums over the vocabulary (reductions straight into [N] buffers);
    the arithmetic on those sums (logs, quotients, s) runs once over all N rows after the loop: the
    same ops on the same values, without ~25 small per-chunk ops (a chunk has ~3 rows at V = 151936)."""
    n, v = flat.shape
    dev = flat.device
    want_sens = sens_out is not None
    split = (split or want_sens) and flat_tok is not None
    want_dot = want_entropy or want_sens
    lse = torch.empty(n, dtype=torch.float32, device=dev)
    logp = torch.empty(n, dtype=torch.float32, device=dev) if flat_tok is not None else None
    ent = torch.empty(n, dtype=torch.float32, device=dev) if want_dot else None
    if n == 0:
        return logp, ent, lse
    # per-row sums: m the shift, u_a the sampled token's shifted logit (before the floor), S = sum_j e_j
    # (with the sensitivity: S_rest, j != a), dot = sum_j e_j u_j (dot_rest); the sensitivity's e_a,
    # R_rest = sum_{j != a} e_j^2 u_j and Q_rest = sum_{j != a} e_j^2
    sums = torch.empty(7 if want_sens else 5 if split else 4, n, dtype=torch.float32, device=dev)
    m_all, ua_all, s_all, dot_all = sums[0], sums[1], sums[2], sums[3]
    if native.usable(flat):  # CPU: the same sums from one vectorised loop per row (entropylens/rl/native.py)
        native.row_sums(flat, flat_tok, temperature, sums, want_dot=want_dot or split, split=split, want_sens=want_sens)
    else:
        _chunk_sums(flat, flat_tok, temperature, rows, sums, want_entropy, split, want_sens)
    if flat_tok is not None:
        ua_all.clamp_(min=_F32_LOWEST)  # a -inf logit's log p: the lowest finite float32
    if split:
        u_a = ua_all.clamp(min=_EXP_FLOOR)  # the floored u_a, as the chunk's u held it
        r_rest, q_rest = (sums[5], sums[6]) if want_sens else (None, None)
        lp, h, lse_, sens, dist, log_s = _sensitivity_from_sums(
            m_all, ua_all, s_all, dot_all, u_a, sums[4], r_rest, q_rest, dist_out is not None
        )
        # split: tokens given, and every caller that splits wants the entropy (or the sensitivity)
        assert logp is not None and ent is not None
        logp.copy_(lp), ent.copy_(h), lse.copy_(lse_)
        if sens_out is not None:
            assert sens is not None  # R_rest and Q_rest were passed
            sens_out.copy_(sens)
        if dist_out is not None:
            assert dist is not None  # (likewise, with want_dist)
            dist_out.copy_(dist)
    else:
        log_s = s_all.log()  # [N]
        torch.add(m_all, log_s, out=lse)
        if flat_tok is not None:
            torch.sub(ua_all, log_s, out=logp)
        if want_entropy:
            # H = log S - sum_j e_j u_j / S   (u shifted: the max cancels)
            torch.sub(log_s, dot_all.div_(s_all), out=ent)
    if lse_lo_out is not None:
        lse_lo_out.copy_(_lse_residual(m_all, log_s, lse))
    return logp, ent, lse


def _sensitivity_from_sums(
    m: torch.Tensor,
    u_a_exact: torch.Tensor,
    s_rest: torch.Tensor,
    dot_rest: torch.Tensor,
    u_a: torch.Tensor,
    e_a: torch.Tensor,
    r_rest: torch.Tensor | None,
    q_rest: torch.Tensor | None,
    want_dist: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
    """(logp_a, H, lse, s, dist), each [N], from the per-row sums of the sensitivity pass (all [N]):
    m the shift, u_a_exact the sampled token's shifted logit before the floor (log p_a from it),
    S_rest = sum_{j != a} e_j, dot_rest = sum_{j != a} e_j u_j, u_a the floored one, e_a = exp(u_a),
    R_rest = sum_{j != a} e_j^2 u_j, Q_rest = sum_{j != a} e_j^2 (e = exp(u), u shifted and floored).
    dist (None unless ``want_dist``) is the one-hot distance ||e_a - p||_2 = sqrt(S_rest^2 + Q_rest) / S
    from the same sums: with (1 - p_a) = S_rest / S and sum_{j != a} p_j^2 = Q_rest / S^2 nothing
    cancels as p_a -> 1. Without R_rest and Q_rest (None: the training pass not recording) s is None and
    logp_a, H and lse are the same bits as with them.

    With S = S_rest + e_a and mu = sum_j p_j u_j (so log p_j + H = u_j - mu):
        s = p_a (1 - p_a) (u_a - mu) - sum_{j != a} p_j^2 (u_j - mu)
    The sampled token's own term is split off so nothing cancels as p_a -> 1: 1 - p_a is
    S_rest / S, and the rest sums run over e with e_a zeroed (all their terms have one sign)."""
    sumexp = s_rest + e_a
    dot = dot_rest + e_a * u_a  # sum_j e_j u_j
    log_s = sumexp.log()
    mu = dot / sumexp
    # s S^2 = e_a S_rest (u_a - mu) - (R_rest - mu Q_rest)
    sens = dist = None
    if r_rest is not None and q_rest is not None:  # passed together
        sens = torch.addcmul(torch.addcmul(r_rest.neg(), mu, q_rest), e_a * s_rest, u_a - mu).div_(sumexp.square())
        dist = torch.addcmul(q_rest, s_rest, s_rest).sqrt_().div_(sumexp) if want_dist else None
    return u_a_exact - log_s, log_s - mu, m + log_s, sens, dist, log_s


# Where lse's float32 rounding residual exceeds this (|lse| >= ~32), the backward folds it back in
# (_lse_fix); below, it is under the pass's own float32 error (relative gradient error < 1e-6).
_LSE_RESIDUAL_TOL = 1e-6


def _lse_residual(m: torch.Tensor, log_s: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """lse_lo = (m + log S) - fl32(m + log S), [N] float32: what float32 rounding took from lse = m + log S
    (up to half an ulp of lse: ~1e-3 nats at |lse| ~ 2e4). The backward's log p = z/T - lse would carry
    it into every p_j; a large logit offset (|z/T| >> 1) makes it visible (forward values never use
    lse: log p_a = u_a - log S with u shifted first)."""
    return (m.double() + log_s.double() - lse.double()).float()


def _lse_fix(lse_lo: torch.Tensor, ent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(w, H') [N] for the backward: with log p computed as z/T - lse (rounded), the true
    log p = that - lse_lo, so p = exp(that) * w with w = exp(-lse_lo), and log p + H = that + H' with
    H' = H - lse_lo. Rows whose |lse_lo| <= _LSE_RESIDUAL_TOL keep w = 1 and H' = H exactly (the
    gradient is then the same, bit for bit, as without the correction)."""
    fix = lse_lo.abs() > _LSE_RESIDUAL_TOL
    w = torch.where(fix, torch.exp(-lse_lo), torch.ones_like(lse_lo))
    return w, torch.where(fix, ent - lse_lo, ent)


class _LogprobEntropy(torch.autograd.Function):
    """(logits, tokens) -> (logp_a, H, s). Backward recomputes softmax chunk by chunk from the saved lse
    and its float32 rounding residual (:func:`_lse_fix`: exact at any logit offset).

    d logp_a / d z_j = (1[j=a] - p_j) / T
    d H / d z_j      = -p_j (log p_j + H) / T
    s (the entropy sensitivity, empty unless asked for) has no gradient.
    """

    @staticmethod
    def forward(ctx, logits, flat_tok, temperature, rows, want_sens, want_dist):
        flat = logits.reshape(-1, logits.shape[-1])
        sens = torch.empty(flat.shape[0] if want_sens else 0, dtype=torch.float32, device=flat.device)
        dist = torch.empty(flat.shape[0] if want_dist else 0, dtype=torch.float32, device=flat.device)
        lse_lo = torch.empty(flat.shape[0], dtype=torch.float32, device=flat.device)
        logp, ent, lse = _forward(
            flat,
            flat_tok,
            temperature,
            rows,
            want_entropy=True,
            sens_out=sens if want_sens else None,
            dist_out=dist if want_dist else None,
            lse_lo_out=lse_lo,
            split=True,
        )  # the same bits with or without s
        ctx.save_for_backward(logits, flat_tok, lse, ent, lse_lo)
        ctx.set_materialize_grads(False)  # an unused output's gradient arrives as None: no work
        ctx.mark_non_differentiable(sens, dist)
        ctx.temperature = temperature
        ctx.rows = rows
        return logp, ent, sens, dist

    @staticmethod
    def backward(ctx, g_logp, g_ent, _g_sens, _g_dist):
        logits, flat_tok, lse, ent, lse_lo = ctx.saved_tensors
        t, rows = ctx.temperature, ctx.rows
        v = logits.shape[-1]
        flat = logits.reshape(-1, v)
        n = flat.shape[0]
        grad = torch.empty_like(flat)  # [N, V] in the logits dtype: the gradient itself
        if n:
            # p_j = exp(z_j/T - lse) * w and log p_j + H = (z_j/T - lse) + H' (lse's rounding, _lse_fix):
            # w folds into the row coefficients, so the [c, V] work is unchanged
            w, ent = _lse_fix(lse_lo, ent)
            g_w = None if g_logp is None else g_logp * w  # [N]
            g_ent_w = None if g_ent is None else g_ent * w
            u_buf = torch.empty(min(rows, n), v, dtype=torch.float32, device=flat.device)
            for s in range(0, n, rows):
                e_ = min(s + rows, n)
                c = e_ - s
                lp = u_buf[:c]
                lp.copy_(flat[s:e_])
                if t != 1.0:
                    lp.div_(t)
                lp.sub_(lse[s:e_].unsqueeze(1)).clamp_(min=_EXP_FLOOR)  # log p_j, [c, V], floored (-inf too)
                if g_ent_w is not None:  # (None exactly where g_ent is)
                    # -p (log p + H) g_H - p g_logp
                    gl = g_w[s:e_] if g_w is not None else torch.zeros(c, device=flat.device)
                    coef = (lp + ent[s:e_].unsqueeze(1)).mul_(g_ent_w[s:e_].unsqueeze(1)).add_(gl.unsqueeze(1))
                    out = lp.exp_().mul_(coef).neg_()
                else:
                    assert g_w is not None  # backward runs only when logp or H has a gradient
                    out = lp.exp_().mul_(-g_w[s:e_].unsqueeze(1))  # -p g_logp
                if g_logp is not None:  # + g_logp 1[j = a] (exact: no p in it)
                    idx = flat_tok[s:e_].unsqueeze(1)
                    out.scatter_add_(1, idx, g_logp[s:e_].unsqueeze(1))
                if t != 1.0:
                    out.div_(t)
                grad[s:e_] = out
        return grad.view_as(logits), None, None, None, None, None


def logprobs_and_entropy(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    entropy_grad: bool = False,
    sensitivity: bool = False,
    one_hot_distance: bool = False,
) -> tuple[torch.Tensor, ...]:
    """log pi(a_t) and the full-vocabulary entropy H_t in one pass over each chunk of logits.

    logits [..., V] (any float dtype), tokens [...] int -> (logprobs [...], entropy [...]) float32,
    and with ``sensitivity=True`` a third tensor: the entropy sensitivity s_t
    (:func:`entropy_sensitivity`) from the same pass (two more reductions per chunk); with
    ``one_hot_distance=True`` as well a fourth: d_t = ||e_a - p_t||_2 from the same sums, so that
    |g_t| / T * d_t is the exact logit-gradient norm of a loss that reaches the logits only through
    logp_a (g_t = dLoss/dlogp_a; :func:`logit_grad_norm` computes it from the logits alone).
    logp_a = z_a/T - lse(z/T);  H = lse(z/T) - sum_j softmax(z/T)_j z_j/T.
    The logsumexp is shared; logits are max-shifted; float32 accumulation. ``logprobs`` carries
    autograd when ``logits`` requires grad (the backward recomputes the softmax per chunk, so no
    [N, V] softmax is stored). ``entropy`` is detached unless ``entropy_grad=True`` (entropy bonus).
    -inf logits give no NaN: their p is exp(-87) = 1.6e-38 in place of 0 (the exp floor, module
    docstring), so their gradient is ~1e-38 times the row's coefficient rather than exactly 0; a sampled
    token whose logit is -inf gets logp = the lowest finite float32 (-3.4e38), not -inf.
    """
    _check_logits_tokens(logits, tokens, temperature)
    v = logits.shape[-1]
    flat_tok = tokens.reshape(-1).long()
    rows = chunk_rows(flat_tok.numel(), v, chunk_size, logits.device)
    if one_hot_distance and not sensitivity:
        raise ValueError("one_hot_distance=True comes from the sensitivity's sums: pass sensitivity=True too")
    if logits.requires_grad and torch.is_grad_enabled():
        logp, ent, sens, dist = _LogprobEntropy.apply(
            logits, flat_tok, float(temperature), rows, bool(sensitivity), bool(one_hot_distance)
        )
        if not entropy_grad:
            ent = ent.detach()
    else:
        with torch.no_grad():
            n = flat_tok.numel()
            sens = torch.empty(n if sensitivity else 0, dtype=torch.float32, device=logits.device)
            dist = torch.empty(n if one_hot_distance else 0, dtype=torch.float32, device=logits.device)
            logp, ent, _ = _forward(
                logits.reshape(-1, v),
                flat_tok,
                float(temperature),
                rows,
                True,
                sens_out=sens if sensitivity else None,
                dist_out=dist if one_hot_distance else None,
            )
    out: tuple[torch.Tensor, ...] = (logp.view(tokens.shape), ent.view(tokens.shape))
    if sensitivity:
        out += (sens.view(tokens.shape),)
    if one_hot_distance:
        out += (dist.view(tokens.shape),)
    return out


def entropy_sensitivity(
    logits: torch.Tensor, tokens: torch.Tensor, *, temperature: float = 1.0, chunk_size: int | None = None
) -> torch.Tensor:
    """The first-order entropy sensitivity of each position to its own token's gradient.

    With the tempered distribution p = softmax(z/T), entropy H and sampled token a,
        s_t = p_a (log p_a + H) - sum_j p_j^2 (log p_j + H)
    so that a gradient step with loss coefficient g_t = dLoss/dlogp_t, dz = -eta (g_t/T)(e_a - p),
    changes the entropy by dH_t = eta * g_t * s_t / T^2 + O(eta^2) (DESIGN.md, "first-order entropy
    attribution"). s > 0: raising the sampled token's probability raises the entropy (p_a below the
    entropy-weighted typical level); s < 0: it lowers it. logits [..., V], tokens [...] ->
    s [...] float32, no grad, in the same chunked pass as :func:`logprobs_and_entropy`.
    """
    _check_logits_tokens(logits, tokens, temperature)
    v = logits.shape[-1]
    flat_tok = tokens.reshape(-1).long()
    rows = chunk_rows(flat_tok.numel(), v, chunk_size, logits.device)
    sens = torch.empty(flat_tok.numel(), dtype=torch.float32, device=logits.device)
    with torch.no_grad():
        _forward(logits.detach().reshape(-1, v), flat_tok, float(temperature), rows, True, sens_out=sens)
    return sens.view(tokens.shape)


def entropy_effect(grad_coef: torch.Tensor, sensitivity: torch.Tensor, *, temperature: float = 1.0) -> torch.Tensor:
    """First-order entropy change per unit logit step of each token's gradient: g_t * s_t / T^2.
    grad_coef, sensitivity [...] -> [...] float32 (detached)."""
    return grad_coef.detach().float() * sensitivity.detach().float() / float(temperature) ** 2


def entropy_from_logits(
    logits: torch.Tensor, *, temperature: float = 1.0, chunk_size: int | None = None
) -> torch.Tensor:
    """Full-vocabulary entropy H = lse(u) - sum softmax(u) u, u = z/T. [..., V] -> [...] float32, no grad."""
    _check_logits_tokens(logits, None, temperature)
    v = logits.shape[-1]
    flat = logits.detach().reshape(-1, v)
    rows = chunk_rows(flat.shape[0], v, chunk_size, flat.device)
    with torch.no_grad():
        _, ent, _ = _forward(flat, None, float(temperature), rows, True)
    assert ent is not None  # want_entropy=True
    return ent.view(logits.shape[:-1])


def logsumexp_f32(logits: torch.Tensor, *, temperature: float = 1.0, chunk_size: int | None = None) -> torch.Tensor:
    """lse(z/T) per position in float32, chunked. [..., V] -> [...]."""
    _check_logits_tokens(logits, None, temperature)
    v = logits.shape[-1]
    flat = logits.detach().reshape(-1, v)
    with torch.no_grad():
        _, _, lse = _forward(
            flat, None, float(temperature), chunk_rows(flat.shape[0], v, chunk_size, flat.device), False
        )
    return lse.view(logits.shape[:-1])


def sum_p_squared(logits: torch.Tensor, *, temperature: float = 1.0, chunk_size: int | None = None) -> torch.Tensor:
    """sum_j p_j^2 = exp(lse(2u) - 2 lse(u)), u = z/T. [..., V] -> [...] float32."""
    _check_logits_tokens(logits, None, temperature)
    z = logits.detach()
    lse1 = logsumexp_f32(z, temperature=temperature, chunk_size=chunk_size)
    lse2 = logsumexp_f32(z, temperature=temperature / 2.0, chunk_size=chunk_size)
    return torch.exp(lse2 - 2.0 * lse1)


def one_hot_distance_from_sum_p2(logprobs: torch.Tensor, sum_p2: torch.Tensor) -> torch.Tensor:
    """d_t = ||e_a - p_t||_2 = sqrt(1 - 2 p_a + sum_j p_j^2) from log p_a and sum_j p_j^2 (an engine's
    or :func:`head_stats`' output), clamped at 0 against rounding ((1 - p_a)^2 + sum_{j != a} p_j^2 >= 0;
    it cancels as p_a -> 1, which the logits path avoids). The logit-gradient norm of a loss that
    reaches the logits only through logp_a is |dLoss/dlogp_a| / T * d_t. [...] -> [...] float32."""
    p = logprobs.detach().float().exp()
    return torch.sqrt((1.0 - 2.0 * p + sum_p2.detach().float()).clamp(min=0.0))


def logit_grad_norm_from_sum_p2(
    grad_coef: torch.Tensor, logprobs: torch.Tensor, sum_p2: torch.Tensor, temperature: float | torch.Tensor = 1.0
) -> torch.Tensor:
    """||dLoss/dz_t||_2 = |g_t| / T * d_t (:func:`one_hot_distance_from_sum_p2`) for a loss that reaches
    the logits only through logp_a (g_t = dLoss/dlogp_a, the grad_coef column): TRL's fused head and
    verl's engines give sum_j p_j^2, no logits. [B, T] -> [B, T] float32; ``temperature`` a float or
    one per row ([B])."""
    t = temperature if not isinstance(temperature, torch.Tensor) else temperature.float().reshape(-1, 1)
    return grad_coef.detach().float().abs() / t * one_hot_distance_from_sum_p2(logprobs, sum_p2)


def logit_grad_norm(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    grad_coef: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """||dLoss/dz_t||_2 for a loss that touches z only through logp_a, with g = dLoss/dlogp_a:

        |g| / T * sqrt((1 - p_a)^2 + sum_{j != a} p_j^2)

    computed stably: 1 - p_a = sigmoid(lse_{j!=a}(u) - u_a) and sum_{j!=a} p_j^2 =
    exp(lse_{j!=a}(2u) - 2 lse(u)), so nothing cancels when p_a -> 1. [..., V] -> [...] float32.
    """
    _check_logits_tokens(logits, tokens, temperature)
    if tuple(grad_coef.shape) != tuple(tokens.shape):
        raise ValueError(f"grad_coef shape {tuple(grad_coef.shape)} does not match tokens {tuple(tokens.shape)}")
    v = logits.shape[-1]
    flat = logits.detach().reshape(-1, v)
    tok = tokens.reshape(-1).long()
    n = flat.shape[0]
    rows = chunk_rows(n, v, chunk_size, flat.device)
    out = torch.empty(n, dtype=torch.float32, device=flat.device)
    with torch.no_grad():
        if n:
            buf = _ChunkBuffers(min(rows, n), v, flat.device)
            for s in range(0, n, rows):
                e_ = min(s + rows, n)
                u, _, u_a = buf.load(flat[s:e_], temperature, tok[s:e_])  # [c, V] max-shifted, floored; [c]
                assert u_a is not None  # tokens given
                idx = tok[s:e_].unsqueeze(1)
                lse = torch.logsumexp(u, dim=-1)  # [c]
                u.scatter_(1, idx, float("-inf"))  # drop the sampled token
                lse_rest = torch.logsumexp(u, dim=-1)  # lse_{j != a}(u)
                lse2_rest = torch.logsumexp(u.mul_(2.0), dim=-1)  # lse_{j != a}(2u)
                one_minus_pa = torch.sigmoid(lse_rest - u_a)
                rest_sq = torch.exp(lse2_rest - 2.0 * lse)
                out[s:e_] = torch.sqrt(one_minus_pa.square() + rest_sq)
    return out.view(tokens.shape) * grad_coef.detach().abs().float() / temperature


def quadrant(advantages: torch.Tensor, prob: torch.Tensor, *, tau: float = 0.5) -> torch.Tensor:
    """int8 quadrant codes: PA if A>0, NA if A<0; HP if p >= tau else LP; ZA (0) where A == 0."""
    if advantages.shape != prob.shape:
        advantages = torch.broadcast_to(advantages, prob.shape)
    hp = (prob >= tau).to(torch.int8)
    pa = (advantages > 0).to(torch.int8)
    na = (advantages < 0).to(torch.int8)
    # PA: PA_HP (1) or PA_LP (2); NA: NA_HP (3) or NA_LP (4); ZA (0) otherwise. No host-made constants
    # (a tensor from Python on the device would be a synchronising copy).
    assert (ZA, PA_HP, PA_LP, NA_HP, NA_LP) == (0, 1, 2, 3, 4)
    return pa * (2 - hp) + na * (4 - hp)


def clip_region(ratio: torch.Tensor, eps_low: float, eps_high: float) -> torch.Tensor:
    """int8: -1 where r < 1 - eps_low, +1 where r > 1 + eps_high, else 0."""
    low = (ratio < 1.0 - eps_low).to(torch.int8) * CLIP_LOW
    high = (ratio > 1.0 + eps_high).to(torch.int8) * CLIP_HIGH
    return (low + high + CLIP_NONE).to(torch.int8)


def clipped_mask(region: torch.Tensor, advantages: torch.Tensor) -> torch.Tensor:
    """PPO-clip removes the gradient: (region -1 and A < 0) or (region +1 and A > 0) (TRL's gating)."""
    return ((region == CLIP_LOW) & (advantages < 0)) | ((region == CLIP_HIGH) & (advantages > 0))


def entropy_ratio(entropy: torch.Tensor, old_entropy: torch.Tensor) -> torch.Tensor:
    """rho = (H + 1e-8) / (H_old + 1e-8) (ERC)."""
    return (entropy.detach().float() + 1e-8) / (old_entropy.detach().float() + 1e-8)


def kl_k3(logprobs: torch.Tensor, old_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(pi_old || pi_theta) with samples from pi_old: (r - 1) - log r."""
    log_r = logprobs.detach().float() - old_logprobs.detach().float()
    return torch.expm1(log_r) - log_r


# ---------------------------------------------------------------------------------------------------
# A fused LM head: hidden states -> (log-probs, entropies, sum p^2) without [N, V] logits.

_HEAD_CHUNK_BYTES_CPU = 32 * 2**20  # one float32 [rows, V] tile (a matmul wants more rows than _forward)
_HEAD_CHUNK_BYTES_DEVICE = 256 * 2**20


def _head_rows(n: int, vocab: int, chunk_size: int | None, device: torch.device) -> int:
    if chunk_size is not None:
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        return chunk_size
    budget = _HEAD_CHUNK_BYTES_CPU if device.type == "cpu" else _HEAD_CHUNK_BYTES_DEVICE
    return max(1, min(max(n, 1), budget // (4 * max(vocab, 1))))


def _head_tile(
    h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, temperature: float, dtype: torch.dtype
) -> torch.Tensor:
    """u = (h W^T + b) / T for one tile of positions, [c, V] in ``dtype`` (float32, or float64)."""
    u = h.to(dtype) @ weight.to(dtype).t()  # [c, V]
    if bias is not None:
        u.add_(bias.to(dtype))
    if temperature != 1.0:
        u.div_(temperature)
    return u


def _tile_sensitivity_(
    logp_all: torch.Tensor, p: torch.Tensor, tok: torch.Tensor, h: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(s, sum_j p_j^2) of one tile (log p [c, V], p [c, V], tok [c], H [c]), with
        s = p_a (1 - p_a)(log p_a + H) - sum_{j != a} p_j^2 (log p_j + H)
    the sampled token's term split off so nothing cancels as p_a -> 1 (see :func:`entropy_sensitivity`),
    and sum_j p_j^2 = sum_{j != a} p_j^2 + p_a^2 from the same squares. Works in place: ``logp_all``
    and ``p`` are overwritten (the tile's last use), so no [c, V] temporary is allocated."""
    idx = tok.unsqueeze(1)
    p_a = p.gather(1, idx).squeeze(1)  # [c]
    lp_a = logp_all.gather(1, idx).squeeze(1)  # [c]
    rest = p.scatter_(1, idx, 0.0)  # p_j for j != a, [c, V]
    one_minus = rest.sum(dim=-1)  # 1 - p_a
    sq_rest = rest.square_()  # p_j^2, j != a
    sq = sq_rest.sum(dim=-1) + p_a.square()  # sum_j p_j^2
    terms = logp_all.add_(h.unsqueeze(1)).mul_(sq_rest)  # p_j^2 (log p_j + H); log p floored (finite)
    return p_a * one_minus * (lp_a + h) - terms.sum(dim=-1), sq


class _HeadStats(torch.autograd.Function):
    """(hidden [N, H], weight [V, H], bias [V] | None, tokens [N]) -> (logp_a, H, sum_j p_j^2), each [N].

    Forward and backward project one tile of positions at a time (u = (h W^T + b)/T); only the
    tile's [c, V] logits exist. With g = dL/dlogp_a and g_H = dL/dH the tile's logit gradient is
        dz_j = (g (1[j=a] - p_j) - g_H p_j (log p_j + H)) / T,
    and grad_hidden = dz W, grad_weight += dz^T h, grad_bias += sum_rows dz.
    sum_j p_j^2 has no gradient (as TRL's log_sum_sq_probs).
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, tokens, temperature, rows, sens_out=None):
        n = hidden.shape[0]
        dtype = torch.promote_types(hidden.dtype, torch.float32)
        dev = hidden.device
        logp = torch.empty(n, dtype=dtype, device=dev)
        ent = torch.empty(n, dtype=dtype, device=dev)
        sq = torch.empty(n, dtype=dtype, device=dev)
        lse = torch.empty(n, dtype=dtype, device=dev)
        lse_lo = torch.zeros(n, dtype=dtype, device=dev)  # lse's rounding residual (_lse_residual; 0 in float64)
        for s in range(0, n, rows):
            e = min(s + rows, n)
            u = _head_tile(hidden[s:e], weight, bias, temperature, dtype)  # [c, V]
            m = u.amax(dim=-1, keepdim=True)  # [c, 1]
            u_a = u.gather(1, tokens[s:e].unsqueeze(1)).sub_(m).squeeze(1)  # [c], before the floor
            u.sub_(m).clamp_(min=_exp_floor(dtype))  # shifted, floored (module docstring), [c, V]
            p = u.exp()  # [c, V], unnormalised
            sum_e = p.sum(dim=-1, keepdim=True)  # [c, 1]
            log_s = sum_e.log()
            p.div_(sum_e)  # p
            u.sub_(log_s)  # log p (floored: -inf logits finite, 0 log 0 terms ~0)
            logp[s:e] = u_a - log_s.squeeze(1)
            lse_c = (m + log_s).squeeze(1)  # [c]
            if dtype == torch.float32:
                lse_lo[s:e] = _lse_residual(m.squeeze(1), log_s.squeeze(1), lse_c)
            ent[s:e] = -(p * u).sum(dim=-1)  # H = -sum p log p
            if sens_out is not None:  # the entropy sensitivity s (entropy attribution), from the same tile
                sens_out[s:e], sq[s:e] = _tile_sensitivity_(u, p, tokens[s:e], ent[s:e])  # u, p: last use
            else:
                sq[s:e] = p.square_().sum(dim=-1)
            lse[s:e] = lse_c
        ctx.save_for_backward(hidden, weight, bias, tokens, lse, ent, lse_lo)
        ctx.set_materialize_grads(False)
        ctx.temperature, ctx.rows = temperature, rows
        ctx.mark_non_differentiable(sq)
        return logp, ent, sq

    @staticmethod
    def backward(ctx, g_logp, g_ent, _g_sq):
        hidden, weight, bias, tokens, lse, ent, lse_lo = ctx.saved_tensors
        t, rows = ctx.temperature, ctx.rows
        n = hidden.shape[0]
        dtype = lse.dtype
        need_h, need_w, need_b = (
            ctx.needs_input_grad[0],
            ctx.needs_input_grad[1],
            bias is not None and ctx.needs_input_grad[2],
        )
        grad_h = torch.zeros_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=dtype, device=weight.device) if need_w else None
        grad_b = torch.zeros(bias.shape, dtype=dtype, device=bias.device) if need_b else None
        if g_logp is None and g_ent is None:
            return grad_h, grad_w, grad_b, None, None, None, None
        # lse's float32 rounding folded into the row coefficients (_lse_fix): p = exp(u - lse) * w
        w, ent = _lse_fix(lse_lo, ent)
        g_w = None if g_logp is None else g_logp.to(dtype) * w  # [N]
        g_ent_w = None if g_ent is None else g_ent.to(dtype) * w
        for s in range(0, n, rows):
            e = min(s + rows, n)
            u = _head_tile(hidden[s:e], weight, bias, t, dtype)  # [c, V]
            u.sub_(lse[s:e].unsqueeze(1)).clamp_(min=_exp_floor(dtype))  # log p, floored (module docstring)
            if g_ent_w is not None:  # (None exactly where g_ent is)
                coef = (u + ent[s:e].unsqueeze(1)).mul_(g_ent_w[s:e].unsqueeze(1))  # g_H (log p + H)
                if g_w is not None:
                    coef.add_(g_w[s:e].unsqueeze(1))
                dz = u.exp_().mul_(coef).neg_()  # -p (g + g_H (log p + H))
            else:
                assert g_w is not None  # both None returned above
                dz = u.exp_().mul_(-g_w[s:e].unsqueeze(1))  # -p g
            if g_logp is not None:
                dz.scatter_add_(1, tokens[s:e].unsqueeze(1), g_logp[s:e].to(dtype).unsqueeze(1))  # + g 1[j=a]
            if t != 1.0:
                dz.div_(t)
            h = hidden[s:e].to(dtype)
            if grad_h is not None:  # (None exactly where its need_ is False)
                grad_h[s:e] = (dz @ weight.to(dtype)).to(hidden.dtype)  # [c, H]
            if grad_w is not None:
                grad_w.addmm_(dz.t(), h)  # [V, H]
            if grad_b is not None:
                grad_b.add_(dz.sum(dim=0))
        return (
            grad_h,
            grad_w.to(weight.dtype) if grad_w is not None else None,
            grad_b.to(bias.dtype) if grad_b is not None else None,
            None,
            None,
            None,
            None,
        )


def head_stats(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    tokens: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    sensitivity: bool = False,
) -> tuple[torch.Tensor, ...]:
    """A fused LM head: log pi(a_t), entropy H_t and sum_j p_j^2 straight from hidden states
    (with ``sensitivity=True`` also the entropy sensitivity s_t of :func:`entropy_sensitivity`, a
    fourth tensor, no grad, from the same tiles).

    hidden [..., H], weight [V, H] (``lm_head.weight``), bias [V] or None, tokens [...] int ->
    (logprobs, entropy, sum_p_squared), each [...] in float32 (float64 for float64 inputs).
    With u = (h W^T + b) / T and p = softmax(u): logp_a = u_a - lse(u), H = -sum_j p_j log p_j,
    sum_p_squared = sum_j p_j^2. Positions are projected ``chunk_size`` rows at a time (default:
    a 32 MiB float32 tile on CPU), so [N, V] logits never exist, in the forward or the backward.
    ``logprobs`` and ``entropy`` carry autograd to ``hidden``, ``weight`` and ``bias`` (the same
    gradient as autograd through ``hidden @ weight.T``); ``sum_p_squared`` has none. It gives the
    exact logit-gradient norm of a loss that reaches the logits only through logp:
    ||dL/dz_t|| = |dL/dlogp_t| / T * sqrt(1 - 2 p_t + sum_j p_j^2).
    """
    if hidden.dim() < 1 or weight.dim() != 2 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"hidden [..., H] and weight [V, H] do not match: {tuple(hidden.shape)} vs {tuple(weight.shape)}"
        )
    if tuple(tokens.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(f"tokens shape {tuple(tokens.shape)} does not match hidden shape {tuple(hidden.shape)}[:-1]")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"bias must be [V] = ({weight.shape[0]},), got {tuple(bias.shape)}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    vocab = weight.shape[0]
    flat_tok = tokens.reshape(-1).long()
    if flat_tok.numel() and (int(flat_tok.min()) < 0 or int(flat_tok.max()) >= vocab):
        raise ValueError(f"tokens must lie in [0, {vocab}) (the vocabulary size)")
    flat = hidden.reshape(-1, hidden.shape[-1])  # [N, H]
    rows = _head_rows(flat.shape[0], vocab, chunk_size, flat.device)
    sens = None
    if sensitivity:
        sens = torch.empty(flat.shape[0], dtype=torch.promote_types(hidden.dtype, torch.float32), device=flat.device)
    logp, ent, sq = _HeadStats.apply(flat, weight, bias, flat_tok, float(temperature), rows, sens)
    shape = tokens.shape
    if sens is not None:  # sensitivity=True
        return logp.view(shape), ent.view(shape), sq.view(shape), sens.view(shape)
    return logp.view(shape), ent.view(shape), sq.view(shape)
