"""Runs in the recorder's real file layout, written with entropylens.record.writing.parquet (no training): for the
reading-layer, storage and compaction tests. ``rows`` token rows per (step, rank), one file each."""

from __future__ import annotations

import json
from datetime import datetime, timezone

import numpy as np

from entropylens.record.writing.parquet import write_sequences, write_steps, write_tokens
from entropylens.storage import location


def token_arrays(n: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    seq = (np.arange(n) // 8).astype(np.int32)
    adv = np.where(seq % 2 == 0, 1.0, -1.0).astype(np.float32)
    logp = np.log(rng.uniform(0.05, 1.0, n)).astype(np.float32)
    old = (logp + rng.normal(0, 0.05, n)).astype(np.float32)
    return {
        "update": np.zeros(n, np.int16),
        "seq": seq,
        "group": seq // 4,
        "pos": (np.arange(n) % 8).astype(np.int32),
        "token_id": rng.integers(0, 50, n).astype(np.int32),
        "logprob": logp,
        "old_logprob": old,
        "advantage": adv,
        "quadrant": np.where(adv > 0, 1, 3).astype(np.int8),
        "clip": np.zeros(n, np.int8),
        "clipped": np.zeros(n, bool),
        "entropy": rng.uniform(0.1, 2.0, n).astype(np.float32),
        "old_entropy": rng.uniform(0.1, 2.0, n).astype(np.float32),
    }


def write_run_json(
    run_dir, name: str, status: str = "finished", heartbeat_age_s: float = 0.0, heartbeat_s: float = 10.0
) -> None:
    now = datetime.now(timezone.utc).timestamp()
    beat = datetime.fromtimestamp(now - heartbeat_age_s, timezone.utc).isoformat(timespec="seconds")
    info = {
        "run": name,
        "method": "grpo",
        "config": {"method": "grpo"},
        "status": status,
        "eps_low": 0.2,
        "eps_high": 0.2,
        "tau": 0.5,
        "schema_version": 1,
        "world_size": 1,
        "started_at": beat,
        "heartbeat_at": beat,
        "heartbeat_s": heartbeat_s,
    }
    (location(run_dir) / "run.json").write_text(json.dumps(info))


def write_step(run_dir, step: int, rank: int, rows: int, *, commit: bool = True, seed: int = 0) -> None:
    """Token and sequence files of (step, rank), then (commit=True) its steps file, as the recorder does."""
    d = location(run_dir)
    arrs = token_arrays(rows, seed * 1000 + step * 10 + rank)
    write_tokens(d, step, rank, 0, arrs)
    n_seq = rows // 8
    write_sequences(
        d,
        step,
        rank,
        0,
        {
            "seq": np.arange(n_seq, dtype=np.int32),
            "group": np.arange(n_seq, dtype=np.int32) // 4,
            "reward": np.ones(n_seq, np.float32),
            "advantage": np.ones(n_seq, np.float32),
            "length": np.full(n_seq, 8, np.int32),
        },
    )
    if commit:
        write_steps(
            d,
            step,
            rank,
            [
                {
                    "update": 0,
                    "n_tokens": rows,
                    "old_entropy_mean": 1.0,
                    "loss": 0.5,
                    "grad_norm": 1.0,
                    "lr": 1e-3,
                    "reward_mean": 0.5,
                }
            ],
        )


def make_run(
    root, name: str, steps: int, rows: int = 64, ranks: int = 1, status: str = "finished", heartbeat_age_s: float = 0.0
):
    d = location(root) / name
    d.mkdirs()
    write_run_json(d, name, status, heartbeat_age_s)
    for s in range(steps):
        for r in range(ranks):
            write_step(d, s, r, rows)
    return d
