"""One micro-batch as the loss function reads it: verl's no-padding TensorDict and the engine's nested
model outputs, as [B, T] tensors over the response positions (:func:`read_micro_batch`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .names import OLD_ENTROPY_KEYS, REWARD_KEYS, SAMPLE_ID, STEP


@dataclass
class MicroBatch:
    """A micro-batch's tensors, each [B, T] over the response positions (T: the padded response width)."""

    data: Any  # verl's micro-batch TensorDict (nested tensors, non-tensor entries)
    keys: set  # its keys
    td: Any  # its fields the loss reads, padded (responses, sample ids, steps, the score, ...)
    mask: torch.Tensor  # bool: response_mask
    log_prob: torch.Tensor  # the current policy's, carries grad
    entropy: torch.Tensor | None  # the current policy's (model_output["entropy"])
    sum_pi_squared: torch.Tensor | None
    old_log_prob: torch.Tensor
    advantages: torch.Tensor
    old_entropy: torch.Tensor | None  # the first of OLD_ENTROPY_KEYS in the batch, float32
    rollout_log_prob: torch.Tensor | None = None  # the rollout engine's (rollout_log_probs): tokens.sampler_logprob
    is_weight: torch.Tensor | None = None  # verl's rollout correction weights (rollout_is_weights): tokens.is_weight

    @property
    def width(self) -> int:
        return self.mask.shape[-1]


def read_micro_batch(model_output, data) -> MicroBatch:
    """``model_output`` (the engine's nested log_probs, entropy, sum_pi_squared) and verl's micro-batch
    ``data`` as a :class:`MicroBatch`."""
    keys = set(data.keys())
    old_key = next((k for k in OLD_ENTROPY_KEYS if k in keys), None)
    fields = ["response_mask", "old_log_probs", "advantages", "responses"]
    fields += [k for k in ("rollout_is_weights", "rollout_log_probs", "ref_log_prob", SAMPLE_ID, STEP) if k in keys]
    fields += [k for k in REWARD_KEYS if k in keys][:1]  # the score, for the sequences rows
    if old_key is not None:
        fields.append(old_key)
    td = data.select(*fields).to_padded_tensor()
    mask = td["response_mask"].bool()  # [B, T]
    width = mask.shape[-1]
    entropy = model_output.get("entropy", None)
    spp = model_output.get("sum_pi_squared", None)
    return MicroBatch(
        data=data,
        keys=keys,
        td=td,
        mask=mask,
        log_prob=padded(model_output["log_probs"], data, width),
        entropy=padded(entropy, data, width) if entropy is not None else None,
        sum_pi_squared=padded(spp, data, width) if spp is not None else None,
        old_log_prob=fit(td["old_log_probs"], width),
        advantages=fit(td["advantages"], width),
        old_entropy=fit(td[old_key], width).float() if old_key is not None else None,
        rollout_log_prob=fit(td["rollout_log_probs"], width).float() if "rollout_log_probs" in keys else None,
        is_weight=fit(td["rollout_is_weights"], width) if "rollout_is_weights" in keys else None,
    )


def non_tensor(data, key: str, default=None):
    """A non-tensor entry of verl's micro-batch TensorDict (tensordict_utils.get_non_tensor_data)."""
    from verl.utils import tensordict_utils as tu

    return tu.get_non_tensor_data(data=data, key=key, default=default)


def padded(tensor, data, width: int):
    """A model output (nested over prompt+response) as [B, width] response positions."""
    from verl.workers.utils.padding import no_padding_2_padding

    return fit(no_padding_2_padding(tensor, data), width)


def fit(t: torch.Tensor, width: int) -> torch.Tensor:
    """Crop or zero-pad the last dim of a [B, T'] tensor to [B, width]."""
    if t.shape[-1] == width:
        return t
    if t.shape[-1] > width:
        return t[..., :width]
    return torch.nn.functional.pad(t, (0, width - t.shape[-1]))


def response_lengths(data, b: int, width: int) -> torch.Tensor:
    """int64 [B]: each response's own length (the nested ``responses``' row lengths; ``width`` if not nested)."""
    r = data["responses"] if "responses" in data.keys() else None
    if r is not None and getattr(r, "is_nested", False):
        return r.offsets().diff().cpu().clamp(max=width).long()
    return torch.full((b,), width, dtype=torch.int64)
