"""TRL's objective as entropylens sees it, with no TRL import: how each ``loss_type`` normalises
(:func:`trl_loss_weights`), which GRPOConfig options ``loss=...`` can honour, the ``clip`` / ``clipped``
columns of TRL's own loss, the metrics TRL's loss logs, and the columns recorded for an update that
TRL's own loss trained."""

from __future__ import annotations

import torch

from ..rl.stats import clip_region, clipped_mask

PPO_CLIP_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")  # TRL loss types that clip like PPO

# How TRL 1.16's ``_compute_loss`` normalises each loss_type (training; GA = current gradient
# accumulation steps, m = completion_mask * tool_mask, B = the micro-batch's completions):
TRL_NORMALISATION: dict[str, str] = {
    "grpo": "per completion: sum_t m l / max(L_i, 1), mean over the B completions, / GA",
    "sapo": "per completion: sum_t m l / max(L_i, 1), mean over the B completions, / GA",
    "bnpo": "sum m l / max(sum m, 1) over the micro-batch, / GA",
    "dr_grpo": "sum m l / (B * max_completion_length), / GA",
    "dapo": "sum m l / the accumulation window's completion tokens "
    "(num_items_in_batch / processes * GA / steps_per_generation)",
    "cispo": "sum m l / the accumulation window's completion tokens "
    "(num_items_in_batch / processes * GA / steps_per_generation)",
    "vespo": "sum m l / the accumulation window's completion tokens "
    "(num_items_in_batch / processes * GA / steps_per_generation)",
    "luspo": "per completion: sum_t m l, mean over the B completions, / GA",
}
WINDOW_LOSS_TYPES = ("dapo", "cispo", "vespo")  # normalised by the whole accumulation window's tokens


def trl_loss_weights(
    loss_type: str,
    mask: torch.Tensor,
    *,
    ga: int,
    num_items_in_batch=None,
    num_processes: int = 1,
    steps_per_generation: int = 1,
    max_completion_length: int | None = None,
) -> torch.Tensor:
    """Aggregation weights w [B, T] (gradient accumulation included) with which TRL 1.16 normalises
    ``loss_type`` in training: TRL's loss == sum(w * per_token_loss) (see :data:`TRL_NORMALISATION`).
    ``num_items_in_batch`` (a 0-dim tensor: the generation batch's completion tokens over all
    processes) stays on the device: no host sync."""
    if loss_type not in TRL_NORMALISATION:
        raise ValueError(
            f"loss_type {loss_type!r}: entropylens knows TRL's normalisation of {', '.join(TRL_NORMALISATION)}"
        )
    m = mask.float()  # [B, T]
    b = m.shape[0]
    if loss_type in ("grpo", "sapo"):
        return m / (m.sum(-1, keepdim=True).clamp(min=1.0) * b * ga)
    if loss_type == "bnpo":
        return m / (m.sum().clamp(min=1.0) * ga)
    if loss_type == "dr_grpo":
        if max_completion_length is None:  # TRL divides by it too
            raise TypeError("loss_type 'dr_grpo' is normalised by max_completion_length: it must be set")
        return m / (b * float(max_completion_length) * ga)
    if loss_type == "luspo":
        return m / (b * ga)
    if num_items_in_batch is None:
        raise ValueError(f"loss_type {loss_type!r} needs num_items_in_batch (TRL's batch carries it)")
    n = torch.as_tensor(num_items_in_batch, device=m.device).float().clamp(min=1.0)
    return m / (n / num_processes * ga / steps_per_generation)


def unsupported_trl_options(args, aux_loss_enabled: bool = False) -> list[str]:
    """The GRPOConfig options ``loss=...`` cannot honour. Every option of TRL 1.16's ``_compute_loss``
    composes with entropylens' losses (KL with or without bias correction, the vLLM importance-sampling
    weight, the top-entropy mask, the off-policy mask, delta, sequence-level importance sampling, the
    static or adaptive entropy bonus, the MoE router aux loss); what remains is a loss_type whose
    normalisation entropylens does not know."""
    loss_type = getattr(args, "loss_type", "dapo")
    if loss_type not in TRL_NORMALISATION:
        return [f"loss_type={loss_type!r} (its normalisation is unknown to entropylens)"]
    return []


def refuse_unsupported(loss: str, options: list[str]) -> None:
    """Raise where ``loss=...`` cannot honour some of the configured options (:func:`unsupported_trl_options`)."""
    if options:
        raise ValueError(
            f"loss={loss!r} replaces TRL's loss and cannot honour: "
            + "; ".join(options)
            + ". Keep TRL's loss (loss=None), which is recorded as it is."
        )


def trl_clip_columns(
    loss_type: str,
    level: str,
    delta,
    eps_low: float,
    eps_high: float,
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
) -> dict:
    """``clip`` / ``clipped`` [B, T] as TRL's own loss defines them (schema: column meanings).

    PPO-clip types (grpo, bnpo, dr_grpo, dapo, luspo): region of the ratio TRL clips (the token ratio, or
    the sequence ratio exp(mean_t log r) with importance_sampling_level='sequence'); clipped = the
    advantage-gated PPO rule, plus A < 0 and r > delta when ``delta`` clamps the ratio (zero gradient; also
    ``dual_clipped``).
    cispo: +1 where the detached weight is capped (r > epsilon_high, an absolute cap), never clipped
    (its gradient is never removed). sapo, vespo: no hard clip (0 / False)."""
    m = mask.bool()
    a = advantages.detach().float()
    a = a.unsqueeze(1).expand(m.shape) if a.dim() == 1 else a
    log_r = torch.where(m, logprobs.detach().float() - old_logprobs.detach().float(), torch.zeros_like(a))
    if level == "sequence":
        log_r = (log_r.sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp(min=1)).expand(m.shape)
    r = torch.exp(log_r)  # [B, T]: the ratio TRL's loss uses
    zero = torch.zeros(m.shape, dtype=torch.int8, device=m.device)
    if loss_type in PPO_CLIP_LOSS_TYPES:
        region = clip_region(r, eps_low, eps_high)
        clipped = clipped_mask(region, a)
        if delta is not None:
            dual = (a < 0) & (r > delta)
            clipped = clipped | dual
    elif loss_type == "cispo":
        region = (r > eps_high).to(torch.int8)
        clipped = torch.zeros(m.shape, dtype=torch.bool, device=m.device)
    else:
        region, clipped = zero, torch.zeros(m.shape, dtype=torch.bool, device=m.device)
    out = {"clip": region, "clipped": clipped & m}
    if loss_type in PPO_CLIP_LOSS_TYPES and delta is not None:
        out["dual_clipped"] = dual & m  # TRL's delta: the capped ratio's tokens (dual_clip_frac)
    return out


def trl_own_loss_columns(
    loss_type: str,
    level: str,
    delta,
    eps_low: float,
    eps_high: float,
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    grad: torch.Tensor | None,
    modifiers: dict,
) -> dict:
    """The per-token columns recorded for an update trained by TRL's own loss: its ``clip`` / ``clipped``
    (:func:`trl_clip_columns`), ``grad_coef`` = dLoss/dlogp where the backward gave it (``grad``), and
    what TRL's own options did to each token (``modifiers``: ``token_kept``, ``seq_kept``, ``is_weight``)."""
    cols = trl_clip_columns(loss_type, level, delta, eps_low, eps_high, logprobs, old_logprobs, advantages, mask)
    if grad is not None:
        cols["grad_coef"] = torch.where(mask.bool(), grad.float(), torch.zeros_like(grad, dtype=torch.float32))
    for name, t in modifiers.items():
        cols[name] = t.expand(mask.shape)
    return cols


def trl_loss_metrics(
    out,
    lp: torch.Tensor,
    h: torch.Tensor,
    mask: torch.Tensor,
    ref,
    old_lp,
    *,
    kl: bool,
    kl_bias_correction: bool,
    level: str,
    loss_type: str,
) -> dict[str, torch.Tensor]:
    """The per-token values [B, T] behind the metrics TRL's own loss logs (entropy, kl, clip_ratio/*), from
    ``policy_loss``'s output ``out`` and the pass's tensors; their masked means are what TRL logs."""
    m = mask.float()
    metrics = {"entropy": h.detach().float()}
    if kl:
        d = ref.float() - lp.detach().float()  # ref - logp
        k3 = torch.exp(d) - d - 1.0  # [B, T] k3, as TRL logs it
        if kl_bias_correction:
            log_r = (lp.detach().float() - old_lp.float()) * m
            if level == "sequence":
                log_r = log_r.sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp(min=1.0)
            k3 = k3 * torch.exp(log_r)
        metrics["kl"] = k3
    c = out.columns
    if loss_type in PPO_CLIP_LOSS_TYPES:
        low = (c["clip"] < 0) & (c["advantage"] < 0)
        high = (c["clip"] > 0) & (c["advantage"] > 0)
        metrics.update(
            {
                "clip_ratio/low_mean": low.float(),
                "clip_ratio/high_mean": high.float(),
                "clip_ratio/region_mean": (low | high).float(),
            }
        )
    return metrics


class LossColumns:
    """What ``Recorder.record_update(loss=...)`` reads: per-token columns, the loss value, settings."""

    def __init__(self, columns: dict, loss=None, config: dict | None = None):
        self.columns, self.loss, self.config = columns, loss, config or {}
