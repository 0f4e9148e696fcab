"""Runs recorded with the real Recorder for the alarm tests (tests/test_alarms.py): one step = one update
of B=4 sequences x T=5 tokens through ``policy_loss`` (GRPO, token-mean), record_step's grad norm and lr,
record_sequences. Every knob is a function of the step, so a test builds a run that is stable by
construction and changes one thing to trigger one rule.

The stable run: ratio 1 (logprobs = old logprobs: nothing clipped, KL 0), flat entropy 1.0, advantages
(+1, -0.5, +1, -0.5) (none zero), grad norms 1.0 / 1.1 / 1.2 in turn, lr 1e-3, and an entropy
sensitivity of SENS on every token, so that the entropy budget is negative at every step:
budget = sum_t grad_coef_t * SENS = sum_t (-A_t / N) * SENS = -SENS * mean(A) (token-mean, ratio 1).
"""

from __future__ import annotations

import math

import torch

from entropylens import Recorder
from entropylens.rl.losses import policy_loss

B, T = 4, 5
N = B * T
ADV = (1.0, -0.5, 1.0, -0.5)
OLD_LOGP = -0.7  # sampling probability exp(-0.7) = 0.50 (HP at tau 0.5)
SENS = 0.4
BUDGET = -SENS * sum(ADV) / len(ADV)  # -0.1 at every step of the stable run
ERC = (0.95, 1.05)


def stable_grad_norm(step: int, update: int = 0) -> float:
    return (1.0, 1.1, 1.2)[step % 3]


def record_run(
    root,
    run: str,
    steps: int = 24,
    *,
    entropy=lambda s: 1.0,
    drift=lambda s: 1.0,
    log_ratio=lambda s: torch.zeros(B, T),
    adv=lambda s: ADV,
    grad_norm=stable_grad_norm,
    lr=lambda s: 1e-3,
    erc=None,
    erc_kept=None,
    old_logp=lambda s: torch.full((B, T), OLD_LOGP),
    use_loss=True,
    alarms=None,
    sampler=None,
) -> str:
    """Records ``steps`` steps under root/run. entropy(s): the rollout policy's entropy of every token
    (old_entropy); drift(s): entropy = old_entropy * drift(s) (a float or a [B, T] tensor: rho);
    log_ratio(s): logprobs - old_logprobs [B, T]; adv(s): the 4 advantages; grad_norm(s, u), lr(s):
    record_step's values; erc: the ERC band of the loss; erc_kept(s): overrides the loss's erc_kept
    column (an ERC that is configured but not applied); use_loss=False records without a loss (the
    recorder derives ratio / clip itself; no budget, no loss); sampler(s): the mismatch [B, T]
    delta = old_logprobs - sampler_logprobs (None: no sampler log-probs). Returns the run directory's path."""
    mask = torch.ones(B, T, dtype=torch.bool)
    with Recorder(root, run=run, config={"method": "grpo", "lr": 1e-3}, fsync=False, alarms=alarms) as rec:
        for s in range(steps):
            old = old_logp(s)
            logp = old + log_ratio(s)
            a = torch.tensor(adv(s))
            h_old = torch.full((B, T), float(entropy(s)))
            h = h_old * drift(s)
            kw = {} if sampler is None else {"sampler_logprobs": old - sampler(s)}
            if use_loss:
                out = policy_loss(logp, old, a, mask, method="grpo", entropy=h, old_entropy=h_old, erc=erc)
                if erc_kept is not None:
                    out.columns["erc_kept"] = erc_kept(s)
                kw.update(loss=out, entropy_sensitivity=torch.full((B, T), SENS))
            rec.record_update(
                s,
                0,
                mask=mask,
                advantages=a,
                logprobs=logp,
                old_logprobs=old,
                entropy=h,
                old_entropy=h_old,
                seq_ids=torch.arange(B) + B * s,
                **kw,
            )
            rec.record_step(s, update=0, grad_norm=grad_norm(s, 0), lr=lr(s))
            rec.record_sequences(
                s, seq_ids=torch.arange(B) + B * s, rewards=a.clamp(min=0), advantages=a, lengths=torch.full((B,), T)
            )
    return str(root / run)


def k3(d: float) -> float:
    """KL k3 of one token with log ratio d, in float64: (r - 1) - log r."""
    return math.expm1(d) - d


def sampler_k3(d: float) -> float:
    """k3 of the sampler-trainer mismatch on one token as recorded: the sampler's log-prob is float32
    (old - d), the delta float32 old - that, in float64: exp(delta) - 1 - delta."""
    old = torch.tensor(OLD_LOGP, dtype=torch.float32)
    delta = float(old.double() - (old - torch.tensor(d, dtype=torch.float32)).double())
    return k3(delta)
