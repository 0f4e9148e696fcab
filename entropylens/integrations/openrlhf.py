"""OpenRLHF drop-in: its ``PolicyLoss`` with entropylens recording, and entropylens' losses as OpenRLHF
policy-loss types.

    from entropylens.integrations.openrlhf import PolicyLoss, patch_actor
    trainer.actor_loss_fn = PolicyLoss(clip_eps_low=0.2, clip_eps_high=0.28, recorder=rec)  # same arguments
    patch_actor(trainer)  # step / update ids, and the actor's entropy when it returns one

``policy_loss_type`` "ppo" and "gspo" run OpenRLHF's own forward (super().forward, unchanged: the same loss,
gradient and metrics) with a :class:`~entropylens.integrations.loss_hook.LossHook` beside it. "gppo",
"ce_gppo" and "erc" (GRPO's clip with the entropy-ratio band ``erc``) run ``entropylens.rl.losses.policy_loss``
with OpenRLHF's aggregation as explicit weights (:func:`openrlhf_weights`) and return the same five values.
OpenRLHF's IS correction applies to ppo and gspo only (as in 0.11.2); with an entropylens type it is refused.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from ..rl.losses import policy_loss
from .loss_hook import LossHook
from .openrlhf_load import load_loss_module

if TYPE_CHECKING:
    from ..record.recorder import Recorder

_loss = load_loss_module()
OpenRLHFPolicyLoss: Any = _loss.PolicyLoss  # openrlhf.models.loss.PolicyLoss (loaded at run time: no types)
ENTROPYLENS_TYPES = ("gppo", "ce_gppo", "erc")  # OpenRLHF policy-loss types entropylens adds


def openrlhf_weights(
    mask: torch.Tensor,
    token_level_loss: bool,
    dp_size: int = 1,
    batch_num_tokens: float | torch.Tensor | None = None,
    global_batch_size: float | torch.Tensor | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Weights w [B, T] with which OpenRLHF 0.11.2's ``aggregate_loss`` reduces a per-token loss l:
    loss == sum(w l). Token level: m / sum(m) (or m dp / batch_num_tokens); sample level: m / (L_i + 1e-8)
    over the sequences with L_i > 0, / their count (or * dp / global_batch_size)."""
    m = mask.to(dtype)  # [B, T] in the log-probs' dtype
    if token_level_loss:
        return m / m.sum() if batch_num_tokens is None else m / batch_num_tokens * dp_size
    counts = m.sum(-1, keepdim=True)  # [B, 1]
    seq = (counts > 0).to(m.dtype)
    w = m / (counts + 1e-8) * seq
    return w / seq.sum() if global_batch_size is None else w / global_batch_size * dp_size


def loss_ratio(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    mask: torch.Tensor,
    policy_loss_type: str,
    rollout_log_probs: torch.Tensor | None = None,
    is_on: bool = False,
) -> torch.Tensor:
    """The ratio OpenRLHF's loss clips, [B, T] detached: per token exp(clamp(log r, -20, 20)) (ppo), the
    sequence's exp(mean_t log r) broadcast (gspo; against the rollout's log-probs with IS correction on)."""
    against = old_log_probs
    if policy_loss_type == "gspo" and is_on:
        if rollout_log_probs is None:  # OpenRLHF's own loss fails there too (log_probs - None)
            raise TypeError("gspo with IS correction on needs rollout_log_probs")
        against = rollout_log_probs
    lr = (log_probs - against).detach()
    if policy_loss_type != "gspo":
        return lr.clamp(-20.0, 20.0).exp()
    m = mask.to(lr.dtype)
    seq = (lr * m).sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp(min=1)
    return seq.exp().expand(lr.shape)


class PolicyLoss(OpenRLHFPolicyLoss):
    """OpenRLHF's PolicyLoss (same constructor) plus: ``recorder`` (an entropylens Recorder, or None: no
    recording), ``beta1`` / ``beta2`` (ce_gppo), ``erc`` (low, high) (erc), ``temperature`` (the sampling
    temperature), ``on_error`` (the hook's: "warn" never stops training). ``step`` / ``update``: the ids
    the next forward records under (:func:`patch_actor` sets them; else update counts forwards)."""

    def __init__(
        self,
        clip_eps_low: float = 0.2,
        clip_eps_high: float = 0.2,
        dual_clip: float | None = None,
        token_level_loss: bool = True,
        policy_loss_type: str = "ppo",
        is_correction_level: str = "off",
        is_correction_mode: str = "mask",
        is_correction_gating: str = "ratio",
        is_correction_threshold: Sequence[float] = (0.5, 5.0),
        *,
        recorder: Recorder | None = None,
        beta1: float = 0.5,
        beta2: float = 1.0,
        erc: tuple[float, float] = (0.8, 1.2),
        temperature: float = 1.0,
        on_error: str = "warn",
    ) -> None:
        ours = policy_loss_type in ENTROPYLENS_TYPES
        if ours and is_correction_level != "off":
            raise ValueError(
                f"policy_loss_type={policy_loss_type!r}: OpenRLHF's IS correction applies to ppo and "
                f"gspo only; pass is_correction_level='off'"
            )
        super().__init__(
            clip_eps_low,
            clip_eps_high,
            dual_clip,
            token_level_loss,
            "ppo" if ours else policy_loss_type,
            is_correction_level,
            is_correction_mode,
            is_correction_gating,
            is_correction_threshold,
        )
        self.policy_loss_type = policy_loss_type
        self.beta1, self.beta2, self.erc = beta1, beta2, tuple(erc)
        method = {"erc": "grpo"}.get(policy_loss_type, policy_loss_type)
        self.hook = LossHook(
            recorder,
            names="openrlhf",
            eps_low=clip_eps_low,
            eps_high=clip_eps_high,
            dual_clip=dual_clip,
            temperature=temperature,
            on_error=on_error,
            config={"method": method},
        )
        self.step, self.update = 0, 0
        self.entropy = self.old_entropy = None  # [B, T] for the next forward (patch_actor), or None

    def forward(
        self,
        log_probs: torch.Tensor,
        old_log_probs: torch.Tensor,
        advantages: torch.Tensor,
        action_mask: torch.Tensor | None = None,
        rollout_log_probs: torch.Tensor | None = None,
        dp_size: int = 1,
        batch_num_tokens: float | torch.Tensor | None = None,
        global_batch_size: float | torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """OpenRLHF's forward (its arguments and its five outputs), recorded (module docstring)."""
        entropy, old_entropy, self.entropy, self.old_entropy = self.entropy, self.old_entropy, None, None
        if self.hook.recorder is not None and action_mask is not None:
            is_on = self.is_correction_level != "off"
            self.hook.watch(
                self.step,
                self.update,
                log_probs=log_probs,
                old_log_probs=old_log_probs,
                advantages=advantages,
                action_mask=action_mask,
                rollout_log_probs=rollout_log_probs,
                entropy=entropy,
                old_entropy=old_entropy,
                clip_ratio=loss_ratio(
                    log_probs, old_log_probs, action_mask, self.policy_loss_type, rollout_log_probs, is_on
                ),
            )
        self.update += 1
        if self.policy_loss_type not in ENTROPYLENS_TYPES:
            return super().forward(
                log_probs,
                old_log_probs,
                advantages,
                action_mask,
                rollout_log_probs,
                dp_size,
                batch_num_tokens,
                global_batch_size,
            )
        return self._entropylens_forward(
            log_probs,
            old_log_probs,
            advantages,
            action_mask,
            dp_size,
            batch_num_tokens,
            global_batch_size,
            entropy,
            old_entropy,
        )

    def _entropylens_forward(
        self,
        log_probs,
        old_log_probs,
        advantages,
        action_mask,
        dp_size,
        batch_num_tokens,
        global_batch_size,
        entropy,
        old_entropy,
    ):
        mask = action_mask if action_mask is not None else torch.ones_like(log_probs, dtype=torch.bool)
        w = openrlhf_weights(mask, self.token_level_loss, dp_size, batch_num_tokens, global_batch_size, log_probs.dtype)
        kw = dict(
            method={"erc": "grpo"}.get(self.policy_loss_type, self.policy_loss_type),
            eps_low=self.clip_eps_low,
            eps_high=self.clip_eps_high,
            dual_clip=self.dual_clip,
            weights=w,
        )
        if self.policy_loss_type == "ce_gppo":
            kw.update(beta1=self.beta1, beta2=self.beta2)
        if self.policy_loss_type == "erc":
            if entropy is None or old_entropy is None:
                raise ValueError(
                    "policy_loss_type='erc' needs the entropy and the old policy's entropy: set "
                    "loss.entropy and loss.old_entropy [B, T] before the call (OpenRLHF 0.11.2 keeps "
                    "no old entropy in its experience)"
                )
            kw.update(erc=self.erc, entropy=entropy.detach(), old_entropy=old_entropy.detach())
        out = policy_loss(log_probs, old_log_probs, advantages, mask.bool(), **kw)
        ratio = (log_probs - old_log_probs).clamp(-20.0, 20.0).exp().detach()
        surr1, surr2 = ratio * advantages, ratio.clamp(1 - self.clip_eps_low, 1 + self.clip_eps_high) * advantages
        # OpenRLHF's metrics as its forward computes them: masked means over the mask as given (clip_ratio float32)
        clip_ratio = (torch.lt(surr2, surr1).float() * mask).sum() / mask.sum()
        ppo_kl = (-(log_probs - old_log_probs).detach() * mask).sum() / mask.sum()
        return out.loss, clip_ratio, ppo_kl, None, None


def patch_actor(trainer: Any, *, step_of: Callable[[Any], int] | None = None) -> None:
    """Wire an OpenRLHF actor trainer (``openrlhf.trainer.ray.ppo_actor.ActorPPOTrainer``) to its
    entropylens ``PolicyLoss``: each ``ppo_train`` call is a step (``step_of(trainer)`` gives its id where
    given, else a count from 0), each ``training_step`` an update, and the actor's entropy (OpenRLHF's
    ``output.entropy`` when ``return_entropy``) is handed to the loss of the same micro-batch."""
    loss = trainer.actor_loss_fn
    if not isinstance(loss, PolicyLoss):
        raise ValueError("patch_actor: trainer.actor_loss_fn must be entropylens.integrations.openrlhf.PolicyLoss")
    ppo_train, actor_forward = trainer.ppo_train, trainer.actor.forward
    count = {"step": 0}

    def patched_ppo_train(*a, **k):
        loss.step = int(step_of(trainer)) if step_of is not None else count["step"]
        loss.update = 0
        count["step"] += 1
        return ppo_train(*a, **k)

    def patched_forward(sequences, action_mask=None, *a, **k):
        out = actor_forward(sequences, action_mask, *a, **k)
        output = out[1] if isinstance(out, tuple) else None
        ent = getattr(output, "entropy", None) if output is not None else None
        if ent is None and isinstance(output, dict):
            ent = output.get("entropy")
        if ent is not None and action_mask is not None and torch.is_grad_enabled():
            loss.entropy = ent[:, -action_mask.shape[1] :]  # [B, T] as OpenRLHF's entropy loss slices it
        return out

    trainer.ppo_train = patched_ppo_train
    trainer.actor.forward = patched_forward


__all__ = ["ENTROPYLENS_TYPES", "OpenRLHFPolicyLoss", "PolicyLoss", "loss_ratio", "openrlhf_weights", "patch_actor"]
