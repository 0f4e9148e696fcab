"""A set of runs shaped like a user's own, recorded with the real Recorder and policy_loss.

Not the demo: synthetic rollouts with known numbers, so a test can compute every answer itself.

  run            method   config differs in         built so that
  grpo-lr1e-3    grpo     lr 1e-3                   entropy decays as H0 exp(-0.05 step)
  grpo-lr3e-3    grpo     lr 3e-3                   entropy decays as H0 exp(-0.15 step)   (same method: an lr sweep)
  erc-band       dapo     erc (0.9, 1.1)            entropy ratio spread 0.06: some tokens leave (0.9, 1.1),
                                                    more leave the paper's (0.95, 1.05)
  nan-grad       grpo     -                         grad norm NaN at step NAN_STEP
  zero-adv       grpo     -                         3 of 4 prompt groups all-equal rewards (A = 0), grad norm 0
                                                    at every other step
  stable         grpo     -                         ratio 1 and entropy ratio 1 (updates on the sampling policy),
                                                    flat entropy, finite grad norms, every group with a signal

Every run: STEPS steps of UPDATES updates each; B = 8 responses (4 groups of 2) of up to T = 6 tokens.
Update 0 is on-policy (ratio 1, entropy ratio 1); update 1 moves logprob and entropy by seeded noise.
:func:`build` returns, per run, what the test needs to check the report and ``check`` independently.
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import numpy as np
import torch

from entropylens import Recorder
from entropylens.alarms import NonFiniteWarning
from entropylens.rl.losses import policy_loss

STEPS, UPDATES, B, T, GROUP = 12, 2, 8, 6, 2
NAN_STEP = 6
H0 = 2.0  # initial mean token entropy (nats)

RUNS = {
    "grpo-lr1e-3": dict(method="grpo", lr=1e-3, decay=0.05),
    "grpo-lr3e-3": dict(method="grpo", lr=3e-3, decay=0.15),
    "erc-band": dict(method="dapo", lr=1e-3, decay=0.05, erc=(0.9, 1.1), rho_spread=0.06),
    "nan-grad": dict(method="grpo", lr=1e-3, decay=0.05, nan_step=NAN_STEP),
    "zero-adv": dict(method="grpo", lr=1e-3, decay=0.05, zero_groups=3),
    "stable": dict(method="grpo", lr=1e-3, decay=0.0, stable=True),
}


def _rollout(gen: torch.Generator, step: int, spec: dict):
    """One step's rollout: mask [B, T], old logprobs [B, T], old entropy [B, T], rewards [B], advantages [B]."""
    lengths = torch.randint(3, T + 1, (B,), generator=gen)  # [B]
    mask = torch.arange(T)[None, :] < lengths[:, None]  # [B, T]
    p = 0.05 + 0.9 * torch.rand(B, T, generator=gen)  # [B, T] sampling probabilities
    old_logp = p.log()
    h = H0 * math.exp(-spec.get("decay", 0.0) * step)
    old_h = h * (0.5 + torch.rand(B, T, generator=gen))  # [B, T], mean h
    rewards = torch.tensor([1.0, 0.0] * (B // 2))  # [B]: one right, one wrong per group of 2
    for g in range(spec.get("zero_groups", 0)):  # all-equal rewards: zero advantage
        rewards[g * GROUP : (g + 1) * GROUP] = 1.0
    r = rewards.view(-1, GROUP)
    adv = (r - r.mean(1, keepdim=True)).view(-1)  # [B]: +-0.5, or 0 in an all-equal group
    return mask, old_logp, old_h, rewards, adv, lengths


def record_run(root: Path, run: str, spec: dict, seed: int = 0) -> dict:
    """Records one run; returns its expected numbers (per step: entropy, grad norm; per run: tokens
    outside its ERC band or the paper's reference band)."""
    gen = torch.Generator().manual_seed(seed + sum(map(ord, run)))
    erc = spec.get("erc")
    config = {"method": spec["method"], "lr": spec["lr"], "seed": seed, "model": "tiny-gru", "steps": STEPS}
    if erc:
        config["erc"] = list(erc)
    expected = {"old_entropy": {}, "grad_norm": {}, "rho": [], "band": erc or (0.95, 1.05), "zero_adv_share": {}}
    with Recorder(root, run, config=config) as rec:
        for step in range(STEPS):
            mask, old_logp, old_h, rewards, adv, lengths = _rollout(gen, step, spec)
            seq_ids = torch.arange(B) + step * B
            groups = torch.arange(B) // GROUP + step * (B // GROUP)
            rec.record_sequences(
                step, seq_ids=seq_ids, rewards=rewards, advantages=adv, lengths=lengths, group_ids=groups
            )
            for u in range(UPDATES):
                moved = u > 0 and not spec.get("stable")
                noise = torch.randn(B, T, generator=gen) if moved else torch.zeros(B, T)
                logp = (old_logp + 0.15 * noise).clamp(max=0.0)  # [B, T]
                rho = (
                    torch.exp(spec.get("rho_spread", 0.03) * torch.randn(B, T, generator=gen))
                    if moved
                    else torch.ones(B, T)
                )
                h = old_h * rho  # [B, T]
                out = policy_loss(
                    logp, old_logp, adv, mask, method=spec["method"], entropy=h, old_entropy=old_h, erc=erc
                )
                rec.record_update(
                    step,
                    u,
                    mask=mask,
                    advantages=adv,
                    logprobs=logp,
                    old_logprobs=old_logp,
                    entropy=h,
                    old_entropy=old_h,
                    seq_ids=seq_ids,
                    group_ids=groups,
                    loss=out,
                )
                if spec.get("nan_step") == step and u == UPDATES - 1:
                    gn = float("nan")
                elif spec.get("zero_groups") and step % 2 == 1:
                    gn = 0.0
                else:
                    gn = 0.5 + 0.01 * step + 0.001 * u
                rec.record_step(step, update=u, grad_norm=gn, lr=spec["lr"])
                expected["grad_norm"].setdefault(step, []).append(gn)
                expected["rho"].append(((h + 1e-8) / (old_h + 1e-8))[mask].double().numpy())
            m = mask.double()
            expected["old_entropy"][step] = float((old_h.double() * m).sum() / m.sum())  # same every update
            expected["zero_adv_share"][step] = float((adv == 0).double().mean())
    expected["rho"] = np.concatenate(expected["rho"])
    lo, hi = expected["band"]
    expected["outside_band"] = float(((expected["rho"] <= lo) | (expected["rho"] >= hi)).mean())
    return expected


def build(root: Path) -> tuple[Path, dict]:
    """Records every run of :data:`RUNS` under ``root``; returns (root, {run: expected numbers})."""
    root = Path(root)
    out = {}
    for run, spec in RUNS.items():
        with warnings.catch_warnings(record=True) as caught:  # the NaN grad norm warns, on purpose: said once
            warnings.simplefilter("always", NonFiniteWarning)
            out[run] = record_run(root, run, spec)
        said = [w for w in caught if issubclass(w.category, NonFiniteWarning)]
        assert len(said) == (1 if spec.get("nan_step") is not None else 0), (run, [str(w.message) for w in said])
        for w in caught:  # anything else is not ours to swallow
            if not issubclass(w.category, NonFiniteWarning):
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    return root, out
