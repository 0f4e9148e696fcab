"""Hand-built runs whose analysis answers are known by construction (see tests/read/test_analyses.py).

Run "a" (grpo, eps 0.2 / 0.2), step 0 with updates 0 and 1 (the same four tokens seen twice), step 1
with update 0. The four tokens (seq, pos), advantage A, sampling prob p, ratio r, quadrant, clip:
  t0 (0, 0)  A=+1  p=0.95 r=1.0  PA&HP  inside
  t1 (0, 1)  A=+1  p=0.15 r=1.5  PA&LP  high side, clipped
  t2 (1, 0)  A=-1  p=0.12 r=0.5  NA&LP  low side, clipped
  t3 (1, 1)  A=-1  p=0.85 r=1.0  NA&HP  inside
entropy / old_entropy: update 0: t0 0.5/0.5, t1 1.2/1.0, t2 0.9/1.0, t3 2.0/2.0;
                       update 1: t0 0.4/0.5, t1 1.5/1.0, t2 0.7/1.0, t3 2.4/2.0.
logit_grad_norm t0..t3 = 1, 2, 3, 1. Run "b" (ce_gppo) holds one step of the same tokens (update 0).
Seq ids are run-unique: step 1's tokens are sequences 2 and 3 (a new rollout), not 0 and 1 again.
"""

import json
import math
from pathlib import Path

import numpy as np

from entropylens.record.writing.parquet import write_sequences, write_steps, write_tokens

P = [0.95, 0.15, 0.12, 0.85]  # bin centres away from float32 bin edges
R = [1.0, 1.5, 0.5, 1.0]
A = [1.0, 1.0, -1.0, -1.0]
Q = [1, 2, 4, 3]  # PA&HP, PA&LP, NA&LP, NA&HP codes
CLIP = [0, 1, -1, 0]
CLIPPED = [False, True, True, False]
H = {0: [0.5, 1.2, 0.9, 2.0], 1: [0.4, 1.5, 0.7, 2.4]}
H_OLD = [0.5, 1.0, 1.0, 2.0]
LGN = [1.0, 2.0, 3.0, 1.0]
# entropy attribution: the clipped t1, t2 keep no gradient (effect 0) and lost +0.4 / -0.2
EFFECT = [-0.1, 0.0, 0.0, 0.3]
DROPPED = [float("nan"), 0.4, -0.2, float("nan")]  # NaN = null: gradient unchanged
BUDGET = {
    "entropy_effect": 0.2,
    "entropy_effect_pa_hp": -0.1,
    "entropy_effect_pa_lp": 0.0,
    "entropy_effect_na_hp": 0.3,
    "entropy_effect_na_lp": 0.0,
    "entropy_effect_low": 0.0,
    "entropy_effect_high": 0.0,
    "entropy_effect_dropped": 0.2,
    "entropy_effect_dropped_pa_hp": 0.0,
    "entropy_effect_dropped_pa_lp": 0.4,
    "entropy_effect_dropped_na_hp": 0.0,
    "entropy_effect_dropped_na_lp": -0.2,
    "entropy_effect_dropped_low": -0.2,
    "entropy_effect_dropped_high": 0.4,
    # by cause (no ERC, no dual-clip): t2's low side, t1's high side; they add up to entropy_effect_dropped
    "entropy_effect_dropped_clip_low": -0.2,
    "entropy_effect_dropped_clip_high": 0.4,
}


def token_arrays(update: int, step: int = 0) -> dict:
    old = np.log(np.array(P, np.float32))
    return {
        "update": np.full(4, update, np.int16),
        "seq": np.array([0, 0, 1, 1], np.int32) + 2 * step,
        "group": np.zeros(4, np.int32),
        "pos": np.array([0, 1, 0, 1], np.int32),
        "token_id": np.array([3, 4, 5, 6], np.int32),
        "logprob": (old + np.log(np.array(R, np.float32))),
        "old_logprob": old,
        "advantage": np.array(A, np.float32),
        "quadrant": np.array(Q, np.int8),
        "clip": np.array(CLIP, np.int8),
        "clipped": np.array(CLIPPED),
        "entropy": np.array(H[update], np.float32),
        "old_entropy": np.array(H_OLD, np.float32),
        "grad_coef": np.array([-0.25] * 4, np.float32),
        "logit_grad_norm": np.array(LGN, np.float32),
        "entropy_effect": np.array(EFFECT, np.float32),
        "entropy_effect_dropped": np.array(DROPPED, np.float32),
    }


def step_row(update: int, n_tokens: int, old_entropy_mean: float, grad_norm: float, kl: float) -> dict:
    return {
        "update": update,
        "n_tokens": n_tokens,
        "entropy_mean": 1.0,
        "old_entropy_mean": old_entropy_mean,
        "clip_low_frac": 0.25,
        "clip_high_frac": 0.25,
        "n_pa_hp": 1,
        "n_pa_lp": 1,
        "n_na_hp": 1,
        "n_na_lp": 1,
        "n_za": 0,
        "grad_norm": grad_norm,
        "kl_k3": kl,
        "reward_mean": 0.5,
        **BUDGET,
    }


def build(root: Path) -> Path:
    for run, method, steps in (("a", "grpo", {0: [0, 1], 1: [0]}), ("b", "ce_gppo", {0: [0]})):
        d = root / run
        d.mkdir(parents=True)
        (d / "run.json").write_text(
            json.dumps(
                {
                    "run": run,
                    "method": method,
                    "status": "finished",
                    "eps_low": 0.2,
                    "eps_high": 0.2,
                    "tau": 0.5,
                    "schema_version": 1,
                    "config": {"method": method, "lr": 0.001},
                }
            )
        )
        for step, updates in steps.items():
            for u in updates:
                write_tokens(d, step, 0, u, token_arrays(u, step))
            # step 0: updates with 10 and 30 tokens, old entropy 1 and 2 -> token-weighted 1.75
            rows = [step_row(0, 10, 1.0, 2.0, 0.01), step_row(1, 30, 2.0, 4.0, 0.03)][: len(updates)]
            write_steps(d, step, 0, rows)
            write_sequences(
                d,
                step,
                0,
                0,
                {
                    "seq": np.array([0, 1], np.int32) + 2 * step,
                    "group": np.zeros(2, np.int32),
                    "reward": np.array([0.25, 0.75 + step * 0.1], np.float32),
                    "advantage": np.array([1.0, -1.0], np.float32),
                    "length": np.array([2, 2], np.int32),
                },
            )
    return root


MEAN_ABS_LOG = {  # run a, per prob bin (bins=10): |ln rho| over its 3 rows (step0 u0, u1, step1 u0)
    9: (0 + abs(math.log(0.8)) + 0) / 3,  # t0: rho 1, 0.8, 1
    8: (0 + abs(math.log(1.2)) + 0) / 3,  # t3: rho 1, 1.2, 1
    1: (
        abs(math.log(1.2))
        + abs(math.log(1.5))
        + abs(math.log(1.2))
        + abs(math.log(0.9))
        + abs(math.log(0.7))
        + abs(math.log(0.9))
    )
    / 6,  # t1 and t2
}
