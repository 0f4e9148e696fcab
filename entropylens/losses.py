"""Policy losses of the GRPO family, CE-GPPO and ERC, with their per-token columns and step metrics.

Notation (DESIGN.md): logp = log pi_theta(a_t), old = log pi_old(a_t), r = exp(logp - old),
A the advantage, sg = detach, l_t the per-token loss (minimised), g_t = dl_t/dlogp_t,
w_t the aggregation weight. loss = sum_t w_t l_t (- entropy_coef * sum_t w_t H_t).

  grpo / dapo   l = -A r inside or on the unclipped side; -A (1-eps_low) / -A (1+eps_high)
                (constants, g = 0) where PPO-clip removes the gradient:
                clipped_low = r < 1-eps_low and A < 0; clipped_high = r > 1+eps_high and A > 0.
                (Equal to max(-A r, -A clip(r, 1-eps_low, 1+eps_high)).) dapo: eps_high 0.28.
  gppo          same value; clipped tokens keep g = -(1-eps_low) A / -(1+eps_high) A through
                l = -A (1-eps) / sg(r) * r.
  ce_gppo       l = -beta1 (1-eps_low)/sg(r) r A on clipped_low, -beta2 (1+eps_high)/sg(r) r A on
                clipped_high, -r A otherwise. g = -beta1 (1-eps_low) A, -beta2 (1+eps_high) A, -r A.
  cispo         l = -sg(clip(r, 1-eps_low, 1+eps_high)) A logp; g = -clip(r) A (never zero).
  gspo          s_i = exp(mean_t(logp - old)) per sequence; token form s_it = sg(s_i) pi / sg(pi);
                PPO-clip on s_it (eps 3e-4 / 4e-4); seq-mean-token-mean.
  dual_clip c   A < 0 and r > c: l = -c A (constant, g = 0)  (== min(l, -c A)).
  erc (lo, hi)  rho = (H + 1e-8)/(H_old + 1e-8); keep = lo < rho < hi; l = where(keep, l, sg(l)).
  kl_coef       + kl_coef * k3(ref || theta) with k3 = exp(ref - logp) - (ref - logp) - 1.

Aggregation weights w (mask m, L_i = sum_t m_it, B' = sequences with L_i > 0):
  token-mean            w = m / sum(m)
  seq-mean-token-mean   w = m / (L_i B')
  seq-mean-token-sum    w = m / B'
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from . import stats
from .schema import CLIP_HIGH, CLIP_LOW, QUADRANT_NAMES, ZA

METHODS: tuple[str, ...] = ("grpo", "dapo", "gppo", "ce_gppo", "cispo", "gspo")
AGGS: tuple[str, ...] = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")
DEFAULT_EPS: dict[str, tuple[float, float]] = {
    "grpo": (0.2, 0.2),
    "dapo": (0.2, 0.28),
    "gppo": (0.2, 0.2),
    "ce_gppo": (0.2, 0.2),
    "cispo": (0.2, 0.2),
    "gspo": (3e-4, 4e-4),
}
DEFAULT_AGG: dict[str, str] = {m: ("seq-mean-token-mean" if m == "gspo" else "token-mean") for m in METHODS}


@dataclass
class PolicyLossOutput:
    """loss: scalar; columns: per-token [B, T] detached tensors named as the schema's token columns;
    metrics: 0-dim detached tensors on the device (call :meth:`scalars` for floats, one host copy);
    config: the resolved hyperparameters (method, eps_low, eps_high, ...)."""

    loss: torch.Tensor
    columns: dict[str, torch.Tensor]
    metrics: dict[str, torch.Tensor]
    config: dict = field(default_factory=dict)

    def scalars(self) -> dict[str, float]:
        if not self.metrics:
            return {}
        keys = list(self.metrics)
        values = torch.stack([self.metrics[k].float() for k in keys]).cpu().tolist()
        return dict(zip(keys, values))


def resolve_eps(method: str, eps_low: float | None, eps_high: float | None) -> tuple[float, float]:
    """Method defaults: 0.2 / 0.2, dapo 0.2 / 0.28, gspo 3e-4 / 4e-4. eps_high defaults to eps_low
    when only eps_low is given (except dapo and gspo, which keep their own high side)."""
    d_low, d_high = DEFAULT_EPS[method]
    low = d_low if eps_low is None else float(eps_low)
    if eps_high is not None:
        high = float(eps_high)
    elif eps_low is not None and method not in ("dapo", "gspo"):
        high = low
    else:
        high = d_high
    return low, high


def _check_finite(named: dict[str, torch.Tensor], mask: torch.Tensor) -> None:
    """One device sync for all inputs: NaN/Inf at masked-in positions is an error."""
    flags = torch.stack([(~torch.isfinite(t.detach()) & mask).any() for t in named.values()])
    bad = flags.cpu().tolist()
    for (name, _), b in zip(named.items(), bad):
        if b:
            raise ValueError(f"{name} contains NaN or Inf at masked-in (response) positions")


def _validate(method, eps_low, eps_high, beta1, beta2, dual_clip, erc, agg, tau, entropy, old_entropy, entropy_coef):
    if method not in METHODS:
        raise ValueError(f"method: unknown {method!r}; valid methods: {', '.join(METHODS)}")
    if agg not in AGGS:
        raise ValueError(f"agg: unknown {agg!r}; valid: {', '.join(AGGS)}")
    if not (0.0 <= eps_low < 1.0) or not math.isfinite(eps_low):
        raise ValueError(f"eps_low must be in [0, 1), got {eps_low}")
    if not (0.0 <= eps_high) or not math.isfinite(eps_high):
        raise ValueError(f"eps_high must be a finite number >= 0, got {eps_high}")
    if not (beta1 >= 0 and beta2 >= 0) or not (math.isfinite(beta1) and math.isfinite(beta2)):
        raise ValueError(f"beta1 and beta2 must be finite and >= 0, got {beta1}, {beta2}")
    if dual_clip is not None:
        if method == "cispo":
            raise ValueError("dual_clip does not apply to cispo (its loss is not a clipped surrogate)")
        if not dual_clip > 1.0:
            raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
    if erc is not None:
        if len(erc) != 2 or not (0.0 <= erc[0] < 1.0 < erc[1]):
            raise ValueError(f"erc must be (low, high) with 0 <= low < 1 < high, got {erc}")
        if entropy is None or old_entropy is None:
            raise ValueError("erc needs entropy and old_entropy (the entropy ratio is H / H_old)")
    if not 0.0 < tau <= 1.0:
        raise ValueError(f"tau must be in (0, 1], got {tau}")
    if entropy_coef != 0.0 and entropy is None:
        raise ValueError("entropy_coef needs entropy (with grad: logprobs_and_entropy(..., entropy_grad=True))")


def aggregation_weights(mask: torch.Tensor, agg: str) -> torch.Tensor:
    """w [B, T] float32 such that loss = sum(w * l). See the module docstring."""
    m = mask.float()
    if agg == "token-mean":
        return m / m.sum().clamp(min=1.0)
    lengths = m.sum(dim=-1, keepdim=True)  # [B, 1]
    n_seq = (lengths > 0).sum().clamp(min=1).float()
    if agg == "seq-mean-token-mean":
        return m / (lengths.clamp(min=1.0) * n_seq)
    return m / n_seq  # seq-mean-token-sum


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    method: str = "grpo",
    eps_low: float | None = None,
    eps_high: float | None = None,
    beta1: float = 0.5,
    beta2: float = 1.0,
    dual_clip: float | None = None,
    entropy: torch.Tensor | None = None,
    old_entropy: torch.Tensor | None = None,
    erc: tuple[float, float] | None = None,
    agg: str | None = None,
    entropy_coef: float = 0.0,
    ref_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    tau: float = 0.5,
) -> PolicyLossOutput:
    """Policy loss of ``method`` over response tokens. Shapes: logprobs, old_logprobs, mask [B, T];
    advantages [B] (one per sequence) or [B, T]; entropy / old_entropy / ref_logprobs [B, T].
    eps_low / eps_high / agg default per method (see :data:`DEFAULT_EPS`, :data:`DEFAULT_AGG`).
    Formulas: module docstring. ``columns['grad_coef']`` == autograd.grad(loss, logprobs)."""
    agg = DEFAULT_AGG.get(method, "token-mean") if agg is None else agg
    if method in METHODS:
        eps_low, eps_high = resolve_eps(method, eps_low, eps_high)
    _validate(method, eps_low, eps_high, beta1, beta2, dual_clip, erc, agg, tau, entropy, old_entropy, entropy_coef)

    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must be [B, T], got shape {tuple(logprobs.shape)}")
    shape = tuple(logprobs.shape)
    for name, t in (("old_logprobs", old_logprobs), ("mask", mask), ("entropy", entropy),
                    ("old_entropy", old_entropy), ("ref_logprobs", ref_logprobs)):
        if t is not None and tuple(t.shape) != shape:
            raise ValueError(f"{name} shape {tuple(t.shape)} does not match logprobs shape {shape}")
    if advantages.dim() == 1:
        if advantages.shape[0] != shape[0]:
            raise ValueError(f"advantages shape {tuple(advantages.shape)} does not match batch size {shape[0]}")
        adv = advantages.detach().float().unsqueeze(1).expand(shape)
    elif tuple(advantages.shape) == shape:
        adv = advantages.detach().float()
    else:
        raise ValueError(f"advantages must be [B] or [B, T] = {shape}, got {tuple(advantages.shape)}")

    m = mask.bool()
    inputs = {"logprobs": logprobs, "old_logprobs": old_logprobs, "advantages": adv}
    for name, t in (("entropy", entropy), ("old_entropy", old_entropy), ("ref_logprobs", ref_logprobs)):
        if t is not None:
            inputs[name] = t
    _check_finite(inputs, m)

    A = torch.where(m, adv, torch.zeros_like(adv))  # [B, T]
    logp = logprobs.float()
    old = old_logprobs.detach().float()
    log_r = torch.where(m, logp - old, torch.zeros_like(old))  # [B, T], 0 off the mask
    r = torch.exp(log_r)  # [B, T], carries grad
    r_d = r.detach()

    w = aggregation_weights(m, agg)  # [B, T]

    if method == "gspo":
        lengths = m.float().sum(-1, keepdim=True).clamp(min=1.0)  # [B, 1]
        seq_log_r = (log_r.detach().sum(-1, keepdim=True) / lengths)  # [B, 1]
        s = torch.exp(seq_log_r).expand(shape)  # sg(s_i) broadcast, [B, T]
        surr = s * torch.exp(log_r - log_r.detach())  # value s_i, d/dlogp = s_i
        clip_r = s
        slope = s  # d surr / d logp
    else:
        surr = r
        clip_r = r_d
        slope = r_d

    region = stats.clip_region(clip_r, eps_low, eps_high)  # [B, T] int8
    low_side = region == CLIP_LOW
    high_side = region == CLIP_HIGH
    cl = low_side & (A < 0) & m  # PPO-clip drops the gradient (low side)
    ch = high_side & (A > 0) & m  # (high side)
    clipped = cl | ch
    lo_b, hi_b = 1.0 - eps_low, 1.0 + eps_high

    if method in ("grpo", "dapo", "gspo"):
        l = torch.where(cl, -A * lo_b, torch.where(ch, -A * hi_b, -A * surr))
        g = torch.where(clipped, torch.zeros_like(A), -A * slope)
    elif method in ("gppo", "ce_gppo"):
        b1, b2 = (1.0, 1.0) if method == "gppo" else (float(beta1), float(beta2))
        l = torch.where(
            cl, -A * (b1 * lo_b) / r_d * r, torch.where(ch, -A * (b2 * hi_b) / r_d * r, -A * r)
        )
        g = torch.where(cl, -A * (b1 * lo_b), torch.where(ch, -A * (b2 * hi_b), -A * r_d))
    else:  # cispo
        w_is = clip_r.clamp(lo_b, hi_b)
        logp_m = torch.where(m, logp, torch.zeros_like(logp))
        l = -w_is * A * logp_m
        g = -w_is * A

    dual = torch.zeros_like(m)
    if dual_clip is not None:
        dual = (A < 0) & (clip_r > dual_clip) & m & ~clipped
        l = torch.where(dual, (-A * dual_clip).detach(), l)
        g = torch.where(dual, torch.zeros_like(g), g)

    columns: dict[str, torch.Tensor] = {}
    metrics: dict[str, torch.Tensor] = {}
    if entropy is not None and old_entropy is not None:
        rho = stats.entropy_ratio(entropy, old_entropy)  # [B, T]
        columns["entropy"] = entropy.detach().float()
        columns["old_entropy"] = old_entropy.detach().float()
        columns["entropy_ratio"] = rho
        if erc is not None:
            keep = (rho > erc[0]) & (rho < erc[1])
            l = torch.where(keep, l, l.detach())
            g = torch.where(keep, g, torch.zeros_like(g))
            columns["erc_kept"] = keep
    elif entropy is not None:
        columns["entropy"] = entropy.detach().float()

    if ref_logprobs is not None and kl_coef != 0.0:
        d = torch.where(m, ref_logprobs.detach().float() - logp, torch.zeros_like(logp))  # ref - logp
        l = l + kl_coef * (torch.exp(d) - d - 1.0)
        g = g + kl_coef * (1.0 - torch.exp(d.detach()))

    l = torch.where(m, l, torch.zeros_like(l))  # nothing off the mask reaches the loss
    loss = (l * w).sum()
    if entropy_coef != 0.0:
        loss = loss - entropy_coef * (torch.where(m, entropy.float(), torch.zeros_like(w)) * w).sum()

    prob = torch.exp(old)
    quad = stats.quadrant(A, prob, tau=tau)
    quad = torch.where(m, quad, torch.full_like(quad, ZA))
    columns.update(
        logprob=logp.detach(),
        old_logprob=old,
        ratio=r_d,
        advantage=A,
        prob=prob,
        quadrant=quad,
        clip=region,
        clipped=clipped,
        grad_coef=torch.where(m, g.detach() * w, torch.zeros_like(w)),
        token_loss=l.detach(),
    )
    if dual_clip is not None:
        columns["dual_clipped"] = dual

    n = m.sum()
    denom = n.clamp(min=1).float()

    def frac(x: torch.Tensor) -> torch.Tensor:
        return (x & m).sum().float() / denom

    metrics["loss"] = loss.detach()
    metrics["n_tokens"] = n.float()
    metrics["clip/low_frac"] = frac(cl)
    metrics["clip/high_frac"] = frac(ch)
    metrics["clip/frac"] = frac(clipped)
    metrics["clip/region_low_frac"] = frac(low_side)
    metrics["clip/region_high_frac"] = frac(high_side)
    for code, name in QUADRANT_NAMES.items():
        in_q = (quad == code) & m
        metrics[f"quadrant/{name}_frac"] = frac(in_q)
        if code != ZA:
            metrics[f"clip/{name}_frac"] = (clipped & in_q).sum().float() / in_q.sum().clamp(min=1).float()
    metrics["ratio/mean"] = (r_d * m).sum() / denom
    metrics["kl/k3"] = (torch.where(m, stats.kl_k3(logp, old), torch.zeros_like(old))).sum() / denom
    if "entropy" in columns:
        metrics["entropy/mean"] = (torch.where(m, columns["entropy"], torch.zeros_like(w))).sum() / denom
    if "entropy_ratio" in columns:
        metrics["entropy_ratio/mean"] = (torch.where(m, columns["entropy_ratio"], torch.zeros_like(w))).sum() / denom
    if erc is not None:
        metrics["erc/drop_frac"] = frac(~columns["erc_kept"])
    if dual_clip is not None:
        metrics["clip/dual_frac"] = frac(dual)

    config = dict(
        method=method, eps_low=eps_low, eps_high=eps_high, beta1=float(beta1), beta2=float(beta2),
        dual_clip=dual_clip, erc=tuple(erc) if erc is not None else None, agg=agg, tau=tau,
        entropy_coef=entropy_coef, kl_coef=kl_coef,
    )
    return PolicyLossOutput(loss=loss, columns=columns, metrics=metrics, config=config)

