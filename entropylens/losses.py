"""Policy losses of the GRPO family, CE-GPPO and ERC, with their per-token columns and step metrics.

Notation (DESIGN.md): logp = log pi_theta(a_t), old = log pi_old(a_t), r = exp(logp - old),
A the advantage, sg = detach, l_t the per-token loss (minimised), g_t = dl_t/dlogp_t,
w_t the aggregation weight, c the ``scale`` (e.g. 1 / gradient_accumulation_steps).
loss = c * (sum_t w_t l_t - entropy_coef * sum_t w_t H_t).

The loss is built in three stages, each a small function (torchtune style):

1. one surrogate per method returns (l [B,T] with grad, g [B,T] detached):
  grpo / dapo   l = -A r inside or on the unclipped side; -A (1-eps_low) / -A (1+eps_high)
                (constants, g = 0) where PPO-clip removes the gradient:
                clipped_low = r < 1-eps_low and A < 0; clipped_high = r > 1+eps_high and A > 0.
                (Equal to max(-A r, -A clip(r, 1-eps_low, 1+eps_high)).) dapo: eps_high 0.28.
  gppo          same value; clipped tokens keep g = -(1-eps_low) A / -(1+eps_high) A.
  ce_gppo       g = -beta1 (1-eps_low) A on clipped_low, -beta2 (1+eps_high) A on clipped_high,
                -r A otherwise. gppo is ce_gppo with beta1 = beta2 = 1.
                Both are written l = -A sg(k) exp(log r - sg(log r)) with k the slope above divided
                by -A: value -A k, gradient -A k, and no 1/r (finite when r underflows to 0).
  cispo         l = -sg(clip(r, 1-eps_low, 1+eps_high)) A logp; g = -clip(r) A (never zero).
  gspo          s_i = exp(mean_t(logp - old)) per sequence; token form s_it = sg(s_i) pi / sg(pi);
                PPO-clip on s_it (eps 3e-4 / 4e-4); seq-mean-token-mean.
2. modifiers change (l, g) of some tokens:
  dual_clip c   A < 0 and r > c: l = -c A (constant, g = 0)  (== min(l, -c A)).
  erc (lo, hi)  rho = (H + 1e-8)/(H_old + 1e-8); keep = lo < rho < hi; l = where(keep, l, sg(l)).
  kl_coef       + kl_coef * k3(ref || theta) with k3 = exp(ref - logp) - (ref - logp) - 1,
                g += kl_coef (1 - exp(ref - logp)).
  entropy bonus - entropy_coef * sum_t w_t H_t (gradient through H, not through logp).
3. columns and metrics: per-token [B,T] columns named as the schema's token columns, and the
   step metrics named as the schema's steps columns (computed by tokenbatch.step_aggregates).

Unclipped reference (what E3's entropy attribution compares against): the surrogate -A r (gspo:
its token form -A s_it, cispo: -A sg(r) logp), same weights, scale and KL term:
  grad_coef_unclipped = c w (-A slope + kl_coef (1 - exp(ref - logp))), slope = r (gspo: s_i).
  grad_changed = clipping (PPO-clip, cispo's clip with A != 0), CE-GPPO/GPPO's bounded slope,
  ERC or dual-clip changed the token's gradient; elsewhere grad_coef == grad_coef_unclipped.

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
from .schema import CLIP_HIGH, CLIP_LOW, CLIP_NONE, ZA

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
    """loss: scalar (scale included); columns: per-token [B, T] detached tensors named as the schema's
    token columns; metrics: 0-dim detached tensors on the device named as the schema's steps columns
    (computed on first access; :meth:`scalars` gives floats with one host copy);
    config: the resolved hyperparameters (method, eps_low, eps_high, ...)."""

    loss: torch.Tensor
    columns: dict[str, torch.Tensor]
    config: dict = field(default_factory=dict)
    mask: torch.Tensor | None = None
    # the inputs found finite at masked-in positions (as float32: float64 inputs are left out, their
    # finite values may overflow float32), by argument name, with "mask" the mask argument: the
    # recorder does not check these tensors again when it is given the same objects
    checked: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)
    _metrics: dict[str, torch.Tensor] | None = field(default=None, repr=False)

    @property
    def metrics(self) -> dict[str, torch.Tensor]:
        if self._metrics is None:
            from .tokenbatch import step_metrics

            self._metrics = step_metrics(self.columns, self.mask, self.loss)
        return self._metrics

    def scalars(self) -> dict[str, float]:
        metrics = self.metrics
        if not metrics:
            return {}
        keys = list(metrics)
        values = torch.stack([metrics[k].double() for k in keys]).cpu().tolist()
        return dict(zip(keys, values))


# Settings fixed for a run (run.json) and settings of one update (steps rows; they may change over a
# run, e.g. a beta1 schedule). An update writes only the settings its method has.
RUN_SETTINGS: tuple[str, ...] = ("method", "eps_low", "eps_high", "agg", "tau")


def update_settings(config: dict) -> dict[str, float]:
    """The per-update settings of a resolved loss ``config`` (PolicyLossOutput.config) that apply:
    beta1 / beta2 for ce_gppo only; dual_clip, erc_low / erc_high, entropy_coef, kl_coef where set;
    loss_scale where not 1. Keys are steps columns (schema.STEPS)."""
    out: dict[str, float] = {}
    if config.get("method") == "ce_gppo":
        out["beta1"], out["beta2"] = float(config["beta1"]), float(config["beta2"])
    if config.get("dual_clip") is not None:
        out["dual_clip"] = float(config["dual_clip"])
    if config.get("erc") is not None:
        out["erc_low"], out["erc_high"] = (float(x) for x in config["erc"])
    for key in ("entropy_coef", "kl_coef"):
        if config.get(key):
            out[key] = float(config[key])
    if config.get("scale", 1.0) != 1.0:
        out["loss_scale"] = float(config["scale"])
    return out


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


# --- inputs ------------------------------------------------------------------------------------


@dataclass
class Tokens:
    """The loss's inputs, checked and shaped: everything [B, T]."""

    mask: torch.Tensor  # [B, T] bool
    advantage: torch.Tensor  # [B, T] float, detached, 0 off the mask
    logp: torch.Tensor  # [B, T] float, carries grad
    old: torch.Tensor  # [B, T] float, detached
    log_ratio: torch.Tensor  # [B, T] logp - old, 0 off the mask, carries grad

    @property
    def ratio(self) -> torch.Tensor:  # [B, T] detached r
        return torch.exp(self.log_ratio.detach())


@dataclass
class Clip:
    """Where the method's clipped ratio (r, or gspo's s_i) leaves [1-eps_low, 1+eps_high]."""

    ratio: torch.Tensor  # [B, T] detached: the ratio the method clips
    region: torch.Tensor  # [B, T] int8: CLIP_LOW / CLIP_NONE / CLIP_HIGH
    low: torch.Tensor  # [B, T] bool: low side and A < 0 (PPO-clip drops the gradient)
    high: torch.Tensor  # [B, T] bool: high side and A > 0
    eps_low: float
    eps_high: float

    @property
    def clipped(self) -> torch.Tensor:  # [B, T] bool
        return self.low | self.high


def _check_finite(named: dict[str, torch.Tensor], mask: torch.Tensor) -> None:
    """One device sync for all inputs: NaN/Inf at masked-in positions is an error."""
    flags = torch.stack([(~torch.isfinite(t.detach()) & mask).any() for t in named.values()])
    bad = flags.cpu().tolist()
    for (name, _), b in zip(named.items(), bad):
        if b:
            raise ValueError(f"{name} contains NaN or Inf at masked-in (response) positions")


def _validate(method, eps_low, eps_high, beta1, beta2, dual_clip, erc, agg, tau, entropy, old_entropy,
              entropy_coef, scale):
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
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be a finite number > 0, got {scale}")


def _prepare(logprobs, old_logprobs, advantages, mask, extra: dict[str, torch.Tensor | None]) -> Tokens:
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must be [B, T], got shape {tuple(logprobs.shape)}")
    shape = tuple(logprobs.shape)
    for name, t in (("old_logprobs", old_logprobs), ("mask", mask), *extra.items()):
        if t is not None and tuple(t.shape) != shape:
            raise ValueError(f"{name} shape {tuple(t.shape)} does not match logprobs shape {shape}")
    if advantages.dim() == 1:
        if advantages.shape[0] != shape[0]:
            raise ValueError(f"advantages shape {tuple(advantages.shape)} does not match batch size {shape[0]}")
        adv = advantages.detach().float().unsqueeze(1).expand(shape)  # [B, T]
    elif tuple(advantages.shape) == shape:
        adv = advantages.detach().float()  # [B, T]
    else:
        raise ValueError(f"advantages must be [B] or [B, T] = {shape}, got {tuple(advantages.shape)}")
    m = mask.bool()
    inputs = {"logprobs": logprobs, "old_logprobs": old_logprobs, "advantages": adv}
    inputs.update({name: t for name, t in extra.items() if t is not None})
    _check_finite(inputs, m)
    zero = torch.zeros((), dtype=adv.dtype, device=adv.device)
    logp = logprobs.float()
    old = old_logprobs.detach().float()
    log_ratio = torch.where(m, logp - old, torch.zeros((), dtype=logp.dtype, device=logp.device))
    return Tokens(mask=m, advantage=torch.where(m, adv, zero), logp=logp, old=old, log_ratio=log_ratio)


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


# --- stage 1: surrogates -----------------------------------------------------------------------


def unit(log_ratio: torch.Tensor) -> torch.Tensor:
    """exp(log r - sg(log r)): value 1, d/dlogp = 1, finite for any finite log r. [B, T]"""
    return torch.exp(log_ratio - log_ratio.detach())


def gspo_ratio(x: Tokens) -> torch.Tensor:
    """s_i = exp(mean_t log r_it) per sequence, broadcast to [B, T], detached."""
    lengths = x.mask.float().sum(-1, keepdim=True).clamp(min=1.0)  # [B, 1]
    return torch.exp(x.log_ratio.detach().sum(-1, keepdim=True) / lengths).expand_as(x.log_ratio)  # [B, T]


def clip_of(x: Tokens, ratio: torch.Tensor, eps_low: float, eps_high: float) -> Clip:
    region = stats.clip_region(ratio, eps_low, eps_high)  # [B, T] int8
    low = (region == CLIP_LOW) & (x.advantage < 0) & x.mask
    high = (region == CLIP_HIGH) & (x.advantage > 0) & x.mask
    return Clip(ratio=ratio, region=region, low=low, high=high, eps_low=eps_low, eps_high=eps_high)


def ppo_clip_surrogate(x: Tokens, clip: Clip, surr: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """grpo / dapo / gspo: l = -A surr (surr = r, or gspo's s_it), the constant -A (1 -/+ eps) where
    clipped; g = -A slope(surr) unclipped, 0 clipped (slope = value of surr: d surr / dlogp = surr)."""
    a = x.advantage
    l = torch.where(clip.low, -a * (1.0 - clip.eps_low), torch.where(clip.high, -a * (1.0 + clip.eps_high), -a * surr))
    g = torch.where(clip.clipped, torch.zeros_like(a), -a * clip.ratio)
    return l, g


def ce_gppo_surrogate(x: Tokens, clip: Clip, beta1: float, beta2: float) -> tuple[torch.Tensor, torch.Tensor]:
    """gppo (beta1 = beta2 = 1) and ce_gppo: l = -A sg(k) exp(log r - sg(log r)), g = -A k with
    k = beta1 (1-eps_low) on clipped_low, beta2 (1+eps_high) on clipped_high, r elsewhere."""
    k = torch.where(clip.low, torch.full_like(clip.ratio, beta1 * (1.0 - clip.eps_low)),
                    torch.where(clip.high, torch.full_like(clip.ratio, beta2 * (1.0 + clip.eps_high)), clip.ratio))
    g = -x.advantage * k  # [B, T] detached
    return g * unit(x.log_ratio), g


def cispo_surrogate(x: Tokens, clip: Clip) -> tuple[torch.Tensor, torch.Tensor]:
    """l = -sg(clip(r, 1-eps_low, 1+eps_high)) A logp; g = -clip(r) A."""
    g = -clip.ratio.clamp(1.0 - clip.eps_low, 1.0 + clip.eps_high) * x.advantage
    logp = torch.where(x.mask, x.logp, torch.zeros_like(x.logp))
    return g * logp, g


def surrogate(method: str, x: Tokens, eps_low: float, eps_high: float, beta1: float, beta2: float):
    """(l [B,T], g [B,T], clip, slope [B,T]) of ``method``; slope is the unclipped surrogate's d/dlogp
    divided by -A (r, or s_i for gspo)."""
    if method == "gspo":
        s = gspo_ratio(x)
        clip = clip_of(x, s, eps_low, eps_high)
        l, g = ppo_clip_surrogate(x, clip, s * unit(x.log_ratio))
        return l, g, clip, s
    r = x.ratio
    clip = clip_of(x, r, eps_low, eps_high)
    if method in ("grpo", "dapo"):
        l, g = ppo_clip_surrogate(x, clip, torch.exp(x.log_ratio))
    elif method in ("gppo", "ce_gppo"):
        b1, b2 = (1.0, 1.0) if method == "gppo" else (float(beta1), float(beta2))
        l, g = ce_gppo_surrogate(x, clip, b1, b2)
    else:
        l, g = cispo_surrogate(x, clip)
    return l, g, clip, r


# --- stage 2: modifiers ------------------------------------------------------------------------


def apply_dual_clip(l, g, x: Tokens, clip: Clip, c: float):
    """A < 0 and ratio > c (tokens PPO-clip has not already clipped): l = -c A, g = 0."""
    dual = (x.advantage < 0) & (clip.ratio > c) & x.mask & ~clip.clipped  # [B, T] bool
    l = torch.where(dual, (-x.advantage * c).detach(), l)
    g = torch.where(dual, torch.zeros_like(g), g)
    return l, g, dual


def apply_erc(l, g, rho: torch.Tensor, band: tuple[float, float]):
    """Keep the gradient iff band[0] < rho < band[1]; the value stays (l -> sg(l) outside)."""
    keep = (rho > band[0]) & (rho < band[1])  # [B, T] bool
    return torch.where(keep, l, l.detach()), torch.where(keep, g, torch.zeros_like(g)), keep


def kl_term(x: Tokens, ref_logprobs: torch.Tensor, kl_coef: float):
    """kl_coef * k3(ref || theta) per token [B, T] (with grad) and its d/dlogp (detached)."""
    d = torch.where(x.mask, ref_logprobs.detach().float() - x.logp, torch.zeros_like(x.logp))  # ref - logp
    return kl_coef * (torch.exp(d) - d - 1.0), kl_coef * (1.0 - torch.exp(d.detach()))


# --- the loss ----------------------------------------------------------------------------------


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
    scale: float = 1.0,
) -> PolicyLossOutput:
    """Policy loss of ``method`` over response tokens. Shapes: logprobs, old_logprobs, mask [B, T];
    advantages [B] (one per sequence) or [B, T]; entropy / old_entropy / ref_logprobs [B, T].
    eps_low / eps_high / agg default per method (see :data:`DEFAULT_EPS`, :data:`DEFAULT_AGG`).
    ``scale``: the returned loss is scale * loss (e.g. 1 / gradient_accumulation_steps).
    Formulas: module docstring. ``columns['grad_coef']`` == autograd.grad(loss, logprobs)."""
    agg = DEFAULT_AGG.get(method, "token-mean") if agg is None else agg
    if method in METHODS:
        eps_low, eps_high = resolve_eps(method, eps_low, eps_high)
    scale = float(scale)
    _validate(method, eps_low, eps_high, beta1, beta2, dual_clip, erc, agg, tau, entropy, old_entropy,
              entropy_coef, scale)
    x = _prepare(logprobs, old_logprobs, advantages, mask,
                 {"entropy": entropy, "old_entropy": old_entropy, "ref_logprobs": ref_logprobs})
    w = aggregation_weights(x.mask, agg) * scale  # [B, T], scale folded in

    l, g, clip, slope = surrogate(method, x, eps_low, eps_high, beta1, beta2)
    g_unclipped = -x.advantage * slope  # [B, T]
    changed = clip.clipped
    if method == "cispo":  # cispo's clip changes the slope wherever r leaves the band and A != 0
        changed = (clip.region != CLIP_NONE) & (x.advantage != 0) & x.mask

    columns: dict[str, torch.Tensor] = {}
    dual = None
    if dual_clip is not None:
        l, g, dual = apply_dual_clip(l, g, x, clip, float(dual_clip))
        changed = changed | dual
        columns["dual_clipped"] = dual
    if entropy is not None:
        columns["entropy"] = entropy.detach().float()
    if entropy is not None and old_entropy is not None:
        columns["old_entropy"] = old_entropy.detach().float()
        rho = stats.entropy_ratio(entropy, old_entropy)  # [B, T]
        columns["entropy_ratio"] = rho
        if erc is not None:
            l, g, keep = apply_erc(l, g, rho, erc)
            changed = changed | ~keep
            columns["erc_kept"] = keep
    if ref_logprobs is not None and kl_coef != 0.0:
        kl, kl_slope = kl_term(x, ref_logprobs, kl_coef)
        l, g, g_unclipped = l + kl, g + kl_slope, g_unclipped + kl_slope

    l = torch.where(x.mask, l, torch.zeros_like(l))  # nothing off the mask reaches the loss
    loss = (l * w).sum()
    if entropy_coef != 0.0:
        loss = loss - entropy_coef * (torch.where(x.mask, entropy.float(), torch.zeros_like(w)) * w).sum()

    zero = torch.zeros_like(w)
    prob = torch.exp(x.old)
    quadrant = stats.quadrant(x.advantage, prob, tau=tau)
    columns.update(
        logprob=x.logp.detach(),
        old_logprob=x.old,
        ratio=x.ratio,
        advantage=x.advantage,
        prob=prob,
        quadrant=torch.where(x.mask, quadrant, torch.full_like(quadrant, ZA)),
        clip=clip.region,
        clipped=clip.clipped,
        grad_coef=torch.where(x.mask, g.detach() * w, zero),
        grad_coef_unclipped=torch.where(x.mask, g_unclipped.detach() * w, zero),
        grad_changed=changed & x.mask,
        token_loss=l.detach(),
    )
    config = dict(
        method=method, eps_low=eps_low, eps_high=eps_high, beta1=float(beta1), beta2=float(beta2),
        dual_clip=dual_clip, erc=tuple(erc) if erc is not None else None, agg=agg, tau=tau,
        entropy_coef=entropy_coef, kl_coef=kl_coef, scale=scale,
    )
    checked = {name: t for name, t in (("logprobs", logprobs), ("old_logprobs", old_logprobs),
                                         ("entropy", entropy), ("old_entropy", old_entropy))
               if t is not None and t.dtype != torch.float64}
    checked.update(advantages=advantages, mask=mask)  # advantages were checked as float32
    return PolicyLossOutput(loss=loss, columns=columns, config=config, mask=x.mask, checked=checked)
