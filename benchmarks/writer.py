"""Tokens-table write throughput and size: entropylens' encodings against pyarrow's defaults.

  python benchmarks/writer.py [--rows 2000000] [--rows-per-file 262144] [--steps-files 300] [--claim-checks 2000]
                              [--busy-trainer [--busy-threads 1] [--busy-size 256]]

``--busy-trainer``: the tokens-table timing is also taken while a training thread is busy in the same process
(a Python loop of torch matmuls of --busy-size squared float32 matrices on --busy-threads intra-op threads: it
releases the GIL inside each matmul and takes it back between them, as a training loop does), alternating
passes with and without it; rows/s is wall time on the writing thread, its thread CPU printed beside it.

Values are shaped like a toy GRPO run (not uniform random): groups of 8 responses of 12-48 tokens,
a 40-token vocabulary, sampling probabilities mostly near 1 with a low-probability tail, one
advantage per sequence from group-normalised 0/1 rewards, ratios within a few percent of 1,
entropies in nats. One core (pyarrow's pool set to 1 thread), medians of 3 passes, in one process.
Then the steps file of one toy step (8 update rows, every aggregate, a few NaN = not measured, two
extra metrics): writer.write_steps (column-wise table, a small file: no compression, no statistics)
against the construction it replaced (one Python list per column, zstd-1 with statistics), alternating
file by file; thread CPU time per file (median), the same rows read back equal. Then the claim check
the writer makes before each file (one writer per run and rank), per check.
Last line: rows_per_s=<ours> bytes_per_row=<ours>
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from entropylens.record.writing.parquet import (
    TOKEN_DICT_COLUMNS,
    TOKEN_FLOAT_COLUMNS,
    steps_table_by_values,
    tokens_table,
    write_parquet_atomic,
    write_steps,
)
from entropylens.rl.aggregates import AGG_NAMES


def toy_like_rows(n: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(12, 49, size=n // 12 + 8)
    seq = np.repeat(np.arange(len(lengths), dtype=np.int32), lengths)[:n]
    pos = (np.arange(n) - np.searchsorted(seq, seq, side="left")).astype(np.int32)
    group = (seq // 8).astype(np.int32)
    reward = rng.random(len(lengths)) < 0.4
    g = np.arange(len(lengths)) // 8
    mean = np.bincount(g, reward) / np.bincount(g)
    std = np.sqrt(np.maximum(np.bincount(g, reward**2) / np.bincount(g) - mean**2, 0.0)) + 1e-4
    adv = ((reward - mean[g]) / std[g]).astype(np.float32)[seq]
    # logits of a peaked policy: most sampled tokens have p > 0.9, a tail below 0.2
    prob = np.where(rng.random(n) < 0.75, 1 - rng.beta(0.5, 20, n), rng.beta(1.2, 3, n)).astype(np.float32)
    prob = np.clip(prob, 1e-6, 1.0)
    old_logprob = np.log(prob).astype(np.float32)
    logratio = (rng.standard_normal(n) * 0.04 * (1 + 3 * (prob < 0.3))).astype(np.float32)
    logprob = (old_logprob + logratio).astype(np.float32)
    ratio = np.exp(logratio).astype(np.float32)
    old_entropy = (rng.gamma(1.2, 0.25, n) * (1.2 - prob)).astype(np.float32)
    entropy = (old_entropy * np.exp(rng.standard_normal(n) * 0.05)).astype(np.float32)
    quad = np.where(adv == 0, 0, np.where(adv > 0, np.where(prob >= 0.5, 1, 2), np.where(prob >= 0.5, 3, 4)))
    clip = np.where(ratio < 0.8, -1, np.where(ratio > 1.2, 1, 0)).astype(np.int8)
    grad_coef = (-adv * ratio / n * (clip == 0)).astype(np.float32)
    return {
        "update": np.full(n, 2, np.int16),
        "seq": seq,
        "group": group,
        "pos": pos,
        "token_id": np.minimum(rng.zipf(1.6, n), 40).astype(np.int32) - 1,
        "prob": prob,
        "logprob": logprob,
        "old_logprob": old_logprob,
        "ratio": ratio,
        "advantage": adv,
        "quadrant": quad.astype(np.int8),
        "clip": clip,
        "clipped": ((clip == -1) & (adv < 0)) | ((clip == 1) & (adv > 0)),
        "entropy": entropy,
        "old_entropy": old_entropy,
        "entropy_ratio": (entropy / old_entropy).astype(np.float32),
        "erc_kept": np.abs(np.log(entropy / old_entropy)) < 0.05,
        "grad_coef": grad_coef,
        "logit_grad_norm": (np.abs(grad_coef) * (1 - prob)).astype(np.float32),
    }


def write_ours(table: pa.Table, path: Path) -> None:
    write_parquet_atomic(table, path, dict_columns=TOKEN_DICT_COLUMNS, float_columns=TOKEN_FLOAT_COLUMNS)


def write_defaults(table: pa.Table, path: Path) -> None:
    pq.write_table(table, path, compression="zstd")


def run(fn, chunks, tmp: Path, reps: int = 3, cpu: list | None = None) -> tuple[float, float]:
    """(rows/s including Arrow table construction, bytes/row) over all chunks, median of ``reps`` passes;
    ``cpu``: gets the writing thread's CPU seconds per pass."""
    times, size = [], 0
    rows = sum(len(c["seq"]) for c in chunks)
    for rep in range(reps):
        size = 0
        t0, c0 = time.perf_counter(), time.thread_time()
        for i, c in enumerate(chunks):
            p = tmp / f"{fn.__name__}-{rep}-{i}.parquet"
            fn(tokens_table(c), p)
            size += p.stat().st_size
        times.append(time.perf_counter() - t0)
        if cpu is not None:
            cpu.append(time.thread_time() - c0)
    return rows / statistics.median(times), size / rows


class BusyTrainer:
    """A training thread kept busy (module docstring, ``--busy-trainer``): torch matmuls in a Python loop."""

    def __init__(self, threads: int, size: int) -> None:
        import threading

        import torch

        torch.set_num_threads(threads)
        self._torch, self._size = torch, size
        self._stop = threading.Event()
        self.matmuls = 0
        self._thread = threading.Thread(target=self._loop, name="busy-trainer", daemon=True)

    def _loop(self) -> None:
        torch = self._torch
        a = torch.randn(self._size, self._size)
        b = torch.randn(self._size, self._size)
        while not self._stop.is_set():
            a = torch.tanh(a @ b)  # the GIL is released inside each op, taken back between them
            self.matmuls += 1

    def __enter__(self) -> BusyTrainer:
        self._thread.start()
        time.sleep(0.2)  # running before the timing starts
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def busy_passes(chunks, tmp: Path, rounds: int, threads: int, size: int) -> dict:
    """Alternating passes of the tokens-table write without and with a busy training thread: rows/s (wall,
    median over passes), bytes/row, the writing thread's CPU per row, the trainer's matmuls per second."""
    rows = sum(len(c["seq"]) for c in chunks)
    out: dict = {"idle": [], "busy": [], "idle_cpu": [], "busy_cpu": [], "matmul_s": []}
    bpr = 0.0
    for r in range(rounds):
        for mode in ("idle", "busy") if r % 2 == 0 else ("busy", "idle"):
            cpu: list = []
            if mode == "busy":
                with BusyTrainer(threads, size) as busy:
                    t0, m0 = time.perf_counter(), busy.matmuls
                    rps, bpr = run(write_ours, chunks, tmp, reps=1, cpu=cpu)
                    out["matmul_s"].append((busy.matmuls - m0) / (time.perf_counter() - t0))
            else:
                rps, bpr = run(write_ours, chunks, tmp, reps=1, cpu=cpu)
            out[mode].append(rps)
            out[mode + "_cpu"].append(cpu[0] / rows)
    out["bpr"] = bpr
    return out


def toy_steps_rows(updates: int = 8, seed: int = 0) -> list[dict]:
    """A toy step's steps rows as the step table hands them over: floats (counts too), NaN where an
    aggregate was not measured, the update index, a learning rate and two extra metrics."""
    rng = np.random.default_rng(seed)
    rows = []
    for u in range(updates):
        row = {name: float(rng.random()) for name in AGG_NAMES}
        row.update({k: float(rng.integers(0, 4096)) for k in AGG_NAMES if k.startswith("n_")})
        row.update(
            {
                "lgn_mean_pa_hp": float("nan"),
                "erc_drop_frac": float("nan"),
                "update": u,
                "grad_norm": 0.5,
                "lr": 1e-3,
                "reward_mean": 0.4375,
                "accuracy": 0.25,
                "policy_entropy": 1.5,
            }
        )
        rows.append(row)
    return rows


def write_steps_before(run_dir: Path, step: int, rows: list[dict]) -> Path:
    """The steps file as written before: one Python list per column, zstd-1 with statistics."""
    path = run_dir / "before" / f"step={step}" / "rank=0" / "steps.parquet"  # as deep as ours: the same new dirs
    write_parquet_atomic(steps_table_by_values(rows), path)
    return path


def steps_files(n: int, tmp: Path) -> tuple[float, float, int]:
    """Median thread-CPU ms per steps file (ours, before; alternating) and the file's column count."""
    rows = toy_steps_rows()
    ours, before = [], []
    for i in range(n + 5):
        c0 = time.thread_time()
        a = write_steps(tmp, i, 0, rows)
        c1 = time.thread_time()
        b = write_steps_before(tmp, i, rows)
        c2 = time.thread_time()
        if i >= 5:  # warm-up
            ours.append(c1 - c0)
            before.append(c2 - c1)
    assert pq.read_table(a).equals(pq.read_table(b))  # the same columns, types, values and nulls
    return statistics.median(ours) * 1e3, statistics.median(before) * 1e3, pq.read_metadata(a).num_columns


def claim_checks(n: int, tmp: Path) -> tuple[float, float]:
    """Median thread-CPU and wall microseconds of one claim check (run_claim.Claim.check: a read of the
    ~200-byte claim file, done before every file the writer writes), against a steps file written the
    same way (write_steps), alternating."""
    from entropylens import storage
    from entropylens.record.run_dir.run_claim import Claim, claim

    run_dir = storage.location(tmp / "claimed")
    mine = Claim.new(run_dir, 0, 1)
    claim(run_dir, 0, 1, overwrite=False, writer=mine)
    rows = toy_steps_rows()
    cpu, wall = [], []
    for i in range(n + 5):
        w0, c0 = time.perf_counter(), time.thread_time()
        mine.check()
        c1, w1 = time.thread_time(), time.perf_counter()
        if i >= 5:
            cpu.append(c1 - c0)
            wall.append(w1 - w0)
        if i % 10 == 0:  # the check between real writes, as on the writer thread (not a hot cache loop only)
            write_steps(tmp / "claimed", i, 0, rows)
    return statistics.median(cpu) * 1e6, statistics.median(wall) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(
        description="Tokens-table write throughput (rows/s) and size (B/row): entropylens' encodings against pyarrow's defaults, optionally beside a busy training thread (see the module docstring)."
    )
    ap.add_argument("--rows", type=int, default=2_000_000)
    ap.add_argument("--rows-per-file", type=int, default=262_144)
    ap.add_argument("--steps-files", type=int, default=300, help="steps files per construction (0: skip)")
    ap.add_argument("--claim-checks", type=int, default=2000, help="claim checks timed (0: skip)")
    ap.add_argument("--busy-trainer", action="store_true", help="also time the writes beside a busy training thread")
    ap.add_argument("--busy-threads", type=int, default=1, help="the busy trainer's torch intra-op threads")
    ap.add_argument("--busy-size", type=int, default=256, help="the busy trainer's matrix size")
    ap.add_argument("--busy-rounds", type=int, default=6, help="alternating passes with / without it, each")
    a = ap.parse_args()
    pa.set_cpu_count(1)
    pa.set_io_thread_count(1)
    data = toy_like_rows(a.rows)
    chunks = [{k: v[i : i + a.rows_per_file] for k, v in data.items()} for i in range(0, a.rows, a.rows_per_file)]
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        run(write_ours, chunks[:1], tmp)  # warm-up
        base_rps, base_bpr = run(write_defaults, chunks, tmp)
        rps, bpr = run(write_ours, chunks, tmp)
        busy = busy_passes(chunks, tmp, a.busy_rounds, a.busy_threads, a.busy_size) if a.busy_trainer else None
        steps = steps_files(a.steps_files, tmp) if a.steps_files else None
        checks = claim_checks(a.claim_checks, tmp) if a.claim_checks else None
    print(f"{a.rows:,} token rows in files of {a.rows_per_file:,}, one core")
    print(f"{'encoding':<34} {'rows/s':>12} {'bytes/row':>10}")
    print(f"{'pyarrow defaults (zstd)':<34} {base_rps:12,.0f} {base_bpr:10.2f}")
    print(f"{'entropylens (dict+BSS, zstd-1)':<34} {rps:12,.0f} {bpr:10.2f}")
    print(f"speed x{rps / base_rps:.2f}, size x{bpr / base_bpr:.2f} against the defaults")
    if steps:
        print(
            f"steps file of a toy step (8 rows x {steps[2]} columns): {steps[0]:.3f} ms CPU, was "
            f"{steps[1]:.3f} ms (x{steps[0] / steps[1]:.2f}); same table read back"
        )
    if checks:
        print(
            f"claim check before each file: {checks[0]:.1f} us CPU, {checks[1]:.1f} us wall"
            + (f" ({checks[0] / (steps[0] * 1e3):.1%} of a steps file's CPU)" if steps else "")
        )
    if busy:
        idle_rps, busy_rps = statistics.median(busy["idle"]), statistics.median(busy["busy"])
        print(
            f"beside a busy training thread ({a.busy_threads} torch thread(s), {a.busy_size}^2 matmuls, "
            f"{statistics.median(busy['matmul_s']):,.0f} per s), {a.busy_rounds} alternating passes each: "
            f"{busy_rps:,.0f} rows/s ({', '.join(f'{x / 1e6:.2f}M' for x in busy['busy'])}), "
            f"{busy['bpr']:.2f} B/row; without it {idle_rps:,.0f} rows/s "
            f"({', '.join(f'{x / 1e6:.2f}M' for x in busy['idle'])}): x{busy_rps / idle_rps:.2f}; writing thread "
            f"CPU {statistics.median(busy['busy_cpu']) * 1e9:.0f} ns/row busy, "
            f"{statistics.median(busy['idle_cpu']) * 1e9:.0f} idle"
        )
        print(f"busy_rows_per_s={busy_rps:.0f} busy_bytes_per_row={busy['bpr']:.2f}")
    print(f"rows_per_s={rps:.0f} bytes_per_row={bpr:.2f}")


if __name__ == "__main__":
    main()
