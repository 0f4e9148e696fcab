"""Helpers for a hand-written GRPO loop in plain PyTorch.

    rec = Recorder("runs", config={"method": "ce_gppo"})
    old_lp, old_h = old_policy_pass(logits_old, tokens)                  # no grad, once per rollout
    for u, mb in enumerate(minibatches):
        logits = model(mb.input_ids).logits[:, P - 1 : -1]                # [B, T, V]
        out = policy_update(rec, step, u, logits, mb.tokens, mb.mask, mb.adv, mb.old_lp,
                            old_entropy=mb.old_h, method="ce_gppo", beta1=0.5, beta2=1.0)
        out.loss.backward()
        rec.record_step(step, update=u, grad_norm=clip_grad_norm_(params, 1.0), lr=lr)

Without logits (large vocabularies): pass the hidden states and the LM head instead; the fused head
``entropylens.rl.stats.head_stats`` projects them in tiles, so no [B, T, V] tensor ever exists:

    hidden = model.model(mb.input_ids).last_hidden_state[:, P - 1 : -1]  # [B, T, H]
    out = policy_update(rec, step, u, None, mb.tokens, mb.mask, mb.adv, mb.old_lp, hidden=hidden,
                        head=model.lm_head, old_entropy=mb.old_h, method="ce_gppo", scale=1 / accum)
"""

from __future__ import annotations

import torch

from ..record.recorder import Recorder
from ..rl.forking import AdaptiveEntropyCoef, bonus_weights, top_entropy_mask
from ..rl.losses import PolicyLossOutput, policy_loss
from ..rl.stats import chunk_rows, head_stats, logit_grad_norm_from_sum_p2, logprobs_and_entropy


def _head_params(head) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(weight [V, H], bias [V] | None) of an nn.Linear LM head, or a bare weight tensor."""
    if isinstance(head, torch.Tensor):
        return head, None
    weight = getattr(head, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise ValueError(f"head must be an LM head with a [V, H] weight (nn.Linear) or that weight, got {type(head)}")
    return weight, getattr(head, "bias", None)


def masked_tokens(tokens: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """``tokens`` [B, T] with every masked-out position (``mask`` False) as id 0: those positions may hold
    any id (HF's -100 label padding included); only masked-in ids must lie in the vocabulary. Their
    log-probs and entropies are then token 0's, which nothing records or trains on. One elementwise op."""
    if mask is None:
        return tokens
    if tuple(mask.shape) != tuple(tokens.shape):
        raise ValueError(f"mask shape {tuple(mask.shape)} does not match tokens shape {tuple(tokens.shape)}")
    return torch.where(mask.bool(), tokens, torch.zeros((), dtype=tokens.dtype, device=tokens.device))


@torch.no_grad()
def entropy_gradient_sq(
    logits: torch.Tensor, *, temperature: float = 1.0, chunk_size: int | None = None
) -> torch.Tensor:
    """q_t = sum_j p_j^2 (log p_j + H_t)^2 = T^2 ||dH_t/dz_t||^2 per position (p = softmax(z/T), H its
    entropy): the entropy bonus's own first-order entropy change per unit logit step is -dLoss/dH_t q_t / T^2.
    logits [..., V] -> [...] float32, one chunked pass (O(chunk x V) extra memory, no grad); -inf logits
    add nothing (p_j = 0)."""
    v = logits.shape[-1]
    flat = logits.detach().reshape(-1, v)
    n = flat.shape[0]
    out = torch.empty(n, dtype=torch.float32, device=logits.device)
    rows = chunk_rows(n, v, chunk_size, logits.device)
    for i in range(0, n, rows):
        lp = torch.log_softmax(flat[i : i + rows].float() / float(temperature), -1)  # [c, V]
        p = lp.exp()
        lp = torch.where(p > 0, lp, 0.0)  # -inf logits: p = 0, and 0 * -inf would be NaN
        h = -(p * lp).sum(-1, keepdim=True)  # [c, 1]
        out[i : i + rows] = (p * (lp + h)).square().sum(-1)
    return out.view(logits.shape[:-1])


def entropy_bonus_effect(
    loss: torch.Tensor,
    entropy: torch.Tensor,
    logits: torch.Tensor,
    mask: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int | None = None,
) -> torch.Tensor | None:
    """The entropy bonus's own first-order entropy change per unit logit step, per token [B, T] float32:
    -dLoss/dH_t * q_t / T^2 (:func:`entropy_gradient_sq`), the part of tokens.entropy_effect that the
    bonus's gradient through H adds to grad_coef s / T^2 (schema: tokens.entropy_effect). dLoss/dH_t is
    exact from autograd on the loss's graph (whatever weights the loss gives the bonus; only the few
    [B, T] ops between the loss and ``entropy`` run; the graph is kept for the caller's backward).
    None where ``loss`` or ``entropy`` carries no gradient (then there is no bonus gradient to measure)."""
    if not (loss.requires_grad and entropy.requires_grad and torch.is_grad_enabled()):
        return None
    (d_h,) = torch.autograd.grad(loss, entropy, retain_graph=True, allow_unused=True)
    if d_h is None:  # the loss does not reach H: no bonus
        return torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    q = entropy_gradient_sq(logits, temperature=temperature, chunk_size=chunk_size)
    return torch.where(mask.bool(), -d_h.detach().float() * q / float(temperature) ** 2, 0.0)


@torch.no_grad()
def old_policy_pass(
    logits: torch.Tensor | None,
    tokens: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    hidden: torch.Tensor | None = None,
    head=None,
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The old policy's log-probs and full-vocabulary entropies, [B, T] each, in one chunked pass,
    from ``logits`` [B, T, V] or from ``hidden`` [B, T, H] + ``head`` (no logits built). With ``mask``
    [B, T], masked-out positions may hold any token id (-100 included: :func:`masked_tokens`)."""
    tokens = masked_tokens(tokens, mask)
    if logits is None:
        if hidden is None or head is None:
            raise ValueError("old_policy_pass needs logits, or hidden states and the head")
        weight, bias = _head_params(head)
        lp, ent, _ = head_stats(hidden, weight, tokens, bias=bias, temperature=temperature, chunk_size=chunk_size)
        return lp.float(), ent.float()
    lp, ent = logprobs_and_entropy(logits, tokens, temperature=temperature, chunk_size=chunk_size)
    return lp, ent


def policy_update(
    recorder: Recorder | None,
    step: int,
    update: int,
    logits: torch.Tensor | None,
    tokens: torch.Tensor,
    mask: torch.Tensor,
    advantages: torch.Tensor,
    old_logprobs: torch.Tensor,
    *,
    old_entropy: torch.Tensor | None = None,
    temperature: float = 1.0,
    seq_ids: torch.Tensor | None = None,
    group_ids: torch.Tensor | None = None,
    hidden: torch.Tensor | None = None,
    head=None,
    chunk_size: int | None = None,
    top_entropy_quantile: float = 1.0,
    entropy_gather=None,
    sampler_logprobs: torch.Tensor | None = None,
    is_masked: torch.Tensor | None = None,
    **loss_kwargs,
) -> PolicyLossOutput:
    """One policy update: log-probs and entropies, the loss (:func:`~entropylens.rl.losses.policy_loss`) and
    the recorded update. Call ``out.loss.backward()`` afterwards.

    ``logit_grad_norm`` (||dLoss/dz_t||_2 of this loss) is the exact closed form |grad_coef| / T * d_t:
    from ``logits`` [B, T, V], d_t = ||e_a - p_t|| comes from the sensitivity pass's own sums (no
    cancellation as p_a -> 1, no pass over the gradient); with an entropy bonus, whose gradient also
    reaches the logits through H, a hook on the logits measures it during the backward instead. From
    ``hidden`` [B, T, H] and ``head`` (``logits=None``): ``head_stats`` gives log-probs, entropies and
    sum_j p_j^2 without logits, d_t = sqrt(1 - 2 p + sum_j p_j^2) (null with an entropy bonus).

    ``entropy_effect`` with an entropy bonus (``entropy_coef``): from ``logits``, the bonus's own term
    (:func:`entropy_bonus_effect`: dLoss/dH_t from autograd, one more chunked pass over the logits for
    sum_j p_j^2 (log p_j + H)^2) is added to grad_coef s / T^2, as the loss column
    ``entropy_effect_bonus``; from ``hidden`` + ``head`` it is not measured and entropy_effect is null
    (the recorder's rule, token_columns.entropy_bonus_rule).

    An empty batch (B = 0 or T = 0: all of a step's samples filtered out) is an update like any other: a
    steps row with n_tokens 0, its means null.

    Args:
        recorder: the :class:`~entropylens.record.recorder.Recorder` that records the update, or None: the loss
            alone (no entropy sensitivity, no logit_grad_norm from logits).
        step: the step, as ``Recorder.record_update``.
        update: the update's index within the step, as ``Recorder.record_update``.
        logits: [B, T, V] the training forward pass's logits (before the temperature), or None with ``hidden``
            and ``head``.
        tokens: [B, T] the sampled token ids. Masked-out positions may hold any id (HF's -100 included;
            :func:`masked_tokens`): only masked-in ids are checked against the vocabulary.
        mask: [B, T] the response tokens.
        advantages: [B] (one per sequence) or [B, T].
        old_logprobs: [B, T] the old policy's log-probs (:func:`old_policy_pass`).
        old_entropy: [B, T] the old policy's entropies (:func:`old_policy_pass`), or None (no entropy ratio,
            no ERC).
        temperature: the sampling temperature T: log-probs and entropies are softmax(z / T)'s. Default 1.0.
        seq_ids: [B] sequence ids, as ``Recorder.record_update``, or None.
        group_ids: [B] group ids, as ``Recorder.record_update``, or None.
        hidden: [B, T, H] the hidden states before the LM head, used (with ``head``) when ``logits`` is None:
            ``head_stats`` projects them in tiles, so no [B, T, V] tensor exists.
        head: the LM head (an ``nn.Linear`` with a [V, H] weight, or that weight tensor), with ``hidden``.
        chunk_size: positions per chunk of the chunked passes over the vocabulary (>= 1). None (default): as
            many as a fixed memory budget holds.
        top_entropy_quantile: the 80/20 forking-token rule, in [0, 1]: q < 1 keeps the policy term on the
            valid tokens at or above the (1 - q) entropy quantile (``entropylens.rl.forking.top_entropy_mask``,
            TRL's rule), recorded as tokens.token_kept; an entropy bonus then acts on the kept tokens as their
            mean entropy times ``scale`` (TRL's rule). 1.0 (default): off.
        entropy_gather: pools the quantile's entropies over processes (e.g. ``forking.gather_valid``); None
            (default): this process alone.
        sampler_logprobs: [B, T] the sampling engine's log-probs, recorded as given (tokens.sampler_logprob),
            or None.
        is_masked: [B, T] or [B, 1] bool, the tokens your IS correction masked, recorded as given
            (tokens.is_masked), or None.
        **loss_kwargs: ``policy_loss``'s keyword arguments (method, eps_low, eps_high, beta1, beta2, erc,
            dual_clip, entropy_coef, agg, scale, ...; entropy and old_entropy come from this call).
            ``entropy_coef`` may be an ``AdaptiveEntropyCoef``: its applied coefficient is used, each update's
            entropies over the bonus's tokens are added to its window, and the caller calls its ``step()``
            once per optimizer step (steps.entropy_coef / entropy_coef_adaptive record it).

    Returns:
        The ``policy_loss`` output (a :class:`~entropylens.rl.losses.PolicyLossOutput`), with the
        ``logit_grad_norm`` and ``entropy_effect_bonus`` columns where measured here.

    Raises:
        ValueError: when neither logits nor hidden and head are given, head has no [V, H] weight, token_mask
            comes with top_entropy_quantile < 1, top_entropy_quantile is outside [0, 1], mask and tokens
            differ in shape, or ``policy_loss`` or ``Recorder.record_update`` refuses its inputs.
    """
    tokens = masked_tokens(tokens, mask)
    ctrl = loss_kwargs.get("entropy_coef")
    if isinstance(ctrl, AdaptiveEntropyCoef):
        loss_kwargs["entropy_coef"] = ctrl.applied
    else:
        ctrl = None
    forking = float(top_entropy_quantile) < 1.0
    if forking and loss_kwargs.get("token_mask") is not None:
        raise ValueError("policy_update: give token_mask or top_entropy_quantile, not both")
    entropy_grad = bool(loss_kwargs.get("entropy_coef"))
    sum_p2, dist = None, None
    sens: list[torch.Tensor] = []  # the entropy sensitivity s, when asked for (with a recorder)
    if logits is None:
        if hidden is None or head is None:
            raise ValueError("policy_update needs logits, or hidden states and the head")
        weight, bias = _head_params(head)
        logprobs, entropy, sum_p2, *sens = head_stats(
            hidden,
            weight,
            tokens,
            bias=bias,
            temperature=temperature,
            chunk_size=chunk_size,
            sensitivity=recorder is not None,
        )
        if not entropy_grad:
            entropy = entropy.detach()
    else:
        training = logits.requires_grad and torch.is_grad_enabled()
        if recorder is not None and training and entropy_grad:
            recorder.watch_logits(logits)
        # recording: the entropy sensitivity s (entropy attribution) and d_t from the same chunked pass
        want_dist = recorder is not None and training and not entropy_grad
        logprobs, entropy, *sens = logprobs_and_entropy(
            logits,
            tokens,
            temperature=temperature,
            chunk_size=chunk_size,
            entropy_grad=entropy_grad,
            sensitivity=recorder is not None,
            one_hot_distance=want_dist,
        )
        if want_dist:
            dist = sens.pop()
    s_t = sens[0] if sens else None
    keep = None
    if forking or (top_entropy_quantile is not None and not 0.0 <= float(top_entropy_quantile) <= 1.0):
        keep = top_entropy_mask(entropy, mask, top_entropy_quantile, all_gather=entropy_gather)  # [B, T] bool
        loss_kwargs["token_mask"] = keep
        if (entropy_grad or ctrl is not None) and loss_kwargs.get("entropy_weights") is None:
            loss_kwargs["entropy_weights"] = bonus_weights(
                mask,
                keep,
                loss_kwargs.get("scale", 1.0),
                torch.float64 if logprobs.dtype == torch.float64 else torch.float32,
            )
    if ctrl is not None:  # the window of the optimizer step: the tokens the bonus acts on
        ctrl.observe(entropy, mask.float() if keep is None else mask.float() * keep.float())
    out = policy_loss(logprobs, old_logprobs, advantages, mask, entropy=entropy, old_entropy=old_entropy, **loss_kwargs)
    if ctrl is not None:
        out.config["entropy_coef_adaptive"] = ctrl.coef
        out.config.update(ctrl.settings())
    if forking:
        out.config["top_entropy_quantile"] = float(top_entropy_quantile)
    if sum_p2 is not None and not entropy_grad:
        out.columns["logit_grad_norm"] = logit_grad_norm_from_sum_p2(
            out.columns["grad_coef"], logprobs, sum_p2, temperature
        )
    if dist is not None:
        out.columns["logit_grad_norm"] = out.columns["grad_coef"].abs() / temperature * dist
    if recorder is not None and entropy_grad and logits is not None and s_t is not None:
        bonus = entropy_bonus_effect(out.loss, entropy, logits, mask, temperature=temperature, chunk_size=chunk_size)
        if bonus is not None:
            out.columns["entropy_effect_bonus"] = bonus
    if recorder is not None:
        recorder.record_update(
            step,
            update,
            mask=mask,
            advantages=advantages,
            logprobs=logprobs,
            old_logprobs=old_logprobs,
            entropy=entropy,
            old_entropy=old_entropy,
            tokens=tokens,
            seq_ids=seq_ids,
            group_ids=group_ids,
            loss=out,
            entropy_sensitivity=s_t,
            temperature=temperature,
            sampler_logprobs=sampler_logprobs,
            is_masked=is_masked,
        )
    return out


__all__ = [
    "AdaptiveEntropyCoef",
    "entropy_bonus_effect",
    "entropy_gradient_sq",
    "masked_tokens",
    "old_policy_pass",
    "policy_update",
]
