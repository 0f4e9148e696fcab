"""A sampler that differs from the trainer in a controlled way: the toy's training-inference mismatch.

An inference engine (vLLM, SGLang) samples from its own probabilities, which differ from the trainer's:
bf16 logits, another kernel, a sampling temperature the trainer does not apply. The toy reproduces two
such gaps exactly. With z the trainer's logits of a position [.., V] and T the run's temperature:

- ``bf16``: the sampler rounds the logits to bfloat16 first: pi_s = softmax(bf16(z) / T).
- ``temp:S``: the sampler samples at temperature S x T: pi_s = softmax(z / (S T)). For the sampled token
  a, delta = log pi_old(a) - log pi_s(a) = (z_a / T - LSE(z / T)) - (z_a / (S T) - LSE(z / (S T))).

The trainer's old policy is pi_old = softmax(z / T). ``tis_weight`` is TIS's truncated importance weight
min(pi_old / pi_s, C) = min(exp(delta), C) (Yao et al. 2025), which the toy multiplies each token's
policy term by (policy_loss's ``is_weight``) when ``ToyConfig.tis`` is set.
"""

from __future__ import annotations

import re

import torch

_TEMP = re.compile(r"temp:([0-9]*\.?[0-9]+)")


def check_mismatch(text: str) -> str:
    """``text`` when it names a sampler ('' none, 'bf16', 'temp:S' with S > 0); else a one-line ValueError."""
    if text in ("", "bf16"):
        return text
    m = _TEMP.fullmatch(text)
    if m and float(m.group(1)) > 0:
        return text
    raise ValueError(f"mismatch: unknown sampler {text!r}; one of bf16, temp:S (S > 0, e.g. temp:1.1)")


def sampler_logits(z: torch.Tensor, mismatch: str) -> torch.Tensor:
    """The logits the sampler samples from, before the run's temperature: bf16(z), z / S, or z itself.
    [.., V] -> [.., V] float32."""
    z = z.float()
    if mismatch == "bf16":
        return z.to(torch.bfloat16).float()
    if mismatch.startswith("temp:"):
        return z / float(mismatch[len("temp:") :])
    return z


def sampler_logprobs(z: torch.Tensor, tokens: torch.Tensor, mismatch: str, temperature: float = 1.0) -> torch.Tensor:
    """log pi_s(a_t): the sampler's log-probability of each sampled token. z [B, T, V], tokens [B, T] ->
    [B, T] float32."""
    lp = torch.log_softmax(sampler_logits(z, mismatch) / temperature, dim=-1)  # [B, T, V]
    return lp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def tis_weight(old_logprobs: torch.Tensor, sampler_lp: torch.Tensor, cap: float) -> torch.Tensor:
    """TIS: min(exp(old_logprob - sampler_logprob), cap) per token [B, T] (detached)."""
    return torch.exp(old_logprobs - sampler_lp).clamp(max=cap).detach()


__all__ = ["check_mismatch", "sampler_logits", "sampler_logprobs", "tis_weight"]
