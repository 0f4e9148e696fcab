"""The toy trainer's step time with the recorder off, on (sample=1, with watch_logits), and on with
sample=0.1, alternating in one process; medians over many steps. Asserts nothing about time.

  python benchmarks/overhead.py [--steps 30]
Last line: overhead_ratio=<full-recording median / off median>
"""

import argparse
import statistics
import tempfile
import time

import torch

from entropylens import Recorder
from entropylens.toy import config_for
from entropylens.toy.train import ToyTrainer


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=30, help="measured steps per mode")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=64, help="toy model width (64: the demo's ~90k parameters)")
    ap.add_argument("--prompts", type=int, default=16, help="prompts per step (x 8 samples)")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    trainer = ToyTrainer(config_for("grpo", sft_steps=50, hidden=a.hidden, prompts=a.prompts))
    with tempfile.TemporaryDirectory() as d:
        modes = {"off": None, "full": Recorder(d, run="full"), "sample=0.1": Recorder(d, run="s01", sample=0.1)}
        times = {m: [] for m in modes}
        for i in range(a.steps + 2):  # two warm-up rounds
            for m, rec in modes.items():
                t0 = time.perf_counter()
                trainer.rl_step(i, rec)
                if i >= 2:
                    times[m].append(time.perf_counter() - t0)
        for rec in modes.values():
            if rec:
                rec.close()
    base = statistics.median(times["off"])
    cfg = trainer.cfg
    print(f"toy step: width {cfg.hidden}, {cfg.prompts * cfg.group} sequences x 16 tokens, {cfg.updates} updates, "
          f"{a.steps} steps per mode, alternating, torch threads {a.threads}")
    print(f"{'recorder':<12} {'median ms':>10} {'ratio':>7}")
    for m, ts in times.items():
        med = statistics.median(ts)
        print(f"{m:<12} {med * 1000:10.1f} {med / base:7.3f}")
    print(f"overhead_ratio={statistics.median(times['full']) / base:.3f}")


if __name__ == "__main__":
    main()
