"""A run recorded at a chosen tau (tests/read/test_retau.py, tests/report/test_run_findings.py)."""

from __future__ import annotations

import torch

from entropylens import Recorder
from entropylens.rl.losses import policy_loss

B, T, STEPS = 8, 6, 3


def record(
    root, run: str, tau: float, updates: int = 2, recompute_noise: float = 0.0, config: dict | None = None
) -> None:
    """The same seeded rollouts and updates (update 0 on the sampling policy, later ones moved: a loop with
    num_iterations = ``updates``), recorded with HP / LP split at ``tau``. ``recompute_noise``: every update's
    log-probs differ from the old ones by up to that much more (an old log-prob recomputed in another pass)."""
    gen = torch.Generator().manual_seed(7)
    with Recorder(root, run, config=config or {"method": "grpo"}, tau=tau) as rec:
        for step in range(STEPS):
            mask = torch.arange(T)[None, :] < torch.randint(3, T + 1, (B,), generator=gen)[:, None]  # [B, T]
            old = (0.02 + 0.96 * torch.rand(B, T, generator=gen)).log()  # [B, T]
            adv = torch.tensor([0.5, -0.5, 0.0, 0.0, 1.0, -1.0, 0.5, -0.5])  # [B], two zero-advantage rows
            for u in range(updates):
                logp = (old + 0.3 * u * torch.randn(B, T, generator=gen)).clamp(max=0.0)  # [B, T]
                if recompute_noise:
                    logp = (logp - recompute_noise * torch.rand(B, T, generator=gen)).clamp(max=0.0)
                out = policy_loss(logp, old, adv, mask, method="grpo", tau=tau)
                rec.record_update(
                    step,
                    u,
                    mask=mask,
                    advantages=adv,
                    logprobs=logp,
                    old_logprobs=old,
                    seq_ids=torch.arange(B) + step * B,
                    loss=out,
                )
                rec.record_step(step, update=u, grad_norm=1.0)
