"""An update's token columns on the device, as pure tensor functions (no I/O): ratio, quadrant, clip,
entropy ratio (DESIGN.md's definitions) from the raw tensors, or taken as they are from a ``policy_loss``
output; the entropy-bonus rule of the attribution."""

from __future__ import annotations

import torch

from ...rl import stats


def derive_columns(
    *,
    mask: torch.Tensor,
    advantages: torch.Tensor,
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    entropy: torch.Tensor | None,
    old_entropy: torch.Tensor | None,
    loss_columns: dict[str, torch.Tensor] | None,
    eps_low: float,
    eps_high: float,
    tau: float,
) -> dict[str, torch.Tensor]:
    """All token columns as [B, T] detached tensors. Columns the loss computed are used as they are
    (the recorder never re-derives what the loss decided); the rest follow DESIGN.md's definitions.
    The attribution columns come with the update's block (blocks.add_attribution), and so does the -inf
    of a token of probability 0 in the logprob / old_logprob columns (:func:`log_zero_as_inf`)."""
    cols: dict[str, torch.Tensor] = dict(loss_columns or {})
    shape = logprobs.shape
    if "advantage" not in cols:
        adv = advantages.detach().float()
        cols["advantage"] = adv.unsqueeze(1).expand(shape) if adv.dim() == 1 else adv
    if "logprob" not in cols:
        cols["logprob"] = logprobs.detach().float()
    if "old_logprob" not in cols:
        cols["old_logprob"] = old_logprobs.detach().float()
    if "prob" not in cols:
        cols["prob"] = torch.exp(cols["old_logprob"])
    if "ratio" not in cols:
        cols["ratio"] = torch.exp(cols["logprob"] - cols["old_logprob"])
    if "clip" not in cols:
        cols["clip"] = stats.clip_region(cols["ratio"], eps_low, eps_high)
    if "clipped" not in cols:
        cols["clipped"] = stats.clipped_mask(cols["clip"], cols["advantage"])
    if "quadrant" not in cols:
        cols["quadrant"] = stats.quadrant(cols["advantage"], cols["prob"], tau=tau)
    if entropy is not None and "entropy" not in cols:
        cols["entropy"] = entropy.detach().float()
    if old_entropy is not None and "old_entropy" not in cols:
        cols["old_entropy"] = old_entropy.detach().float()
    if "entropy" in cols and "old_entropy" in cols and "entropy_ratio" not in cols:
        cols["entropy_ratio"] = stats.entropy_ratio(cols["entropy"], cols["old_entropy"])
    return cols


# stats' log-prob of a -inf logit: the lowest finite float32 (so that the loss's gradient stays finite)
_LOG_ZERO = torch.finfo(torch.float32).min


def log_zero_as_inf(logp: torch.Tensor) -> torch.Tensor:
    """``logp`` with the log-prob of a token of probability 0 as -inf: values <= the lowest finite float32
    (what stats' chunked pass gives a -inf logit, and float64 values below float32's range) become -inf, so
    that no finite -3.4e38 is stored: the token's k3 (and with old_logprob its ratio) is then not finite,
    counted in n_nonfinite_ratio (the alarm rule ``nonfinite``) and left out of ratio_mean and kl_k3. NaN
    stays NaN (refused by the input check). One elementwise op on the device, no sync."""
    return logp.masked_fill(logp <= _LOG_ZERO, float("-inf"))


def entropy_bonus_rule(cols: dict[str, torch.Tensor], config: dict | None) -> None:
    """The attribution's entropy-bonus rule (schema: tokens.entropy_effect), keyed on the loss config:
    a loss with an entropy bonus (``config['entropy_coef']`` != 0) reaches the logits through H as
    well, so grad_coef s / T^2 leaves out part of the entropy change. Unless ``cols`` carries that
    part (the loss column ``entropy_effect_bonus`` [B, T]: -dLoss/dH_t * sum_j p_j^2 (log p_j + H)^2
    / T^2, as integrations.torch.policy_update measures it), a NaN one is added (one value broadcast,
    no [B, T] allocation): entropy_effect and its budget sums are then null, never the policy term
    alone. entropy_effect_dropped is unaffected (the bonus is in both gradients and cancels)."""
    if (config or {}).get("entropy_coef") and "entropy_effect_bonus" not in cols and "grad_coef" in cols:
        g = cols["grad_coef"]
        cols["entropy_effect_bonus"] = torch.full((), float("nan"), device=g.device).expand(g.shape)


def add_mismatch(
    cols: dict[str, torch.Tensor], shape: tuple, sampler_logprobs: torch.Tensor | None, is_masked: torch.Tensor | None
) -> None:
    """The training-inference mismatch columns: sampler_logprob [B, T] (float32, detached) and is_masked
    ([B, T] or [B, 1] broadcast, bool), where given; a loss's own column of the same name wins."""
    for name, x in (("sampler_logprob", sampler_logprobs), ("is_masked", is_masked)):
        if x is None or name in cols:
            continue
        if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[0] != shape[0] or x.shape[1] not in (1, shape[1]):
            raise ValueError(
                f"record_update: {name} must be [B, T] = {tuple(shape)}"
                f"{' or [B, 1]' if name == 'is_masked' else ''}, got {tuple(getattr(x, 'shape', ()))}"
            )
        if name == "sampler_logprob" and x.shape[1] != shape[1]:
            raise ValueError(f"record_update: sampler_logprobs must be [B, T] = {tuple(shape)}, got {tuple(x.shape)}")
        x = x.detach()
        cols[name] = (
            x.float() if name == "sampler_logprob" else (x.bool() if x.dtype == torch.bool else x != 0).expand(shape)
        )
