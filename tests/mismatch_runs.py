"""Hand-built runs for the sampler-trainer mismatch analyses (tests/read/test_analyses.py).

Run "m" (grpo) is tests/fixture_runs.py's run "a" with sampler log-probs: the four tokens t0..t3 (PA&HP,
PA&LP clipped, NA&LP clipped, NA&HP) get delta = old_logprob - sampler_logprob = 0, +0.2, -0.05, +0.3 at
every update; with mismatch=0.1, t1 and t3 are mismatched; the IS correction masked t3. Its steps rows:
step 0, updates of 10 and 30 tokens, with the values in STEP_MISMATCH. Run "n" is the same run recorded
without sampler log-probs: every mismatch column is NULL.
"""

import json
from pathlib import Path

import numpy as np
from fixture_runs import step_row, token_arrays

from entropylens.record.writing.parquet import write_sequences, write_steps, write_tokens

DELTA = [0.0, 0.2, -0.05, 0.3]
MASKED = [False, False, False, True]
# steps rows of step 0: (update 0: 10 tokens, update 1: 30 tokens)
STEP_MISMATCH = [
    {
        "sampler_abs_log_ratio_mean": 0.1,
        "sampler_abs_log_ratio_max": 0.5,
        "sampler_kl_k1": 0.01,
        "sampler_kl_k3": 0.02,
        "is_masked_frac": 0.0,
        "clipped_mismatched_frac": 0.5,
    },
    {
        "sampler_abs_log_ratio_mean": 0.2,
        "sampler_abs_log_ratio_max": 0.9,
        "sampler_kl_k1": 0.03,
        "sampler_kl_k3": 0.04,
        "is_masked_frac": 0.1,
        "clipped_mismatched_frac": 0.25,
    },
]


def build(root: Path) -> Path:
    for run, with_sampler in (("m", True), ("n", False)):
        d = root / run
        d.mkdir(parents=True)
        (d / "run.json").write_text(
            json.dumps(
                {
                    "run": run,
                    "method": "grpo",
                    "status": "finished",
                    "eps_low": 0.2,
                    "eps_high": 0.2,
                    "tau": 0.5,
                    "schema_version": 4,
                    "config": {"method": "grpo"},
                }
            )
        )
        for step, updates in {0: [0, 1], 1: [0]}.items():
            for u in updates:
                arrs = token_arrays(u, step)
                if with_sampler:
                    arrs["sampler_logprob"] = arrs["old_logprob"] - np.array(DELTA, np.float32)
                    arrs["is_masked"] = np.array(MASKED)
                write_tokens(d, step, 0, u, arrs)
            rows = [step_row(0, 10, 1.0, 2.0, 0.01), step_row(1, 30, 2.0, 4.0, 0.03)][: len(updates)]
            if with_sampler:
                rows = [{**r, **STEP_MISMATCH[i]} for i, r in enumerate(rows)]
            write_steps(d, step, 0, rows)
            write_sequences(
                d,
                step,
                0,
                0,
                {
                    "seq": np.array([0, 1], np.int32) + 2 * step,
                    "group": np.zeros(2, np.int32),
                    "reward": np.array([0.25, 0.75], np.float32),
                    "advantage": np.array([1.0, -1.0], np.float32),
                    "length": np.array([2, 2], np.int32),
                },
            )
    return root
