"""Helpers for a hand-written GRPO loop in plain PyTorch.

    rec = Recorder("runs", config={"method": "ce_gppo"})
    old_lp, old_h = old_policy_pass(logits_old, tokens)                  # no grad, once per rollout
    for u, mb in enumerate(minibatches):
        logits = model(mb.input_ids).logits[:, P - 1 : -1]                # [B, T, V]
        out = policy_update(rec, step, u, logits, mb.tokens, mb.mask, mb.adv, mb.old_lp,
                            old_entropy=mb.old_h, method="ce_gppo", beta1=0.5, beta2=1.0)
        out.loss.backward()
        rec.record_step(step, update=u, grad_norm=clip_grad_norm_(params, 1.0), lr=lr)
"""

from __future__ import annotations

import torch

from ..losses import PolicyLossOutput, policy_loss
from ..recorder import Recorder
from ..stats import logprobs_and_entropy


@torch.no_grad()
def old_policy_pass(logits: torch.Tensor, tokens: torch.Tensor, *, temperature: float = 1.0,
                    chunk_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The old policy's log-probs and full-vocabulary entropies, [B, T] each, in one chunked pass."""
    return logprobs_and_entropy(logits, tokens, temperature=temperature, chunk_size=chunk_size)


def policy_update(
    recorder: Recorder | None,
    step: int,
    update: int,
    logits: torch.Tensor,
    tokens: torch.Tensor,
    mask: torch.Tensor,
    advantages: torch.Tensor,
    old_logprobs: torch.Tensor,
    *,
    old_entropy: torch.Tensor | None = None,
    temperature: float = 1.0,
    seq_ids: torch.Tensor | None = None,
    group_ids: torch.Tensor | None = None,
    **loss_kwargs,
) -> PolicyLossOutput:
    """One policy update: hooks ``logits`` [B, T, V] for exact logit-gradient norms, computes log-probs
    and entropies (``logprobs_and_entropy``), the loss (``policy_loss(**loss_kwargs)``: method, eps,
    beta1, beta2, erc, dual_clip, entropy_coef, agg, ...) and records the update. Call
    ``out.loss.backward()`` afterwards; the recorder picks the gradient norms up from the backward."""
    if recorder is not None and logits.requires_grad:
        recorder.watch_logits(logits)
    entropy_grad = bool(loss_kwargs.get("entropy_coef"))
    # recording: the entropy sensitivity s comes from the same chunked pass (entropy attribution)
    logprobs, entropy, *sens = logprobs_and_entropy(logits, tokens, temperature=temperature,
                                                    entropy_grad=entropy_grad, sensitivity=recorder is not None)
    out = policy_loss(logprobs, old_logprobs, advantages, mask, entropy=entropy, old_entropy=old_entropy,
                      **loss_kwargs)
    if recorder is not None:
        recorder.record_update(step, update, mask=mask, advantages=advantages, logprobs=logprobs,
                               old_logprobs=old_logprobs, entropy=entropy, old_entropy=old_entropy, tokens=tokens,
                               seq_ids=seq_ids, group_ids=group_ids, loss=out, entropy_sensitivity=sens[0],
                               temperature=temperature)
    return out


__all__ = ["old_policy_pass", "policy_update"]
