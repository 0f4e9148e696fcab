"""Layer 1, the policy losses this plug-in registers in verl (``loss_mode`` gppo, ce_gppo, entropylens_grpo /
_dapo / _cispo / _sapo / _clip_cov / _kl_cov, each :func:`compute_loss`, i.e. entropylens' ``policy_loss`` with verl's configuration),
and verl's own diagnostics (:func:`verl_clip_metrics`, with the keys and meanings verl's own loss of each
method returns: :func:`verl_metric_keys`), which the registered losses and the loss function both return.
The trainer mode registers in trainer_mode.py.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol, cast

import torch
from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY, register_policy_loss

from ...rl.cov import COV_METHODS
from ...rl.losses import PolicyLossOutput, aggregation_weights, compute_dtype, policy_loss
from .config import agg_and_scale, eps_from, pl_get
from .metrics import METRIC_PREFIX, metric_rule
from .names import METHODS, PREFIXED

VERL_CLIP_KEYS = ("actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower")

logger = logging.getLogger(__name__)


def compute_loss(
    method: str,
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str,
    config: Any,
    *,
    entropy: torch.Tensor | None = None,
    old_entropy: torch.Tensor | None = None,
    erc: tuple[float, float] | None = None,
    entropy_coef: float = 0.0,
    token_mask: torch.Tensor | None = None,
    entropy_weights: torch.Tensor | None = None,
    is_weight: torch.Tensor | None = None,
) -> PolicyLossOutput:
    """``policy_loss`` with verl's configuration: eps from clip_ratio_low/high (:func:`eps_from`),
    dual-clip from clip_ratio_c (verl applies it to every PPO loss; default 3), beta1/beta2 from the
    policy_loss config, aggregation with verl's global counts via ``scale``, ``entropy_coef`` (verl's
    entropy_coeff: the bonus is in the loss and in its config, where the recorder's entropy-bonus
    rule reads it), ``token_mask`` (the forking mask) and ``entropy_weights`` as policy_loss takes them;
    ``is_weight``: verl's rollout correction weights (rollout_is_weights, detached), policy_loss's is_weight:
    the per-token policy term times the weight, as verl's own losses do (``pg_losses * rollout_is_weights``
    before aggregation; not the entropy bonus). Returns the PolicyLossOutput."""
    eps_low, eps_high = eps_from(config, method)
    info = dict(getattr(config, "global_batch_info", None) or {})
    if method == "sapo":  # verl's sapo aggregates seq-mean-token-mean whatever loss_agg_mode says
        loss_agg_mode = "seq-mean-token-mean"
    agg, scale = agg_and_scale(loss_agg_mode, response_mask, info)
    scale = float(scale)
    scale = scale if scale > 0 else 1.0  # no token in this micro-batch: every weight is 0 anyway
    # verl's clip_cov / kl_cov have no dual-clip (nor cispo, nor sapo)
    dual = None if method in ("cispo", "sapo", *COV_METHODS) else float(getattr(config, "clip_ratio_c", 3.0) or 3.0)
    lsf = info.get("loss_scale_factor") if agg == "seq-mean-token-sum-norm" else None
    kw: dict[str, Any] = dict(
        method=method,
        eps_low=eps_low,
        eps_high=eps_high,
        dual_clip=dual,
        agg=agg,
        beta1=float(pl_get(config, "beta1", 0.5)),
        beta2=float(pl_get(config, "beta2", 1.0)),
        tau=float(pl_get(config, "tau", 0.5)),
        entropy=entropy,
        old_entropy=old_entropy,
        erc=erc,
        entropy_coef=entropy_coef,
        loss_scale_factor=None if lsf is None else float(lsf),
        token_mask=token_mask,
        entropy_weights=entropy_weights,
        is_weight=is_weight,
    )
    kw.update(cov_config(config, method))
    if method == "sapo":  # verl's ActorConfig tau_pos / tau_neg (1.0 / 1.05) and its clamp of log r to [-20, 20]
        kw.update(
            sapo_tau_pos=float(getattr(config, "tau_pos", 1.0)),
            sapo_tau_neg=float(getattr(config, "tau_neg", 1.05)),
            sapo_log_ratio_clamp=20.0,
        )
    if token_mask is not None and entropy_coef and entropy_weights is None:  # verl's bonus weights, kept tokens only
        w = aggregation_weights(
            response_mask.bool(), agg, kw["loss_scale_factor"], compute_dtype(log_prob, old_log_prob)
        )
        kw["entropy_weights"] = w * scale * token_mask.to(w.dtype)
    return policy_loss(log_prob, old_log_prob, advantages, response_mask, scale=scale, **kw)


def cov_config(config: Any, method: str) -> dict[str, Any]:
    """Clip-Cov / KL-Cov settings from verl's policy_loss config keys (clip_cov_ratio, clip_cov_lb,
    clip_cov_ub; kl_cov_ratio, ppo_kl_coef; None: verl's defaults); {} for the other methods. The random
    selection uses the global CPU generator, as verl's clip_cov does."""
    if method == "clip_cov":
        return {k: pl_get(config, k) for k in ("clip_cov_ratio", "clip_cov_lb", "clip_cov_ub")}
    if method == "kl_cov":
        return {k: pl_get(config, k) for k in ("kl_cov_ratio", "ppo_kl_coef")}
    return {}


def verl_metric_keys(method: str) -> tuple[str, ...]:
    """The keys of verl's own diagnostics for ``method``, in :func:`verl_clip_metrics`' order: verl's
    clip_cov returns pg_clipfrac and ppo_kl, its kl_cov ppo_kl alone; every other method the three of
    compute_policy_loss_vanilla (VERL_CLIP_KEYS)."""
    if method == "clip_cov":
        return VERL_CLIP_KEYS[:2]
    if method == "kl_cov":
        return VERL_CLIP_KEYS[1:2]
    return VERL_CLIP_KEYS


def verl_clip_metrics(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    config: Any,
    method: str,
    *,
    cov_clipped: torch.Tensor | None = None,
) -> torch.Tensor:
    """verl's own diagnostics of one micro-batch, float64 [k] on the device, in the order of
    :func:`verl_metric_keys` (``method``), each with the meaning verl's own loss of that method gives it.

    Every method but the two below, as compute_policy_loss_vanilla (log-ratio clamped to +-20):
    [pg_clipfrac, ppo_kl, pg_clipfrac_lower]. pg_clipfrac: share of tokens whose clipped surrogate exceeds
    the unclipped one (A > 0, r > 1+eps_high; A < 0, r < 1-eps_low); pg_clipfrac_lower: share with A < 0
    and r above the dual-clip bound clip_ratio_c (entropylens' dual_clipped); ppo_kl: mean of
    log pi_old - log pi. sapo: both clip fractions 0, as compute_policy_loss_sapo returns them (no hard clip).
    clip_cov, as compute_policy_loss_clip_cov: [pg_clipfrac, ppo_kl], pg_clipfrac the share of tokens
    Clip-Cov selected (``cov_clipped``, policy_loss's column of that name: verl's corr == 0), ppo_kl the
    mean of log pi_old - log pi without the clamp. kl_cov, as compute_policy_loss_kl_cov: [ppo_kl], the mean
    of |log pi - log pi_old| (no clamp). Means over the masked-in tokens (0 over none)."""
    m = mask.bool()
    denom = m.sum().clamp(min=1).double()
    diff = log_prob.detach().double() - old_log_prob.double()
    zero = torch.zeros_like(diff)
    if method == "kl_cov":
        return (torch.where(m, diff.abs(), zero).sum() / denom).reshape(1)
    if method == "clip_cov":
        if cov_clipped is None:
            raise ValueError("verl_clip_metrics: method 'clip_cov' needs cov_clipped (Clip-Cov's selected tokens)")
        clipfrac = (cov_clipped.bool() & m).sum().double() / denom
        return torch.stack([clipfrac, torch.where(m, -diff, zero).sum() / denom])
    eps_low, eps_high = eps_from(config, method)
    c = float(getattr(config, "clip_ratio_c", 3.0) or 3.0)
    log_r = torch.clamp(diff, min=-20.0, max=20.0)
    r = torch.exp(log_r)
    a = advantages.double()
    l1, l2 = -a * r, -a * torch.clamp(r, 1 - eps_low, 1 + eps_high)
    clipfrac = ((l2 > l1) & m).sum() / denom
    lower = ((torch.maximum(l1, l2) > -a * c) & (a < 0) & m).sum() / denom
    kl = torch.where(m, -log_r, torch.zeros_like(log_r)).sum() / denom
    if method == "sapo":
        clipfrac = lower = torch.zeros((), dtype=torch.float64, device=kl.device)
    return torch.stack([clipfrac.double(), kl, lower.double()])


class RegisteredLoss(Protocol):
    """A policy loss as this plug-in registers it in verl: verl's policy-loss signature, and the function's
    ``entropylens_method`` (the entropylens method it runs) and ``warned`` (its one warning was given)."""

    entropylens_method: str
    warned: bool

    def __call__(
        self,
        old_log_prob: torch.Tensor,
        log_prob: torch.Tensor,
        advantages: torch.Tensor,
        response_mask: torch.Tensor,
        loss_agg_mode: str = "token-mean",
        config: Any = None,
        rollout_is_weights: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[str, float]]: ...


def _make_registered(method: str) -> RegisteredLoss:
    def loss_fn(
        old_log_prob: torch.Tensor,
        log_prob: torch.Tensor,
        advantages: torch.Tensor,
        response_mask: torch.Tensor,
        loss_agg_mode: str = "token-mean",
        config: Any = None,
        rollout_is_weights: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        if config is None:
            raise ValueError(f"entropylens {method}: verl passed no actor config")
        if method == "ce_gppo" and pl_get(config, "beta1") is None and not registered.warned:
            registered.warned = True
            logger.warning(
                "entropylens ce_gppo: policy_loss has no beta1/beta2 (set policy_loss._target_="
                "entropylens.integrations.verl.EntropyLensLossConfig); using beta1=0.5, beta2=1.0"
            )
        out = compute_loss(
            method,
            old_log_prob,
            log_prob,
            advantages,
            response_mask,
            loss_agg_mode,
            config,
            is_weight=rollout_is_weights,
        )
        clip = verl_clip_metrics(
            log_prob,
            old_log_prob,
            advantages,
            response_mask,
            config,
            method,
            cov_clipped=out.columns.get("cov_clipped"),
        )
        scal = out.scalars()
        # verl's ppo_loss averages these over micro-batches (Metric MEAN): only intensive values are
        # returned (a count or the loss would come out divided by the number of micro-batches); exact step
        # values need trainer.v1.trainer_mode=entropylens (EntropyLensLoss)
        # (a mean over no tokens of this micro-batch is NaN: left out, or verl's np.mean would be NaN)
        metrics = {METRIC_PREFIX + k: v for k, v in scal.items() if (metric_rule(k) or ("",))[0] == "mean" and v == v}
        metrics.update(zip(verl_metric_keys(method), clip.tolist()))  # verl's keys for this method, no more
        return out.loss, metrics

    loss_fn.__name__ = f"entropylens_{method}_policy_loss"
    loss_fn.__doc__ = f"entropylens' {method} as a verl policy loss (entropylens.rl.losses.policy_loss)."
    registered = cast(RegisteredLoss, loss_fn)  # the function, given the attributes the protocol names
    registered.entropylens_method = method
    registered.warned = False
    return registered


def register() -> None:
    """Register every entropylens loss in verl's POLICY_LOSS_REGISTRY (idempotent)."""
    for method in (*METHODS, *PREFIXED):
        fn = _make_registered(method)
        names = [f"entropylens_{method}"] + ([method] if method in METHODS else [])
        for name in names:
            existing = POLICY_LOSS_REGISTRY.get(name)
            if existing is not None and getattr(existing, "entropylens_method", None) is None:
                raise RuntimeError(f"verl already has a policy loss named {name!r}; entropylens will not replace it")
            register_policy_loss(name)(fn)
