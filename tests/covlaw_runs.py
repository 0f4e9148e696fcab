"""Runs recorded with the real Recorder whose Cui et al. analyses are known by construction
(tests/read/test_analyses.py, tests/report/test_covlaw_report.py).

``record_run(root, run, steps)``: every step one rollout of B = 8 responses (4 groups of 2) of T = 6 tokens and
two updates; the rollout policy's entropy is the same at every token of a step, H_s = H0 exp(-DECAY s) (so the
steps' old_entropy_mean is H_s exactly), and the step's mean reward is B_FIT - A_FIT exp(H_s) exactly (the
responses get that mean +- 0.25). The log-probabilities are seeded noise plus a part along the advantage,
log pi = noise + k_s A with k_s = 4 (H_s - H_{s+1}) / ETA, so Cov(log pi, A) ~ (H_s - H_{s+1}) / ETA and the
entropy change follows the covariance law with step size ETA (A = +-0.5: Var A = 0.25).
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from entropylens import Recorder
from entropylens.rl.losses import policy_loss

B, T, GROUP, UPDATES = 8, 6, 2, 2
H0, DECAY = 2.0, 0.08
A_FIT, B_FIT = 0.05, 0.9  # the entropy-performance law the rewards follow
ETA = 0.5  # the covariance law's step size the log-probabilities follow


def entropy_at(step: int) -> float:
    return H0 * math.exp(-DECAY * step)


def record_run(root: Path, run: str, steps: int, seed: int = 0) -> Path:
    gen = torch.Generator().manual_seed(seed)
    with Recorder(root, run, config={"method": "grpo", "lr": 1e-3, "seed": seed, "steps": steps}) as rec:
        for step in range(steps):
            mask = torch.ones(B, T, dtype=torch.bool)  # [B, T]
            old_logp = (0.05 + 0.9 * torch.rand(B, T, generator=gen)).log()  # [B, T]
            old_h = torch.full((B, T), entropy_at(step))  # [B, T]
            mean_r = B_FIT - A_FIT * math.exp(entropy_at(step))
            rewards = torch.tensor([mean_r + 0.25, mean_r - 0.25] * (B // 2))  # [B]
            adv = torch.tensor([0.5, -0.5] * (B // 2))  # [B]
            k = 4 * (entropy_at(step) - entropy_at(step + 1)) / ETA
            seq_ids = torch.arange(B) + step * B
            groups = torch.arange(B) // GROUP + step * (B // GROUP)
            rec.record_sequences(
                step, seq_ids=seq_ids, rewards=rewards, advantages=adv, lengths=torch.full((B,), T), group_ids=groups
            )
            for u in range(UPDATES):
                logp = (old_logp + 0.3 * torch.randn(B, T, generator=gen) + k * adv[:, None]).clamp(max=0.0)  # [B, T]
                out = policy_loss(logp, old_logp, adv, mask, method="grpo", entropy=old_h, old_entropy=old_h)
                rec.record_update(
                    step,
                    u,
                    mask=mask,
                    advantages=adv,
                    logprobs=logp,
                    old_logprobs=old_logp,
                    entropy=old_h,
                    old_entropy=old_h,
                    seq_ids=seq_ids,
                    group_ids=groups,
                    loss=out,
                )
                rec.record_step(step, update=u, grad_norm=0.5, lr=1e-3)
    return Path(root)
