"""What background work costs the toy's training step, by kind: the question behind the recorder's
writer (a thread today; would a writer process help?). Asserts nothing about time.

A background thread at the writer's priority (SCHED_IDLE, or its nice value) burns a fixed CPU budget during each step, in one of two
kinds of work:
  python   pure-Python arithmetic: holds the GIL, as the writer's bookkeeping does (a writer process
           would not compete for this process's GIL);
  native   SHA-256 of a 1 MB buffer: C code that releases the GIL, as Parquet encoding and file writes
           do; it competes only for the cores, caches and memory (as a writer process would too).
Each step runs from the same saved state in every mode (benchmarks/overhead.py's pairing: the same
rollout and updates), the order of the modes rotating; printed: the median of the per-step paired
ratios mode / off with its 95% bootstrap interval.

  python benchmarks/contention.py [--steps 120] [--burn-ms 17] [--threads 1]
--burn-ms 17 is the writer thread's CPU per toy step (benchmarks/overhead.py's "writer cpu ms").
"""

import argparse
import hashlib
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from overhead import median_ci  # noqa: E402

from entropylens.demo.toy import config_for  # noqa: E402
from entropylens.demo.toy.train import ToyTrainer  # noqa: E402
from entropylens.record.writing.scheduling import WRITER_IDLE, WRITER_NICE, lower_priority  # noqa: E402

_BUFFER = os.urandom(1 << 20)


def python_work() -> None:
    """~0.2 ms of bytecode: the GIL is held throughout."""
    x = 0
    for i in range(2000):
        x += i * i


def native_work() -> None:
    """~0.8 ms of C (hashlib releases the GIL for buffers over 2 KB)."""
    hashlib.sha256(_BUFFER).digest()


class Burner:
    """A thread that, once per :meth:`start`, burns ``ms`` of its own CPU time in units of ``work``
    (with 2 ms pauses between units, as the writer's work arrives in pieces), at the writer's nice."""

    def __init__(self, work, ms: float):
        self.work, self.ms = work, ms
        self._go, self._done = threading.Event(), threading.Event()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        lower_priority(WRITER_NICE, idle=WRITER_IDLE)  # as the writer thread
        while True:
            self._go.wait()
            self._go.clear()
            t0 = time.thread_time()
            time.sleep(0.02)  # starts inside the step (after the rollout began)
            while time.thread_time() - t0 < self.ms / 1e3:
                self.work()
                time.sleep(0.002)
            self._done.set()

    def start(self) -> None:
        self._go.set()

    def wait(self) -> None:
        self._done.wait()
        self._done.clear()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--burn-ms", type=float, default=17.0, help="background CPU per step (the writer's: ~17 ms)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the training step")
    ap.add_argument("--sft-steps", type=int, default=50, help="supervised warm-up steps of the toy before RL")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    trainer = ToyTrainer(config_for("grpo", sft_steps=a.sft_steps))
    burners = {"off": None, "python": Burner(python_work, a.burn_ms), "native": Burner(native_work, a.burn_ms)}
    names = list(burners)
    wall = {m: [] for m in names}
    for i in range(a.steps + 2):  # two warm-up rounds
        state = trainer.state()
        for m in names[i % len(names) :] + names[: i % len(names)]:
            trainer.load_state(state)
            burner = burners[m]
            if burner:
                burner.start()
            t0 = time.perf_counter()
            trainer.rl_step(i, None)
            t1 = time.perf_counter()
            if burner:
                burner.wait()  # untimed: a burn that outlasts the step ends before the next mode
            if i >= 2:
                wall[m].append(t1 - t0)
    print(
        f"toy step, recorder off, {a.steps} steps per mode from the same states, torch threads {a.threads}; "
        f"background thread at {'SCHED_IDLE' if WRITER_IDLE else f'nice {WRITER_NICE}'} burning {a.burn_ms:g} ms CPU per step; load average "
        f"{os.getloadavg()[0]:.1f} at the end"
    )
    print(f"{'background':<10} {'wall ms':>9} {'paired ratio':>13} {'95% interval':>15}")
    for m in names:
        paired = [x / o for x, o in zip(wall[m], wall["off"])]
        lo, hi = median_ci(paired)
        print(f"{m:<10} {statistics.median(wall[m]) * 1e3:9.1f} {statistics.median(paired):13.3f} {lo:7.3f}-{hi:.3f}")


if __name__ == "__main__":
    main()
