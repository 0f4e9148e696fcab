"""Cui et al. 2025's covariance controls (Clip-Cov, KL-Cov), as verl 0.9.1 defines them
(``clip_cov`` / ``kl_cov`` in its policy-loss registry), and the per-token covariance term.

  cov_i = (A_i - mean A) (log pi_i - mean log pi)        means over the batch's valid (masked-in) tokens

the per-token term of Cov(log pi, A) (Cui et al.: the entropy change follows -Cov(log pi, pi A)).
The loss function (losses.policy_loss) calls these on detached tensors; they return masks and the
KL-Cov penalty, never a loss.

Clip-Cov (method ``clip_cov``: PPO-clip with the selection below; verl has no dual-clip in it):
  candidates = masked in, not PPO-clipped (nor dual-clipped / delta-capped), lb < cov_i < ub;
  n_clip = max(int(clip_cov_ratio * n_valid), 1); a uniformly random n_clip of the candidates
  (all of them when fewer) are selected: their per-token loss is multiplied by 0 (value and
  gradient, verl's ``corr``). The draw is verl's: ``torch.randperm(n_candidates)`` on the CPU over
  the candidates in row-major order, the first n_clip taken; ``generator`` (a torch.Generator) makes
  it reproducible, and without one the global CPU generator is used, as verl does, so
  ``torch.manual_seed(s)`` before the call reproduces verl's selection for the same batch.
KL-Cov (method ``kl_cov``: the unclipped surrogate -A r plus a penalty; verl's has no PPO clip):
  the k = max(1, int(kl_cov_ratio * n_valid)) valid tokens of largest cov_i (torch.topk; ties as topk
  breaks them) get + ppo_kl_coef |log r| in their per-token loss (gradient ppo_kl_coef sign(log r),
  0 where log r = 0, as autograd of abs). No random draw.
Both need the selection's size on the host: one host sync per update (as verl's own code).
"""

from __future__ import annotations

import torch

# verl 0.9.1's PolicyLossConfig defaults (workers/config/actor.py; ppo_trainer.yaml)
CLIP_COV_RATIO, CLIP_COV_LB, CLIP_COV_UB = 0.0002, 1.0, 5.0
KL_COV_RATIO, PPO_KL_COEF = 0.0002, 0.1
COV_METHODS: tuple[str, ...] = ("clip_cov", "kl_cov")


def token_covariance(advantage: torch.Tensor, logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """cov_i = (A_i - mean A)(logp_i - mean logp), means over mask's tokens; 0 off the mask. [B, T] in
    ``logp``'s dtype (detached). An empty mask gives 0 everywhere. No host sync."""
    m = mask.bool()
    dt = logp.dtype
    a = torch.where(m, advantage.detach().to(dt), 0.0)
    lp = torch.where(m, logp.detach(), torch.zeros((), dtype=dt, device=logp.device))
    n = m.sum().clamp(min=1).to(dt)
    cov = (a - a.sum() / n) * (lp - lp.sum() / n)  # [B, T]
    return torch.where(m, cov, torch.zeros((), dtype=dt, device=cov.device))


def clip_cov_select(
    cov: torch.Tensor,
    candidates: torch.Tensor,
    mask: torch.Tensor,
    ratio: float,
    lb: float,
    ub: float,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Clip-Cov's selected tokens [B, T] bool (module docstring): among ``candidates`` [B, T] bool with
    lb < cov < ub, a random max(int(ratio * n_valid), 1) of them (torch.randperm on ``generator``,
    default the global CPU generator)."""
    band = candidates & mask.bool() & (cov > lb) & (cov < ub)  # [B, T]
    n_valid, n_band = torch.stack([mask.bool().sum(), band.sum()]).tolist()  # one host sync
    out = torch.zeros_like(band)
    if n_band == 0:
        return out
    n_clip = max(int(ratio * n_valid), 1)
    idx = torch.nonzero(band)  # [n_band, 2], row-major
    dev = generator.device if generator is not None else torch.device("cpu")
    perm = torch.randperm(n_band, generator=generator, device=dev)[: min(n_clip, n_band)].to(idx.device)
    pick = idx[perm]
    out[pick[:, 0], pick[:, 1]] = True
    return out


def kl_cov_select(cov: torch.Tensor, mask: torch.Tensor, ratio: float) -> torch.Tensor:
    """KL-Cov's penalised tokens [B, T] bool: the max(1, int(ratio * n_valid)) valid tokens of largest
    cov (none without a valid token)."""
    m = mask.bool()
    n_valid = int(m.sum())  # host sync
    out = torch.zeros_like(m)
    if n_valid == 0:
        return out
    k = max(1, int(n_valid * ratio))
    flat = torch.where(m, cov, torch.full_like(cov, float("-inf"))).reshape(-1)
    out.view(-1)[torch.topk(flat, k, largest=True).indices] = True
    return out


def kl_cov_penalty(log_ratio: torch.Tensor, selected: torch.Tensor, coef: float):
    """(value, slope) [B, T] of KL-Cov's penalty coef |log r| on ``selected`` tokens (0 elsewhere);
    slope = d/dlogp = coef sign(log r). Detached."""
    lr = log_ratio.detach()
    zero = torch.zeros_like(lr)
    return torch.where(selected, coef * lr.abs(), zero), torch.where(selected, coef * torch.sign(lr), zero)
