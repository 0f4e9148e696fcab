"""A TRL GRPOTrainer step with and without entropylens' instrumentation, in one process.

  python benchmarks/trl_overhead.py [--steps 20] [--rounds 3]

Trainers: TRL's own GRPOTrainer, and EntropyLensGRPOTrainer with full recording (TRL's loss kept;
TRL's fused head asked for log_sum_sq_probs too, a hook on the log-probs, rows recorded after the
backward), on the tiny offline setup of examples/trl_grpo.py. Rounds alternate the two; medians over
steps (the first two steps of each run are warm-up and skipped).
Last line: trl_overhead_ratio=<instrumented median / plain median>
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))


class StepTimer:
    def __init__(self):
        self.times: list[float] = []
        self._t0 = None

    def on_step_begin(self, *a, **k):
        self._t0 = time.perf_counter()

    def on_step_end(self, *a, **k):
        self.times.append(time.perf_counter() - self._t0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=32, help="model width (32: the test's tiny Qwen2)")
    a = ap.parse_args()
    from transformers import TrainerCallback
    from trl import GRPOTrainer

    import trl_grpo

    class Timer(StepTimer, TrainerCallback):
        def __init__(self):
            StepTimer.__init__(self)

    times = {"plain": [], "entropylens": []}
    with tempfile.TemporaryDirectory() as d:
        for r in range(a.rounds):
            for mode in times:
                el = trl_grpo.make_trainer(f"{d}/{mode}{r}", steps=a.steps, seed=r, run=f"{mode}{r}",
                                             hidden=a.hidden)
                if mode == "plain":  # the same model (same seed, fresh, unpatched), args and data, TRL's trainer
                    model = trl_grpo.build_model(el.processing_class, r, a.hidden)
                    tr = GRPOTrainer(model=model, reward_funcs=trl_grpo.digit_reward, args=el.args,
                                     train_dataset=el.train_dataset, processing_class=el.processing_class)
                    el.recorder.close()
                else:
                    tr = el
                timer = Timer()
                tr.add_callback(timer)
                tr.train()
                times[mode] += timer.times[2:]  # skip warm-up steps
    med = {m: statistics.median(t) for m, t in times.items()}
    print(f"TRL GRPOTrainer, Qwen2 width {a.hidden} on CPU, {a.rounds} rounds x {a.steps} steps, medians (ms):")
    for m, v in med.items():
        print(f"  {m:<12} {v * 1000:8.1f}")
    print(f"trl_overhead_ratio={med['entropylens'] / med['plain']:.3f}")


if __name__ == "__main__":
    main()
