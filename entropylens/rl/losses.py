"""Policy losses of the GRPO family, CE-GPPO and ERC, with their per-token columns and step metrics.

Notation (DESIGN.md): logp = log pi_theta(a_t), old = log pi_old(a_t), r = exp(logp - old),
A the advantage, sg = detach, l_t the per-token loss (minimised), g_t = dl_t/dlogp_t,
w_t the aggregation weight, c the ``scale`` (e.g. 1 / gradient_accumulation_steps),
m the mask, L_i = sum_t m_it.
loss = c * (sum_t w_t (P_t l_t + kl_t)) - entropy_coef * sum_t e_t H_t,   e = c w unless given,
with P_t the policy multiplier of the TRL modifiers below (1 without them).

Precision: float64 logprobs / old_logprobs are computed in float64 throughout (every column too);
anything else in float32 (bf16 inputs: float32 maths), as torch would round it.

The loss is built in three stages, each a small function (torchtune style); policy_loss runs
``ratio_of``, ``_surrogate_term``, ``_clip_modifiers`` and ``_entropy_modifiers``, then ``_aggregate``:

1. the ratio q the method clips, and the path its gradient takes (``ratio_of``):
  token level   q = r; dq/dlogp_t = q (the token's own log-prob).
  sequence      ``ratio_level="sequence"`` (TRL's importance_sampling_level="sequence", any method but
                gspo): q = s_i = exp(sum_t m log r / max(L_i, 1)) per sequence, broadcast over its
                tokens, with the gradient THROUGH the mean: d s_i/dlogp_t = s_i m_t / max(L_i, 1).
                So a token's gradient is a sum over its sequence, (m_t / max(L_i, 1)) sum_u c w_u P_u g_u,
                and a token outside token_mask still gets the gradient of its sequence's other tokens.
  gspo          q = s_i (the same value) in GSPO-token form sg(s_i) pi/sg(pi): the gradient is the
                token's own (d/dlogp_t = s_i); cispo at sequence level keeps its own token path too
                (TRL detaches cispo's clipped ratio).
2. one surrogate per method returns the value v [B,T] and the slope g = dl/dlog q [B,T] as two factors
   g = f s (s = q where g is -A q, else 1), all detached; the loss carries
   l = v + f (s exp(log q - sg(log q)) - s): value v, gradient g along q's path (cispo: along its own
   token's log r). Autograd then computes (c w P f) s, the very product grad_coef is (and for -A r the
   same bits as -A exp(log r)):
  grpo / dapo   v = -A q inside or on the unclipped side, g = -A q; -A (1-eps_low) / -A (1+eps_high)
                (constants, g = 0) where PPO-clip removes the gradient:
                clipped_low = q < 1-eps_low and A < 0; clipped_high = q > 1+eps_high and A > 0.
                (Equal to max(-A q, -A clip(q, 1-eps_low, 1+eps_high)).) dapo: eps_high 0.28.
  gppo          same value; clipped tokens keep g = -(1-eps_low) A / -(1+eps_high) A.
  ce_gppo       g = -beta1 (1-eps_low) A on clipped_low, -beta2 (1+eps_high) A on clipped_high,
                -q A otherwise; v = g. gppo is ce_gppo with beta1 = beta2 = 1.
                (l = -A sg(k) exp(log q - sg(log q)): no 1/r, finite when r underflows to 0.)
  cispo         v = -sg(clip(q, 1-eps_low, 1+eps_high)) A logp; g = -clip(q) A (never zero).
  gspo          q = s_i; PPO-clip on s_i (eps 3e-4 / 4e-4); seq-mean-token-mean.
  sapo          soft gate, no hard clip (verl 0.9.1's ``sapo``, TRL's loss_type="sapo"): tau = tau_pos where
                A > 0, else tau_neg; sigma = sigmoid(tau (q - 1)); v = -A (4 / tau) sigma,
                g = -A w q with the gate weight w = 4 sigma (1 - sigma) (1 at q = 1, -> 0 as |q - 1| grows);
                the ``sapo_weight`` column is w. With ``sapo_log_ratio_clamp`` c (verl: 20) log q is clamped to
                [-c, c] first: v uses the clamped q and w = 0 outside (the clamp's zero gradient).
                Seq-mean-token-mean (verl forces it). eps are not used.
  clip_cov      grpo's surrogate (eps 0.2 / 0.2), then Clip-Cov's selection (stage 3; token level).
  kl_cov        v = g = -A q, no clip (clip 0 everywhere), then KL-Cov's penalty (stage 3; token level).
3. modifiers change (v, g) of some tokens (g = 0: f = 0), or the weights:
  dual_clip c   A < 0 and q > c, not PPO-clipped: v = -c A (constant, g = 0)  (== min(l, -c A)).
  delta         TRL's upper clamp of the unclipped term, -min(min(q, delta) A, clip(q) A) (INTELLECT-2),
                as a modifier of every PPO-clip method (grpo, dapo, gppo, ce_gppo, gspo; delta > 1):
                  A < 0, q > max(delta, 1+eps_high): v = -A max(delta, 1+eps_high), g = 0
                  A > 0, delta < q <= 1+eps_high (only when delta < 1+eps_high): v = -A delta, g = 0
                  tokens PPO-clip already clipped keep their gradient; grpo / dapo / gspo's clipped_high
                  constant becomes -A min(delta, 1+eps_high) (TRL's value; gppo / ce_gppo unchanged).
                With delta >= 1+eps_high (TRL's recommendation) that is: not PPO-clipped and q > delta ->
                v = -A delta, g = 0. With dual_clip too, A < 0 is capped at min(c, max(delta, 1+eps_high)).
                Dual-clipped and delta-capped tokens are the ``dual_clipped`` column.
  clip_cov      (cov.py) a random share of the tokens PPO-clip and dual-clip / delta left alone, with
                clip_cov_lb < cov < clip_cov_ub: v = 0, g = 0 (verl multiplies their loss by 0): cov_clipped.
  kl_cov        (cov.py) the top kl_cov_ratio share by cov: v += ppo_kl_coef |log r|, g += ppo_kl_coef
                sign(log r): kl_cov_penalised (changed where sign(log r) != 0).
                Every method: cov = (A - mean A)(logp - mean logp) over the masked-in tokens (column cov).
  erc (lo, hi)  rho = (H + 1e-8)/(H_old + 1e-8); keep = lo < rho < hi; g = 0 outside (l = sg(l)).
  token_mask    TRL's top-entropy-quantile mask: P_t = 0 outside it (value and gradient of the policy
                term); the KL term and the weights (the normaliser) are unchanged.
  seq_mask      TRL's off-policy sequence mask: P_t = 0 on the sequences outside it, the same way.
  is_weight     TRL's vLLM importance-sampling correction: P_t *= sg(is_weight_t) (not on the KL term).
  kl_coef       + kl_coef * k3(ref || theta), k3 = exp(ref - logp) - (ref - logp) - 1,
                local d/dlogp = kl_coef (1 - exp(ref - logp)); with ``kl_bias_correction`` (TRL's
                use_bias_correction_kl) k3 is multiplied by the ratio q WITH its gradient (along q's
                path, before any delta clamp): d/dlogp_t = kl_coef q (1 - exp(ref - logp)) + the path
                of kl_coef k3 q (token level: kl_coef q (logp - ref) in all).
  entropy bonus - entropy_coef * sum_t e_t H_t (gradient through H, not through logp); e =
                ``entropy_weights`` (scale included) or c w.
4. columns and metrics: per-token [B,T] columns named as the schema's token columns, and the step
   metrics named as the schema's steps columns (computed by aggregates.step_aggregates). The modifiers'
   columns, each only when its modifier is given: dual_clipped (dual-clip or delta capped the token),
   token_kept, seq_kept (bool, broadcast), is_weight, sapo_weight (sapo) (all stored in tokens), grad_coef_before_erc
   (with erc: grad_coef just before ERC acted; the recorder splits the dropped entropy effect by cause
   with it, and does not store it).

Unclipped reference (what E3's entropy attribution compares against): the surrogate -A q (gspo: its
token form -A s_it, cispo: -A sg(q) logp) with the same ratio path, weights, scale, P (masks and
is_weight) and KL term (bias-corrected or not) -- those are part of the objective:
  grad_coef_unclipped = path(c w P (-A q)) + the KL term's gradient.
  sapo: clipped is False everywhere (no hard clip), clip is the side of 1 the ratio lies on (-1: q < 1,
  +1: q > 1, 0: q == 1) so the dropped effect splits by side, and grad_changed is w != 1 with A != 0.
  grad_changed = PPO-clip (cispo's clip with A != 0), CE-GPPO/GPPO's bounded slope, dual-clip / delta,
  Clip-Cov (A != 0), KL-Cov or ERC changed the gradient of a token the policy term reaches (P != 0; at sequence level: of any
  such token of its sequence); elsewhere grad_coef == grad_coef_unclipped.
  With erc, grad_coef_before_erc splits the drop: grad_coef_unclipped - grad_coef_before_erc comes from
  clipping (by the token's clip side) or dual-clip / delta (dual_clipped), grad_coef_before_erc -
  grad_coef from ERC. (At sequence level with per-token advantages one sequence may mix causes.)

Aggregation weights w (mask m, L_i = sum_t m_it, B' = sequences with L_i > 0); ``weights`` given
explicitly override ``agg`` (config agg = "weights"):
  token-mean                w = m / sum(m)
  seq-mean-token-mean       w = m / (L_i B')
  seq-mean-token-sum        w = m / B'
  token-sum                 w = m
  seq-mean-token-sum-norm   w = m / B' / loss_scale_factor (verl 0.9.1; default mask.shape[-1])
verl's and TRL's global-batch factors (dp size, global token / sequence counts, accumulation) are the
caller's ``scale``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import torch

from ..schema import CLIP_HIGH, CLIP_LOW, CLIP_NONE, ZA
from . import stats
from .cov import (
    CLIP_COV_LB,
    CLIP_COV_RATIO,
    CLIP_COV_UB,
    COV_METHODS,
    KL_COV_RATIO,
    PPO_KL_COEF,
    clip_cov_select,
    kl_cov_penalty,
    kl_cov_select,
    token_covariance,
)

METHODS: tuple[str, ...] = ("grpo", "dapo", "gppo", "ce_gppo", "cispo", "gspo", "sapo", *COV_METHODS)
AGGS: tuple[str, ...] = (
    "token-mean",
    "seq-mean-token-mean",
    "seq-mean-token-sum",
    "token-sum",
    "seq-mean-token-sum-norm",
)
RATIO_LEVELS: tuple[str, ...] = ("token", "sequence")
PPO_CLIP_METHODS: tuple[str, ...] = ("grpo", "dapo", "gppo", "ce_gppo", "gspo", "clip_cov")  # dual_clip and delta apply
DEFAULT_EPS: dict[str, tuple[float, float]] = {
    "grpo": (0.2, 0.2),
    "dapo": (0.2, 0.28),
    "gppo": (0.2, 0.2),
    "ce_gppo": (0.2, 0.2),
    "cispo": (0.2, 0.2),
    "gspo": (3e-4, 4e-4),
    "sapo": (0.2, 0.2),  # not used by the loss (no clip band); kept for the recorder's run settings
    "clip_cov": (0.2, 0.2),  # verl's clip_ratio
    "kl_cov": (0.2, 0.2),  # recorded, unused: kl_cov clips nothing
}
DEFAULT_AGG: dict[str, str] = {m: ("seq-mean-token-mean" if m in ("gspo", "sapo") else "token-mean") for m in METHODS}
SAPO_TAUS: tuple[float, float] = (1.0, 1.05)  # verl 0.9.1's tau_pos / tau_neg, TRL's sapo_temperature_pos / _neg


@dataclass
class PolicyLossOutput:
    """loss: scalar (scale included); columns: per-token [B, T] detached tensors named as the schema's
    token columns (float64 for float64 inputs), plus dual_clipped / token_kept / seq_kept / is_weight /
    grad_coef_before_erc where their modifier is given, sapo_weight for method="sapo" (module docstring);
    metrics: 0-dim detached tensors on the device named as the schema's steps columns (computed on first access;
    :meth:`scalars` gives floats with one host copy); config: the resolved hyperparameters (method,
    eps_low, eps_high, ...)."""

    loss: torch.Tensor
    columns: dict[str, torch.Tensor]
    config: dict = field(default_factory=dict)
    mask: torch.Tensor | None = None
    # the inputs found finite at masked-in positions as float32 (float64 inputs computed in float64 are
    # left out: their finite values may overflow float32), by argument name, with "mask" the mask
    # argument: the recorder does not check these tensors again when it is given the same objects
    checked: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)
    _metrics: dict[str, torch.Tensor] | None = field(default=None, repr=False)

    @property
    def metrics(self) -> dict[str, torch.Tensor]:
        if self._metrics is None:
            from .aggregates import step_metrics

            assert self.mask is not None, "PolicyLossOutput.metrics needs the mask (policy_loss sets it)"
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
RUN_SETTINGS: tuple[str, ...] = ("method", "eps_low", "eps_high", "agg", "tau", "sapo_tau_pos", "sapo_tau_neg")


def update_settings(config: dict) -> dict[str, float]:
    """The per-update settings of a resolved loss ``config`` (PolicyLossOutput.config) that apply:
    beta1 / beta2 for ce_gppo only; dual_clip, erc_low / erc_high, entropy_coef, kl_coef where set;
    loss_scale where not 1; with adaptive entropy control (``entropy_coef_adaptive`` in the config: the
    controller's coefficient) entropy_coef is the applied one, 0 included. Keys are steps columns (schema.STEPS). (delta, ratio_level and
    kl_bias_correction have no steps column: they stay in the config.)"""
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
    if config.get("entropy_coef_adaptive") is not None:  # adaptive control: the applied coefficient, 0 included
        out["entropy_coef"] = float(config.get("entropy_coef") or 0.0)
        out["entropy_coef_adaptive"] = float(config["entropy_coef_adaptive"])
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
    """The loss's inputs, checked and shaped: everything [B, T], in the computation dtype."""

    mask: torch.Tensor  # [B, T] bool
    advantage: torch.Tensor  # [B, T] float, detached, 0 off the mask
    logp: torch.Tensor  # [B, T] float, carries grad
    old: torch.Tensor  # [B, T] float, detached
    log_ratio: torch.Tensor  # [B, T] logp - old, 0 off the mask, carries grad

    @property
    def ratio(self) -> torch.Tensor:  # [B, T] detached r
        return torch.exp(self.log_ratio.detach())

    @property
    def dtype(self) -> torch.dtype:
        return self.logp.dtype


@dataclass
class Ratio:
    """The ratio q a method clips and the path of its gradient (module docstring, stage 1)."""

    value: torch.Tensor  # [B, T] detached q: r, or s_i broadcast over the sequence
    unit: torch.Tensor  # exp(log q - sg(log q)): value 1, d/dlog q = 1; [B, T] (token path) or [B, 1]
    sequence: bool  # the gradient runs through the sequence mean (d log q / dlogp_t = m_t / max(L_i, 1))


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
    """One device sync for all inputs: NaN/Inf at masked-in positions is an error ([B, 1] inputs are
    checked on every sequence with a masked-in token)."""
    flags = torch.stack([(~torch.isfinite(t.detach()) & mask).any() for t in named.values()])
    bad = flags.cpu().tolist()
    for (name, _), b in zip(named.items(), bad):
        if b:
            raise ValueError(f"{name} contains NaN or Inf at masked-in (response) positions")


def _finite_number(name: str, v) -> float:
    try:
        v = float(v)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number, got {v!r}") from None
    if not math.isfinite(v):
        raise ValueError(f"{name} must be finite, got {v}")
    return v


def _validate(
    method,
    eps_low,
    eps_high,
    beta1,
    beta2,
    dual_clip,
    erc,
    agg,
    tau,
    entropy,
    old_entropy,
    entropy_coef,
    scale,
    delta=None,
    ratio_level="token",
    loss_scale_factor=None,
):
    if method not in METHODS:
        raise ValueError(f"method: unknown {method!r}; valid methods: {', '.join(METHODS)}")
    if agg not in AGGS and agg != "weights":
        raise ValueError(f"agg: unknown {agg!r}; valid: {', '.join(AGGS)}")
    if not (0.0 <= eps_low < 1.0) or not math.isfinite(eps_low):
        raise ValueError(f"eps_low must be in [0, 1), got {eps_low}")
    if not (0.0 <= eps_high) or not math.isfinite(eps_high):
        raise ValueError(f"eps_high must be a finite number >= 0, got {eps_high}")
    if not (beta1 >= 0 and beta2 >= 0) or not (math.isfinite(beta1) and math.isfinite(beta2)):
        raise ValueError(f"beta1 and beta2 must be finite and >= 0, got {beta1}, {beta2}")
    if dual_clip is not None:
        if method in ("cispo", "sapo"):
            raise ValueError(f"dual_clip does not apply to {method} (its loss is not a clipped surrogate)")
        if not dual_clip > 1.0:
            raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
    if delta is not None:
        if method not in PPO_CLIP_METHODS:
            raise ValueError(
                f"delta applies to PPO-clip methods only ({', '.join(PPO_CLIP_METHODS)}), "
                f"not {method} (TRL applies it only to its PPO-clip loss types)"
            )
        if not _finite_number("delta", delta) > 1.0:
            raise ValueError(f"delta must be > 1 (TRL recommends > 1 + epsilon_high), got {delta}")
    if ratio_level not in RATIO_LEVELS:
        raise ValueError(f"ratio_level: unknown {ratio_level!r}; valid: {', '.join(RATIO_LEVELS)}")
    if ratio_level == "sequence" and method == "gspo":
        raise ValueError(
            "ratio_level='sequence' does not apply to gspo (its ratio is already the sequence "
            "ratio, in GSPO-token form); use method='grpo' with ratio_level='sequence' for TRL's form"
        )
    if loss_scale_factor is not None:
        if agg != "seq-mean-token-sum-norm":
            raise ValueError(f"loss_scale_factor applies only to agg='seq-mean-token-sum-norm', not {agg!r}")
        if not _finite_number("loss_scale_factor", loss_scale_factor) > 0:
            raise ValueError(f"loss_scale_factor must be > 0, got {loss_scale_factor}")
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


def compute_dtype(logprobs: torch.Tensor, old_logprobs: torch.Tensor) -> torch.dtype:
    """float64 when logprobs or old_logprobs is float64, else float32 (bf16 / fp16 inputs too)."""
    return torch.float64 if torch.float64 in (logprobs.dtype, old_logprobs.dtype) else torch.float32


def _check_shape(name: str, t: torch.Tensor | None, shape: tuple[int, ...], per_seq: bool = False) -> None:
    """t must be [B, T] (``per_seq``: or [B] / [B, 1])."""
    if t is None:
        return
    ok = tuple(t.shape) == shape
    if per_seq:
        ok = ok or tuple(t.shape) in ((shape[0],), (shape[0], 1))
    if not ok:
        want = f"[B, T] = {list(shape)}" + (f" or [B] / [B, 1] with B = {shape[0]}" if per_seq else "")
        raise ValueError(f"{name} shape {tuple(t.shape)} does not match: expected {want}")


def _in_dtype(t: torch.Tensor, dt: torch.dtype) -> torch.Tensor:
    """What the finite check looks at: float64 inputs as the computation will hold them (float32
    maths: a float64 value that overflows float32 is Inf), others as they are."""
    return t.detach().to(dt) if t.dtype == torch.float64 else t.detach()


def _prepare(
    logprobs,
    old_logprobs,
    advantages,
    mask,
    extra: dict[str, torch.Tensor | None],
    finite_extra: dict[str, torch.Tensor | None] | None = None,
) -> Tokens:
    """Shapes checked, one finite check (``extra``: [B, T] inputs that are columns too; ``finite_extra``:
    other inputs checked for finiteness, shapes checked by the caller), cast to the computation dtype."""
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must be [B, T], got shape {tuple(logprobs.shape)}")
    shape = tuple(logprobs.shape)
    for name, t in (("old_logprobs", old_logprobs), ("mask", mask), *extra.items()):
        if t is not None and tuple(t.shape) != shape:
            raise ValueError(f"{name} shape {tuple(t.shape)} does not match logprobs shape {shape}")
    dt = compute_dtype(logprobs, old_logprobs)
    if advantages.dim() == 1:
        if advantages.shape[0] != shape[0]:
            raise ValueError(f"advantages shape {tuple(advantages.shape)} does not match batch size {shape[0]}")
        adv = advantages.detach().to(dt).unsqueeze(1).expand(shape)  # [B, T]
    elif tuple(advantages.shape) == shape:
        adv = advantages.detach().to(dt)  # [B, T]
    else:
        raise ValueError(f"advantages must be [B] or [B, T] = {shape}, got {tuple(advantages.shape)}")
    m = mask.bool()
    inputs = {"logprobs": _in_dtype(logprobs, dt), "old_logprobs": _in_dtype(old_logprobs, dt), "advantages": adv}
    for name, t in (*extra.items(), *(finite_extra or {}).items()):
        if t is not None:
            inputs[name] = _in_dtype(t, dt)
    _check_finite(inputs, m)
    zero = torch.zeros((), dtype=dt, device=adv.device)
    logp = logprobs.to(dt)
    old = old_logprobs.detach().to(dt)
    log_ratio = torch.where(m, logp - old, zero)
    return Tokens(mask=m, advantage=torch.where(m, adv, zero), logp=logp, old=old, log_ratio=log_ratio)


def aggregation_weights(
    mask: torch.Tensor, agg: str, loss_scale_factor: float | None = None, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """w [B, T] (``dtype``) such that loss = sum(w * l). See the module docstring."""
    m = mask.to(dtype)
    if agg == "token-mean":
        return m / m.sum().clamp(min=1.0)
    if agg == "token-sum":
        return m
    lengths = m.sum(dim=-1, keepdim=True)  # [B, 1]
    n_seq = (lengths > 0).sum().clamp(min=1).to(dtype)
    if agg == "seq-mean-token-mean":
        return m / (lengths.clamp(min=1.0) * n_seq)
    if agg == "seq-mean-token-sum-norm":  # verl's agg_loss: seq-mean-token-sum, then / loss_scale_factor
        return m / n_seq / float(mask.shape[-1] if loss_scale_factor is None else loss_scale_factor)
    return m / n_seq  # seq-mean-token-sum


# --- stage 1: the ratio and its path -----------------------------------------------------------


def unit(log_ratio: torch.Tensor) -> torch.Tensor:
    """exp(log r - sg(log r)): value 1, d/dlogp = 1, finite for any finite log r. [B, T]"""
    return torch.exp(log_ratio - log_ratio.detach())


def _lengths(x: Tokens) -> torch.Tensor:
    return x.mask.to(x.dtype).sum(-1, keepdim=True).clamp(min=1.0)  # [B, 1] max(L_i, 1)


def gspo_ratio(x: Tokens) -> torch.Tensor:
    """s_i = exp(mean_t log r_it) per sequence, broadcast to [B, T], detached."""
    return torch.exp(x.log_ratio.detach().sum(-1, keepdim=True) / _lengths(x)).expand_as(x.log_ratio)  # [B, T]


def ratio_of(method: str, x: Tokens, ratio_level: str = "token") -> Ratio:
    """The ratio ``method`` clips and its gradient path (module docstring, stage 1)."""
    if method == "gspo":
        return Ratio(value=gspo_ratio(x), unit=unit(x.log_ratio), sequence=False)
    if ratio_level == "sequence":
        log_s = x.log_ratio.sum(-1, keepdim=True) / _lengths(x)  # [B, 1], carries grad (TRL's form)
        return Ratio(value=torch.exp(log_s.detach()).expand_as(x.log_ratio), unit=unit(log_s), sequence=True)
    return Ratio(value=x.ratio, unit=unit(x.log_ratio), sequence=False)


def along(x: Tokens, coef: torch.Tensor, sequence: bool) -> torch.Tensor:
    """d loss / dlogp [B, T] of a term whose d loss / dlog q is ``coef`` [B, T] (weights included):
    itself on the token path; (m_t / max(L_i, 1)) sum_u coef_u on the sequence path."""
    if not sequence:
        return coef
    return torch.where(x.mask, coef.sum(-1, keepdim=True) / _lengths(x), torch.zeros_like(coef))


def clip_of(x: Tokens, ratio: torch.Tensor, eps_low: float, eps_high: float) -> Clip:
    region = stats.clip_region(ratio, eps_low, eps_high)  # [B, T] int8
    low = (region == CLIP_LOW) & (x.advantage < 0) & x.mask
    high = (region == CLIP_HIGH) & (x.advantage > 0) & x.mask
    return Clip(ratio=ratio, region=region, low=low, high=high, eps_low=eps_low, eps_high=eps_high)


# --- stage 2: surrogates, as (value, slope) ----------------------------------------------------


def ppo_clip_surrogate(x: Tokens, clip: Clip) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """grpo / dapo / gspo: v = -A q, g = -A q unclipped; v = the constant -A (1 -/+ eps), g = 0 clipped.
    Returns (v, f, s) with g = f s: f = -A (0 clipped), s = q."""
    a, q = x.advantage, clip.ratio
    v = torch.where(clip.low, -a * (1.0 - clip.eps_low), torch.where(clip.high, -a * (1.0 + clip.eps_high), -a * q))
    f = torch.where(clip.clipped, torch.zeros_like(a), -a)
    return v, f, q


def ce_gppo_surrogate(x: Tokens, clip: Clip, beta1: float, beta2: float) -> tuple[torch.Tensor, torch.Tensor, None]:
    """gppo (beta1 = beta2 = 1) and ce_gppo: v = g = -A k with k = beta1 (1-eps_low) on clipped_low,
    beta2 (1+eps_high) on clipped_high, q elsewhere. Returns (v, g, None) (g = f, s = 1)."""
    k = torch.where(
        clip.low,
        torch.full_like(clip.ratio, beta1 * (1.0 - clip.eps_low)),
        torch.where(clip.high, torch.full_like(clip.ratio, beta2 * (1.0 + clip.eps_high)), clip.ratio),
    )
    g = -x.advantage * k  # [B, T] detached
    return g, g, None


def cispo_surrogate(x: Tokens, clip: Clip) -> tuple[torch.Tensor, torch.Tensor, None]:
    """v = -sg(clip(q, 1-eps_low, 1+eps_high)) A logp; g = -clip(q) A. Returns (v, g, None)."""
    g = -clip.ratio.clamp(1.0 - clip.eps_low, 1.0 + clip.eps_high) * x.advantage
    logp = torch.where(x.mask, x.logp.detach(), torch.zeros_like(g))
    return g * logp, g, None


def sapo_surrogate(
    x: Tokens,
    ratio: Ratio,
    tau_pos: float,
    tau_neg: float,
    log_ratio_clamp: float | None,
    eps_low: float,
    eps_high: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Clip, torch.Tensor]:
    """SAPO's soft gate on q (module docstring, stage 2): tau = tau_pos (A > 0) / tau_neg (A <= 0),
    sigma = sigmoid(tau (q - 1)), v = -A (4 / tau) sigma, g = f s with f = -A w, s = q,
    w = 4 sigma (1 - sigma) (0 where ``log_ratio_clamp`` cut log q: the clamp's zero gradient).
    Returns (v, f, s, clip, w), all [B, T] detached; clip: the side of 1 of q, nothing clipped."""
    a, q = x.advantage, ratio.value
    taus = torch.where(a > 0, torch.full_like(q, tau_pos), torch.full_like(q, tau_neg))  # [B, T]
    cut = torch.zeros_like(x.mask)
    if log_ratio_clamp is not None:  # exp(clamp(log q, -c, c)) == clamp(q, exp(-c), exp(c)): exp is monotone
        lo, hi = torch.exp(torch.tensor([-log_ratio_clamp, log_ratio_clamp], dtype=q.dtype, device=q.device))
        cut = (q < lo) | (q > hi)
        q = torch.minimum(torch.maximum(q, lo), hi)
    sigma = torch.sigmoid(taus * (q - 1.0))  # [B, T]
    v = -(sigma * (4.0 / taus)) * a
    w = torch.where(cut, torch.zeros_like(q), 4.0 * sigma * (1.0 - sigma))  # [B, T] the gate weight
    region = torch.sign(q - 1.0).to(torch.int8)  # CLIP_LOW -1 / CLIP_NONE 0 / CLIP_HIGH +1: the side of 1
    none = torch.zeros_like(x.mask)
    clip = Clip(ratio=q, region=region, low=none, high=none, eps_low=eps_low, eps_high=eps_high)
    return v, -a * w, q, clip, w


def _check_sapo(tau_pos, tau_neg, log_ratio_clamp) -> tuple[float, float, float | None]:
    pos, neg = _finite_number("sapo_tau_pos", tau_pos), _finite_number("sapo_tau_neg", tau_neg)
    if not (pos > 0 and neg > 0):
        raise ValueError(f"sapo_tau_pos and sapo_tau_neg must be > 0, got {pos}, {neg}")
    if log_ratio_clamp is not None and not _finite_number("sapo_log_ratio_clamp", log_ratio_clamp) > 0:
        raise ValueError(f"sapo_log_ratio_clamp must be > 0 or None, got {log_ratio_clamp}")
    return pos, neg, None if log_ratio_clamp is None else float(log_ratio_clamp)


def surrogate(
    method: str, x: Tokens, ratio: Ratio, eps_low: float, eps_high: float, beta1: float, beta2: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, Clip]:
    """(v [B,T], f [B,T], s [B,T] or None, clip) of ``method`` on ``ratio`` (module docstring, stage 2):
    the slope is g = f s (s None: 1), all detached."""
    clip = clip_of(x, ratio.value, eps_low, eps_high)
    if method == "kl_cov":  # no clip: v = g = -A q, every token inside (clip 0)
        clip = Clip(
            ratio=clip.ratio,
            region=torch.zeros_like(clip.region),
            low=torch.zeros_like(clip.low),
            high=torch.zeros_like(clip.high),
            eps_low=eps_low,
            eps_high=eps_high,
        )
        g = -x.advantage * clip.ratio
        return g, g, None, clip
    s: torch.Tensor | None  # g = f s; None: s = 1
    if method in ("grpo", "dapo", "gspo", "clip_cov"):
        v, f, s = ppo_clip_surrogate(x, clip)
    elif method in ("gppo", "ce_gppo"):
        b1, b2 = (1.0, 1.0) if method == "gppo" else (float(beta1), float(beta2))
        v, f, s = ce_gppo_surrogate(x, clip, b1, b2)
    else:
        v, f, s = cispo_surrogate(x, clip)
    return v, f, s, clip


# --- stage 3: modifiers ------------------------------------------------------------------------


def apply_caps(v, f, x: Tokens, clip: Clip, dual_clip: float | None, delta: float | None, clipped_value: bool = True):
    """Dual-clip and delta (module docstring): tokens PPO-clip has not clipped whose ratio exceeds their
    cap get v = -A cap, g = 0 (A < 0: cap = min(c, max(delta, 1+eps_high)); A > 0: cap = delta).
    ``clipped_value`` (grpo / dapo / gspo): with delta < 1+eps_high the clipped_high constant becomes
    -A delta, as TRL's value. ``f``: the slope's factor (g = f s), zeroed. Returns (v, f, capped [B, T] bool)."""
    a, q = x.advantage, clip.ratio
    hi = 1.0 + clip.eps_high
    caps = [c for c in (dual_clip, None if delta is None else max(float(delta), hi)) if c is not None]
    free = x.mask & ~clip.clipped
    capped = torch.zeros_like(x.mask)
    if caps:
        c_neg = min(caps)
        neg = free & (a < 0) & (q > c_neg)
        v = torch.where(neg, -a * c_neg, v)
        capped = neg
    if delta is not None and delta < hi:
        pos = free & (a > 0) & (q > delta)
        v = torch.where(pos, -a * float(delta), v)
        capped = capped | pos
        if clipped_value:
            v = torch.where(clip.high, -a * float(delta), v)
    f = torch.where(capped, torch.zeros_like(f), f)
    return v, f, capped


def apply_erc(f, rho: torch.Tensor, band: tuple[float, float]):
    """Keep the gradient (``f``, the slope's factor) iff band[0] < rho < band[1]; the value stays
    (l -> sg(l) outside)."""
    keep = (rho > band[0]) & (rho < band[1])  # [B, T] bool
    return torch.where(keep, f, torch.zeros_like(f)), keep


def entropy_ratio(entropy: torch.Tensor, old_entropy: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """rho = (H + 1e-8) / (H_old + 1e-8) (stats.entropy_ratio) in ``dtype`` (float32: its very bits)."""
    if dtype == torch.float32:
        return stats.entropy_ratio(entropy, old_entropy)
    return (entropy.detach().to(dtype) + 1e-8) / (old_entropy.detach().to(dtype) + 1e-8)


def kl_term(x: Tokens, ref_logprobs: torch.Tensor, kl_coef: float, ratio: Ratio | None = None):
    """kl_coef * k3(ref || theta) per token [B, T] (with grad; ``ratio``: times q with its gradient, TRL's
    bias correction), its local d/dlogp and its d/dlog q (None without ``ratio``), both detached."""
    d = torch.where(x.mask, ref_logprobs.detach().to(x.dtype) - x.logp, torch.zeros_like(x.logp))  # ref - logp
    kl = kl_coef * (torch.exp(d) - d - 1.0)
    local = kl_coef * (1.0 - torch.exp(d.detach()))
    if ratio is None:
        return kl, local, None
    return kl * (ratio.value * ratio.unit), local * ratio.value, kl.detach() * ratio.value


def cov_settings(
    method: str, clip_cov_ratio, clip_cov_lb, clip_cov_ub, kl_cov_ratio, ppo_kl_coef, ratio_level: str, dual_clip, delta
) -> dict:
    """The resolved Clip-Cov / KL-Cov settings of ``method`` (cov.py; defaults verl's), checked; {} for
    the other methods."""
    if method not in COV_METHODS:
        return {}
    if ratio_level != "token":
        raise ValueError(f"{method} is token-level (verl's): ratio_level must be 'token', got {ratio_level!r}")
    if method == "clip_cov":
        out = dict(
            clip_cov_ratio=float(CLIP_COV_RATIO if clip_cov_ratio is None else clip_cov_ratio),
            clip_cov_lb=float(CLIP_COV_LB if clip_cov_lb is None else clip_cov_lb),
            clip_cov_ub=float(CLIP_COV_UB if clip_cov_ub is None else clip_cov_ub),
        )
        if not out["clip_cov_lb"] < out["clip_cov_ub"]:
            raise ValueError(f"clip_cov_lb must be < clip_cov_ub, got {out['clip_cov_lb']}, {out['clip_cov_ub']}")
        ratio_key = "clip_cov_ratio"
    else:
        if dual_clip is not None or delta is not None:
            raise ValueError("dual_clip and delta do not apply to kl_cov (its surrogate -A r is not clipped)")
        out = dict(
            kl_cov_ratio=float(KL_COV_RATIO if kl_cov_ratio is None else kl_cov_ratio),
            ppo_kl_coef=float(PPO_KL_COEF if ppo_kl_coef is None else ppo_kl_coef),
        )
        if not (math.isfinite(out["ppo_kl_coef"]) and out["ppo_kl_coef"] >= 0):
            raise ValueError(f"ppo_kl_coef must be a finite number >= 0, got {out['ppo_kl_coef']}")
        ratio_key = "kl_cov_ratio"
    if not 0.0 < out[ratio_key] <= 1.0:
        raise ValueError(f"{ratio_key} must be in (0, 1], got {out[ratio_key]}")
    return out


def apply_cov(
    method: str,
    x: Tokens,
    clip: Clip,
    v,
    f,
    cov: torch.Tensor,
    capped: torch.Tensor | None,
    settings: dict,
    generator: torch.Generator | None,
):
    """Clip-Cov / KL-Cov on (v, f) (cov.py): clip_cov zeroes value and slope of its random selection
    among the tokens PPO-clip (and dual-clip / delta) left alone; kl_cov adds ppo_kl_coef |log r| (slope
    ppo_kl_coef sign(log r)) on its top-cov tokens (its f is the whole slope: s = None). Returns
    (v, f, changed [B, T] bool: the tokens whose gradient the control changed, column name, selection)."""
    if method == "clip_cov":
        free = ~clip.clipped if capped is None else ~clip.clipped & ~capped
        sel = clip_cov_select(
            cov, free, x.mask, settings["clip_cov_ratio"], settings["clip_cov_lb"], settings["clip_cov_ub"], generator
        )
        zero = torch.zeros_like(v)
        return torch.where(sel, zero, v), torch.where(sel, zero, f), sel & (x.advantage != 0), "cov_clipped", sel
    sel = kl_cov_select(cov, x.mask, settings["kl_cov_ratio"])
    pv, pg = kl_cov_penalty(x.log_ratio, sel, settings["ppo_kl_coef"])
    return v + pv, f + pg, sel & (pg != 0), "kl_cov_penalised", sel


def _policy_multiplier(x: Tokens, token_mask, seq_mask, is_weight) -> tuple[torch.Tensor | None, dict]:
    """P [B, T] (None without the modifiers) and its columns: token_kept, seq_kept, is_weight."""
    cols: dict[str, torch.Tensor] = {}
    shape = x.mask.shape
    p = None
    if token_mask is not None:
        cols["token_kept"] = token_mask.detach().bool() if token_mask.dtype == torch.bool else token_mask.detach() != 0
        p = cols["token_kept"].to(x.dtype)
    if seq_mask is not None:
        s = seq_mask.detach().reshape(shape[0], 1)
        cols["seq_kept"] = (s.bool() if s.dtype == torch.bool else s != 0).expand(shape)
        sk = cols["seq_kept"].to(x.dtype)
        p = sk if p is None else p * sk
    if is_weight is not None:
        iw = is_weight.detach().to(x.dtype)
        iw = iw.reshape(shape[0], 1).expand(shape) if iw.dim() == 1 or iw.shape[1] != shape[1] else iw
        cols["is_weight"] = iw
        p = iw if p is None else p * iw
    return p, cols


# --- the loss's settings and inputs ------------------------------------------------------------


@dataclass(frozen=True)
class Settings:
    """policy_loss's hyperparameters with the method's defaults filled in, checked
    (:func:`_resolve_settings`). The others are kept as the caller gave them; :meth:`config` converts
    beta1 / beta2, erc and kl_bias_correction as it records them."""

    method: str
    eps_low: float
    eps_high: float
    beta1: float
    beta2: float
    dual_clip: float | None
    erc: tuple[float, float] | None
    agg: str  # one of AGGS, or "weights" (explicit weights given)
    tau: float
    entropy_coef: float
    kl_coef: float
    scale: float
    delta: float | None
    ratio_level: str
    kl_bias_correction: bool
    loss_scale_factor: float | None
    cov: dict  # cov_settings(): the resolved clip_cov / kl_cov settings, {} for the other methods

    def config(self, sapo: tuple[float, float, float | None] | None, width: int) -> dict:
        """PolicyLossOutput.config: the resolved hyperparameters; ``sapo``: sapo's checked settings (method
        sapo), ``width``: T, the default loss_scale_factor of agg seq-mean-token-sum-norm."""
        config = dict(
            method=self.method,
            eps_low=self.eps_low,
            eps_high=self.eps_high,
            beta1=float(self.beta1),
            beta2=float(self.beta2),
            dual_clip=self.dual_clip,
            erc=tuple(self.erc) if self.erc is not None else None,
            agg=self.agg,
            tau=self.tau,
            entropy_coef=self.entropy_coef,
            kl_coef=self.kl_coef,
            scale=self.scale,
            delta=self.delta,
            ratio_level=self.ratio_level,
            kl_bias_correction=bool(self.kl_bias_correction),
            **self.cov,
        )
        if sapo is not None:
            config.update(sapo_tau_pos=sapo[0], sapo_tau_neg=sapo[1], sapo_log_ratio_clamp=sapo[2])
        if self.agg == "seq-mean-token-sum-norm":
            config["loss_scale_factor"] = float(width if self.loss_scale_factor is None else self.loss_scale_factor)
        return config


def _resolve_settings(
    method: str,
    eps_low: float | None,
    eps_high: float | None,
    beta1: float,
    beta2: float,
    dual_clip: float | None,
    erc: tuple[float, float] | None,
    agg: str | None,
    tau: float,
    entropy_coef: float,
    kl_coef: float,
    scale: float,
    delta: float | None,
    ratio_level: str,
    kl_bias_correction: bool,
    loss_scale_factor: float | None,
    explicit_weights: bool,
    entropies: tuple[torch.Tensor | None, torch.Tensor | None],
    cov: tuple[float | None, float | None, float | None, float | None, float | None],
) -> Settings:
    """The settings of policy_loss resolved and checked: agg defaults to the method's (DEFAULT_AGG),
    explicit weights make it "weights" (loss_scale_factor dropped), eps the method's (resolve_eps); then
    _validate (``entropies``: entropy, old_entropy, which erc and the entropy bonus need) and cov_settings
    (``cov``: clip_cov_ratio, clip_cov_lb, clip_cov_ub, kl_cov_ratio, ppo_kl_coef). Raises ValueError
    (policy_loss's Raises)."""
    agg = DEFAULT_AGG.get(method, "token-mean") if agg is None else agg
    if explicit_weights:
        agg, loss_scale_factor = "weights", None
    if method in METHODS:
        eps_low, eps_high = resolve_eps(method, eps_low, eps_high)
    scale = float(scale)
    delta = None if delta is None else _finite_number("delta", delta)
    entropy, old_entropy = entropies
    _validate(
        method,
        eps_low,
        eps_high,
        beta1,
        beta2,
        dual_clip,
        erc,
        agg,
        tau,
        entropy,
        old_entropy,
        entropy_coef,
        scale,
        delta,
        ratio_level,
        loss_scale_factor,
    )
    cov_cfg = cov_settings(method, *cov, ratio_level, dual_clip, delta)
    assert eps_low is not None and eps_high is not None  # _validate: method is known, so resolve_eps set them
    return Settings(
        method=method,
        eps_low=eps_low,
        eps_high=eps_high,
        beta1=beta1,
        beta2=beta2,
        dual_clip=dual_clip,
        erc=erc,
        agg=agg,
        tau=tau,
        entropy_coef=entropy_coef,
        kl_coef=kl_coef,
        scale=scale,
        delta=delta,
        ratio_level=ratio_level,
        kl_bias_correction=kl_bias_correction,
        loss_scale_factor=loss_scale_factor,
        cov=cov_cfg,
    )


def _tokens(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    columns: dict[str, torch.Tensor | None],
    modifiers: dict[str, torch.Tensor | None],
) -> Tokens:
    """policy_loss's tensors checked and cast (:func:`_prepare`): ``columns``, [B, T] inputs that are
    columns too (entropy, old_entropy, ref_logprobs, weights, entropy_weights); ``modifiers``: token_mask
    [B, T], seq_mask and is_weight [B, T], [B] or [B, 1]. Raises ValueError on a shape that does not
    match or NaN / Inf at a masked-in position."""
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must be [B, T], got shape {tuple(logprobs.shape)}")
    shape = tuple(logprobs.shape)
    _check_shape("token_mask", modifiers["token_mask"], shape)
    _check_shape("seq_mask", modifiers["seq_mask"], shape, per_seq=True)
    is_weight = modifiers["is_weight"]
    _check_shape("is_weight", is_weight, shape, per_seq=True)
    finite_extra = {"is_weight": None if is_weight is None else is_weight.reshape(shape[0], -1)}
    return _prepare(logprobs, old_logprobs, advantages, mask, columns, finite_extra)


def _finite_checked(
    named: dict[str, torch.Tensor | None], mask: torch.Tensor, dt: torch.dtype
) -> dict[str, torch.Tensor]:
    """PolicyLossOutput.checked: the inputs of ``named`` (not None) the finite check saw as they are, i.e.
    all but float64 ones computed in float64 (``dt``), then the mask as "mask"."""
    checked = {
        name: t for name, t in named.items() if t is not None and (t.dtype != torch.float64 or dt == torch.float32)
    }
    checked["mask"] = mask
    return checked


# --- stages 2 and 3 on the policy term ---------------------------------------------------------


@dataclass(frozen=True)
class PolicyTerm:
    """The policy term of each token before the weights (module docstring, stages 2 and 3), all [B, T]
    detached: l = v + f (s exp(log q - sg(log q)) - s), its value v and its slope g = dl/dlog q = f s."""

    v: torch.Tensor  # the value
    f: torch.Tensor  # the slope's factor (0: no gradient)
    s: torch.Tensor | None  # the slope's other factor, q where g is -A q (None: 1)
    clip: Clip
    changed: torch.Tensor  # bool: a stage changed the token's slope (clip, caps, cov, ERC)
    columns: dict[str, torch.Tensor]  # the stages' columns, in order (sapo_weight, dual_clipped, cov, ...)
    f_before_erc: torch.Tensor | None = None  # f before ERC acted (with erc only)


def _surrogate_term(
    settings: Settings, x: Tokens, ratio: Ratio, sapo: tuple[float, float, float | None] | None
) -> PolicyTerm:
    """Stage 2: the method's surrogate on ``ratio`` as (v, f, s) and its clip (sapo: the soft gate with
    its checked settings ``sapo``, column sapo_weight). changed: the clipped tokens (PPO-clip; cispo: q
    outside the band with A != 0; sapo: gate weight != 1 with A != 0)."""
    method = settings.method
    columns: dict[str, torch.Tensor] = {}
    s: torch.Tensor | None  # g = f s; None: s = 1
    if sapo is not None:  # method == "sapo"
        v, f, s, clip, columns["sapo_weight"] = sapo_surrogate(x, ratio, *sapo, settings.eps_low, settings.eps_high)
        changed = (columns["sapo_weight"] != 1.0) & (x.advantage != 0) & x.mask
    else:
        v, f, s, clip = surrogate(method, x, ratio, settings.eps_low, settings.eps_high, settings.beta1, settings.beta2)
        changed = clip.clipped
    if method == "cispo":  # cispo's clip changes the slope wherever q leaves the band and A != 0
        changed = (clip.region != CLIP_NONE) & (x.advantage != 0) & x.mask
    return PolicyTerm(v=v, f=f, s=s, clip=clip, changed=changed, columns=columns)


def _clip_modifiers(settings: Settings, x: Tokens, term: PolicyTerm, generator: torch.Generator | None) -> PolicyTerm:
    """Stage 3 on the clipped surrogate: dual-clip / delta (:func:`apply_caps`, column dual_clipped),
    then Clip-Cov / KL-Cov (:func:`apply_cov` on cov = (A - mean A)(logp - mean logp), columns cov and
    cov_clipped / kl_cov_penalised; ``generator``: Clip-Cov's draw)."""
    v, f, changed, columns = term.v, term.f, term.changed, dict(term.columns)
    dual_clip, delta = settings.dual_clip, settings.delta
    if dual_clip is not None or delta is not None:
        dual = None if dual_clip is None else float(dual_clip)
        clipped_value = settings.method in ("grpo", "dapo", "gspo")
        v, f, capped = apply_caps(v, f, x, term.clip, dual, delta, clipped_value=clipped_value)
        changed = changed | capped
        columns["dual_clipped"] = capped
    if settings.cov:  # the covariance term, only where the loss selects on it (the analyses derive it from the rows)
        columns["cov"] = token_covariance(x.advantage, x.logp, x.mask)  # [B, T]
        capped_or_none = columns.get("dual_clipped")
        v, f, cov_changed, name, columns[name] = apply_cov(
            settings.method, x, term.clip, v, f, columns["cov"], capped_or_none, settings.cov, generator
        )
        changed = changed | cov_changed
    return replace(term, v=v, f=f, changed=changed, columns=columns)


def _entropy_modifiers(
    settings: Settings, x: Tokens, term: PolicyTerm, entropy: torch.Tensor | None, old_entropy: torch.Tensor | None
) -> PolicyTerm:
    """Stage 3 on the entropies: columns entropy, old_entropy and entropy_ratio rho = (H + 1e-8) /
    (H_old + 1e-8); ERC keeps the slope only where erc[0] < rho < erc[1] (:func:`apply_erc`, column
    erc_kept; f_before_erc keeps the slope before it)."""
    columns = dict(term.columns)
    if entropy is not None:
        columns["entropy"] = entropy.detach().to(x.dtype)
    if entropy is None or old_entropy is None:
        return replace(term, columns=columns)
    columns["old_entropy"] = old_entropy.detach().to(x.dtype)
    rho = entropy_ratio(entropy, old_entropy, x.dtype)  # [B, T]
    columns["entropy_ratio"] = rho
    if settings.erc is None:
        return replace(term, columns=columns)
    f, keep = apply_erc(term.f, rho, settings.erc)
    columns["erc_kept"] = keep
    return replace(term, f=f, changed=term.changed | ~keep, columns=columns, f_before_erc=term.f)


# --- stage 4: aggregation, and the columns -----------------------------------------------------


def _weights(settings: Settings, x: Tokens, weights: torch.Tensor | None) -> torch.Tensor:
    """c w [B, T]: the aggregation weights of settings.agg (explicit ``weights``: those, masked), times
    the scale c."""
    if weights is not None:
        zero = torch.zeros_like(x.log_ratio.detach())
        return torch.where(x.mask, weights.detach().to(x.dtype), zero) * settings.scale  # [B, T]
    return aggregation_weights(x.mask, settings.agg, settings.loss_scale_factor, x.dtype) * settings.scale  # [B, T]


def _token_loss(method: str, x: Tokens, ratio: Ratio, term: PolicyTerm) -> torch.Tensor:
    """l [B, T] = v + f (s u - s) with u = exp(log q - sg(log q)) along q's path (cispo: its own token's
    log r), 0 off the mask: value v, slope f s. s is 0 where f is (no 0 * inf from a ratio that overflowed
    on a clipped token); s None: l = v + f (u - 1)."""
    zero = torch.zeros_like(x.log_ratio.detach())
    u = ratio.unit if method != "cispo" else unit(x.log_ratio)
    s_l = None if term.s is None else torch.where(term.f != 0, term.s, zero)
    return torch.where(x.mask, term.v + term.f * (u - 1.0 if s_l is None else s_l * u - s_l), zero)


def _kl(
    settings: Settings, x: Tokens, ratio: Ratio, w: torch.Tensor, ref_logprobs: torch.Tensor | None
) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """The KL term (:func:`kl_term`; with kl_bias_correction times q along its path): (c w kl [B, T] with
    grad, kl [B, T] detached, d (c w kl) / dlogp [B, T] detached); (None, 0, 0) without ref_logprobs or
    with kl_coef 0."""
    zero = torch.zeros_like(x.log_ratio.detach())
    if ref_logprobs is None or settings.kl_coef == 0.0:
        return None, zero, zero
    kl, kl_local, kl_path = kl_term(x, ref_logprobs, settings.kl_coef, ratio if settings.kl_bias_correction else None)
    kl = torch.where(x.mask, kl, zero)
    kl_grad = w * kl_local
    if kl_path is not None:
        kl_grad = kl_grad + along(x, w * kl_path, ratio.sequence)
    return w * kl, kl.detach(), kl_grad


def _entropy_bonus(
    x: Tokens, w: torch.Tensor, entropy: torch.Tensor, entropy_weights: torch.Tensor | None
) -> torch.Tensor:
    """sum_t e_t H_t over the mask (gradient through H), e = ``entropy_weights`` or c w."""
    zero = torch.zeros_like(x.log_ratio.detach())
    ew = w if entropy_weights is None else torch.where(x.mask, entropy_weights.to(x.dtype), zero)
    return (torch.where(x.mask, entropy.to(x.dtype), zero) * ew).sum()


def _grad_coef(
    x: Tokens, w_pol: torch.Tensor, f: torch.Tensor, s: torch.Tensor | None, kl_grad: torch.Tensor, sequence: bool
) -> torch.Tensor:
    """d loss / dlogp [B, T] for the policy slope f s (s None: 1; s taken 0 where f is) along its path
    (``sequence``: through the sequence mean), weights c w P ``w_pol``, plus the KL term's ``kl_grad``."""
    zero = torch.zeros_like(x.log_ratio.detach())
    coef = w_pol * f if s is None else (w_pol * f) * torch.where(f != 0, s, zero)
    return torch.where(x.mask, along(x, coef, sequence) + kl_grad, zero)


def _aggregate(
    settings: Settings,
    x: Tokens,
    ratio: Ratio,
    term: PolicyTerm,
    p: torch.Tensor | None,
    inputs: dict[str, torch.Tensor | None],
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Stage 4: loss = sum_t (c w P l + c w kl) - entropy_coef sum_t e_t H_t (``p``: P, None: 1;
    ``inputs``: weights, ref_logprobs, entropy, entropy_weights), and the gradient columns: grad_coef,
    grad_coef_unclipped (the slope -A q), grad_changed (changed on a token the policy term reaches, P !=
    0; at sequence level: any such token of its sequence), token_loss (P l + kl), grad_coef_before_erc."""
    zero = torch.zeros_like(x.log_ratio.detach())
    w = _weights(settings, x, inputs["weights"])  # [B, T], scale folded in
    w_pol = w if p is None else torch.where(x.mask, w * p, zero)  # the policy term's weights c w P
    l = _token_loss(settings.method, x, ratio, term)  # noqa: E741 - the docstring's l [B, T]
    w_kl, kl_value, kl_grad = _kl(settings, x, ratio, w, inputs["ref_logprobs"])
    per_token = w_pol * l if w_kl is None else w_pol * l + w_kl
    loss = per_token.sum()
    if settings.entropy_coef != 0.0:
        entropy = inputs["entropy"]
        assert entropy is not None  # _validate: entropy_coef needs entropy
        loss = loss - settings.entropy_coef * _entropy_bonus(x, w, entropy, inputs["entropy_weights"])
    pol_seq = ratio.sequence and settings.method != "cispo"  # cispo keeps its own token's path
    live = x.mask if p is None else x.mask & (p != 0)  # tokens the policy term reaches
    if pol_seq:  # a token's gradient sums its sequence: changed if any token the policy term reaches is
        changed = x.mask & (term.changed & live).any(-1, keepdim=True)
    else:
        changed = term.changed & live
    columns = dict(
        grad_coef=_grad_coef(x, w_pol, term.f, term.s, kl_grad, pol_seq),
        grad_coef_unclipped=_grad_coef(x, w_pol, -x.advantage, ratio.value, kl_grad, pol_seq),  # slope -A q
        grad_changed=changed & x.mask,
        token_loss=torch.where(x.mask, (l.detach() if p is None else p * l.detach()) + kl_value, zero),
    )
    if term.f_before_erc is not None:
        columns["grad_coef_before_erc"] = _grad_coef(x, w_pol, term.f_before_erc, term.s, kl_grad, pol_seq)
    return loss, columns


def _token_columns(x: Tokens, clip: Clip, tau: float) -> dict[str, torch.Tensor]:
    """The tokens' own columns [B, T]: logprob, old_logprob, ratio r, advantage, prob = exp(old), quadrant
    (stats.quadrant with HP: prob >= ``tau``; ZA off the mask), clip (the region), clipped."""
    prob = torch.exp(x.old)
    quadrant = stats.quadrant(x.advantage, prob, tau=tau)
    return dict(
        logprob=x.logp.detach(),
        old_logprob=x.old,
        ratio=x.ratio,
        advantage=x.advantage,
        prob=prob,
        quadrant=torch.where(x.mask, quadrant, torch.full_like(quadrant, ZA)),
        clip=clip.region,
        clipped=clip.clipped,
    )


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
    weights: torch.Tensor | None = None,
    loss_scale_factor: float | None = None,
    token_mask: torch.Tensor | None = None,
    seq_mask: torch.Tensor | None = None,
    is_weight: torch.Tensor | None = None,
    delta: float | None = None,
    ratio_level: str = "token",
    kl_bias_correction: bool = False,
    entropy_weights: torch.Tensor | None = None,
    sapo_tau_pos: float = SAPO_TAUS[0],
    sapo_tau_neg: float = SAPO_TAUS[1],
    sapo_log_ratio_clamp: float | None = 20.0,
    clip_cov_ratio: float | None = None,
    clip_cov_lb: float | None = None,
    clip_cov_ub: float | None = None,
    kl_cov_ratio: float | None = None,
    ppo_kl_coef: float | None = None,
    generator: torch.Generator | None = None,
) -> PolicyLossOutput:
    """Policy loss of ``method`` over response tokens, with its per-token columns and step metrics.

    TRL 1.16 GRPOConfig options act as modifiers (``weights``, ``token_mask``, ``seq_mask``, ``is_weight``,
    ``delta``, ``ratio_level``, ``kl_bias_correction``, ``entropy_weights``), and Cui et al.'s covariance
    controls (verl's clip_cov / kl_cov, :mod:`.cov`; defaults verl's) are method="clip_cov" and
    method="kl_cov" with their settings; the module docstring has the formulas. The ``cov`` column comes
    with these two methods only (the analyses derive it from the rows). float64 logprobs / old_logprobs are
    computed in float64, else float32. ``columns['grad_coef']`` == autograd.grad(loss, logprobs) in every
    combination (closed form).

    Args:
        logprobs: [B, T] the current policy's log-probs of the tokens, carrying the gradient.
        old_logprobs: [B, T] the old (sampling) policy's log-probs (detached).
        advantages: [B] (one per sequence) or [B, T] (detached).
        mask: [B, T] the response tokens (bool, or nonzero = in); masked-out positions add nothing to the
            loss.
        method: one of :data:`METHODS`: grpo, dapo, gppo, ce_gppo, cispo, gspo, sapo, clip_cov, kl_cov.
            Default "grpo".
        eps_low: the clip range's low side, in [0, 1). None (default): the method's (:data:`DEFAULT_EPS`: 0.2,
            gspo 3e-4).
        eps_high: the clip range's high side, >= 0. None (default): eps_low when only eps_low is given (except
            dapo and gspo, which keep their own high side), else the method's (0.2, dapo 0.28, gspo 4e-4).
            sapo does not use eps; kl_cov clips nothing.
        beta1: CE-GPPO's scale of the gradient of the low-side clipped tokens (A < 0, q < 1-eps_low):
            g = -beta1 (1-eps_low) A. method="ce_gppo" only; finite, >= 0. Default 0.5.
        beta2: CE-GPPO's scale of the high-side clipped tokens (A > 0, q > 1+eps_high): g = -beta2
            (1+eps_high) A. method="ce_gppo" only; finite, >= 0. Default 1.0.
        dual_clip: c > 1: a token with A < 0 and q > c that PPO-clip has not clipped keeps the value -c A and
            loses its gradient (column ``dual_clipped``). Not for cispo, sapo or kl_cov. None (default): off.
        entropy: [B, T] the current policy's entropies (column ``entropy``), or None. ERC and an entropy bonus
            need it (the bonus with grad: ``logprobs_and_entropy(..., entropy_grad=True)``).
        old_entropy: [B, T] the old policy's entropies, or None. With ``entropy``: the ``entropy_ratio`` column
            rho = (H + 1e-8) / (H_old + 1e-8).
        erc: (low, high) with 0 <= low < 1 < high: ERC keeps a token's gradient only where low < rho < high
            (its value stays; columns ``erc_kept``, ``grad_coef_before_erc``). Needs entropy and old_entropy.
            None (default): off.
        agg: the aggregation, one of :data:`AGGS` (module docstring). None (default): the method's
            (:data:`DEFAULT_AGG`: seq-mean-token-mean for gspo and sapo, token-mean otherwise).
        entropy_coef: the entropy bonus: loss -= entropy_coef * sum_t e_t H_t (gradient through H, not through
            logp; e = ``entropy_weights``, or scale * w). Needs entropy. Default 0.0 (off).
        ref_logprobs: [B, T] the reference policy's log-probs for the KL term, or None.
        kl_coef: + kl_coef * k3(ref || theta) per token, weighted by the aggregation weights (not by
            token_mask, seq_mask or is_weight); applied when ref_logprobs is given and kl_coef != 0. Default
            0.0.
        tau: the HP / LP threshold of the ``quadrant`` column (HP: the old policy's probability >= tau), in
            (0, 1]. Default 0.5.
        scale: c, a finite number > 0: the returned loss is scale * loss (e.g. 1 / gradient_accumulation_steps),
            folded into the weights (grad_coef includes it). Default 1.0.
        weights: [B, T] explicit aggregation weights (scale not included); they override ``agg`` (config agg
            = "weights") and ``loss_scale_factor``. None (default): from ``agg``.
        loss_scale_factor: verl's divisor of agg='seq-mean-token-sum-norm' (only with that agg), > 0. None
            (default): T, the mask's width.
        token_mask: [B, T] (nonzero = kept): TRL's top-entropy-quantile mask: the policy term is multiplied by
            0 outside it, the KL term and the weights are not (column ``token_kept``). None: off.
        seq_mask: [B] or [B, 1] (nonzero = kept): TRL's off-policy sequence mask, acting the same way on whole
            sequences (column ``seq_kept``). None: off.
        is_weight: [B, T], [B] or [B, 1]: a detached multiplier of the policy term, not of the KL term (TRL's
            vLLM importance-sampling correction; column ``is_weight``). None: off.
        delta: > 1: TRL's upper clamp of the unclipped ratio (module docstring; column ``dual_clipped``), for
            the PPO-clip methods only (grpo, dapo, gppo, ce_gppo, gspo, clip_cov). None (default): off.
        ratio_level: "token" (default) or "sequence": TRL's importance_sampling_level (sequence: q = s_i with
            the gradient through the sequence mean). Not "sequence" for gspo (sequence-level in its token
            form) nor for clip_cov / kl_cov (token-level).
        kl_bias_correction: k3 times the ratio q with its gradient (TRL's use_bias_correction_kl). Default
            False.
        entropy_weights: [B, T] the entropy bonus's weights, scale included. None (default): scale * w.
        sapo_tau_pos: method="sapo"'s gate temperature where A > 0, > 0. Default 1.0 (verl's tau_pos).
        sapo_tau_neg: method="sapo"'s gate temperature where A <= 0, > 0. Default 1.05 (verl's tau_neg).
        sapo_log_ratio_clamp: method="sapo": log q is clamped to [-c, c] first (verl's), > 0. Default 20.0;
            None: no clamp (as TRL).
        clip_cov_ratio: method="clip_cov": max(int(ratio * n_valid), 1) tokens drawn at random among the
            candidates (not clipped, lb < cov < ub) lose value and gradient; in (0, 1]. None (default): verl's
            0.0002.
        clip_cov_lb: method="clip_cov": the candidates' lower bound on a token's cov, < clip_cov_ub. None
            (default): verl's 1.0.
        clip_cov_ub: method="clip_cov": the candidates' upper bound on cov. None (default): verl's 5.0.
        kl_cov_ratio: method="kl_cov": the max(1, int(ratio * n_valid)) masked-in tokens of largest cov get
            the penalty; in (0, 1]. None (default): verl's 0.0002.
        ppo_kl_coef: method="kl_cov": the penalty's coefficient (ppo_kl_coef |log r|), finite, >= 0. None
            (default): verl's 0.1.
        generator: the torch.Generator of Clip-Cov's random selection. None (default): the global CPU
            generator, as verl.

    Returns:
        A :class:`PolicyLossOutput`: ``loss`` (a scalar, scale included), ``columns`` (per-token [B, T]
        detached tensors named as the schema's token columns), ``metrics`` (the step metrics) and ``config``
        (the resolved hyperparameters: method, eps_low, eps_high, agg, ...).

    Raises:
        ValueError: when method, agg or ratio_level is unknown; a setting is out of its range above (eps,
            beta1 / beta2, dual_clip, delta, erc, tau, scale, loss_scale_factor, the sapo and cov settings); a
            modifier is given to a method it does not apply to (dual_clip, delta, loss_scale_factor without
            its agg, ratio_level="sequence"); erc or entropy_coef lacks the entropies it needs; a tensor's
            shape does not match; or an input holds NaN or Inf at a masked-in position.
    """
    settings = _resolve_settings(
        method,
        eps_low,
        eps_high,
        beta1,
        beta2,
        dual_clip,
        erc,
        agg,
        tau,
        entropy_coef,
        kl_coef,
        scale,
        delta,
        ratio_level,
        kl_bias_correction,
        loss_scale_factor,
        explicit_weights=weights is not None,
        entropies=(entropy, old_entropy),
        cov=(clip_cov_ratio, clip_cov_lb, clip_cov_ub, kl_cov_ratio, ppo_kl_coef),
    )
    tensors = {  # [B, T] inputs that are columns too
        "entropy": entropy,
        "old_entropy": old_entropy,
        "ref_logprobs": ref_logprobs,
        "weights": weights,
        "entropy_weights": entropy_weights,
    }
    modifiers = {"token_mask": token_mask, "seq_mask": seq_mask, "is_weight": is_weight}
    x = _tokens(logprobs, old_logprobs, advantages, mask, tensors, modifiers)
    p, multiplier_columns = _policy_multiplier(x, token_mask, seq_mask, is_weight)  # P [B, T] or None
    ratio = ratio_of(method, x, ratio_level)  # stage 1
    sapo = _check_sapo(sapo_tau_pos, sapo_tau_neg, sapo_log_ratio_clamp) if method == "sapo" else None
    term = _surrogate_term(settings, x, ratio, sapo)  # stage 2
    term = _clip_modifiers(settings, x, term, generator)  # stage 3
    term = _entropy_modifiers(settings, x, term, entropy, old_entropy)
    loss, gradient_columns = _aggregate(settings, x, ratio, term, p, tensors)  # stage 4
    columns = {**multiplier_columns, **term.columns, **_token_columns(x, term.clip, tau), **gradient_columns}
    # finite as float32: what the check saw in float32 (float64 inputs only when computed in float32)
    named = {
        "logprobs": logprobs,
        "old_logprobs": old_logprobs,
        "entropy": entropy,
        "old_entropy": old_entropy,
        "advantages": advantages,
    }
    checked = _finite_checked(named, mask, x.dtype)
    config = settings.config(sapo, x.mask.shape[-1])
    return PolicyLossOutput(loss=loss, columns=columns, config=config, mask=x.mask, checked=checked)
