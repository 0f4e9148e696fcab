"""What ``Recorder(log_to="tensorboard")`` costs on top of recording: the toy trainer's step time with a
plain recorder and with one that also logs every step's ``entropylens/...`` metrics to TensorBoard,
alternating in one process, each step run by both from the same saved state (the same work bit for
bit; benchmarks/overhead.py's method). Asserts nothing about time.

  python benchmarks/trackers.py [--steps 40] [--threads 2]

A step's summary is asked for as it closes and logged at the recorder call after the writer thread
has answered (here: at the next step's first record call, inside the timed step), so the timed steps
hold the tracker's work on the training thread: the summary's reply check and TensorBoard's
add_scalar calls (the event file is written by TensorBoard's own thread).
Last line: trackers_ratio=<median of the per-step paired ratios, log_to="tensorboard" / recording>
"""

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from entropylens import Recorder
from entropylens.toy import config_for
from entropylens.toy.train import ToyTrainer


class _Answered:
    """A summary the writer has answered (what StepLog finds at a recorder call)."""

    def __init__(self, summary):
        self.summary = summary

    def ready(self):
        return True

    def result(self):
        return self.summary


def _direct_cost(logdir: Path, n: int = 400) -> float:
    """Median seconds of StepLog.log_ready for one answered step summary, to a real TensorBoard writer."""
    from entropylens.trackers import SUMMARY_NAMES, StepLog, TensorBoard

    summary = {"n_tokens": 2048.0, **{k: 0.25 for k in SUMMARY_NAMES}}
    log = StepLog([TensorBoard(logdir)], "direct", {})
    times = []
    for step in range(n):
        log.add(step, _Answered(summary))
        t0 = time.perf_counter()
        log.log_ready()
        times.append(time.perf_counter() - t0)
    log.close()
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=40, help="measured steps per mode")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=16, help="prompts per step (x 8 samples)")
    ap.add_argument("--sft-steps", type=int, default=50, help="supervised warm-up steps of the toy before RL")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    trainer = ToyTrainer(config_for("grpo", sft_steps=a.sft_steps, prompts=a.prompts))
    with tempfile.TemporaryDirectory() as d:
        modes = {"recording": Recorder(d, run="plain"),
                 "+tensorboard": Recorder(d, run="tb", log_to={"tensorboard": Path(d) / "tb"})}
        wall = {m: [] for m in modes}
        cpu = {m: [] for m in modes}
        names = list(modes)
        for i in range(a.steps + 2):  # two warm-up rounds
            state = trainer.state()
            for m in names[i % 2:] + names[: i % 2]:  # the order alternates every step
                trainer.load_state(state)
                rec = modes[m]
                t0, c0 = time.perf_counter(), time.thread_time()
                trainer.rl_step(i, rec)
                t1, c1 = time.perf_counter(), time.thread_time()
                rec._writer.drain()  # untimed: one recorder's writer work never lands in the other's step
                if i >= 2:
                    wall[m].append(t1 - t0)
                    cpu[m].append(c1 - c0)
        logged = modes["+tensorboard"]._step_log
        for rec in modes.values():
            rec.close()
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        acc = EventAccumulator(str(next((Path(d) / "tb").glob("events.*")).parent), size_guidance={"scalars": 0})
        acc.Reload()
        n_logged = len(acc.Scalars("entropylens/clip_low_frac"))
        # the same work timed alone (no step-time noise): a ready summary through StepLog to TensorBoard
        direct = _direct_cost(Path(d) / "tb-direct")
    print(f"toy step: {trainer.cfg.prompts * trainer.cfg.group} sequences, {trainer.cfg.updates} updates, "
          f"{a.steps} steps per mode, alternating, torch threads {a.threads}; TensorBoard got "
          f"{n_logged} steps x {len(acc.Tags()['scalars'])} scalars (trackers left: {len(logged.trackers)})")
    print(f"{'mode':<14} {'wall ms':>9} {'thread cpu ms':>14}")
    for m in modes:
        print(f"{m:<14} {statistics.median(wall[m]) * 1e3:9.2f} {statistics.median(cpu[m]) * 1e3:14.2f}")
    paired = [t / r for t, r in zip(wall["+tensorboard"], wall["recording"])]
    paired_cpu = [t / r for t, r in zip(cpu["+tensorboard"], cpu["recording"])]
    q = statistics.quantiles(paired, n=4)
    print(f"paired per-step ratios (+tensorboard / recording): median {statistics.median(paired):.4f} "
          f"(quartiles {q[0]:.4f}, {q[2]:.4f}); training-thread CPU {statistics.median(paired_cpu):.4f}")
    step_ms = statistics.median(wall["recording"]) * 1e3
    print(f"one step's metrics through StepLog to TensorBoard, timed alone: {direct * 1e3:.3f} ms on the training "
          f"thread = {direct * 1e3 / step_ms * 100:.3f}% of a {step_ms:.1f} ms step")
    print(f"trackers_direct_ratio={1 + direct * 1e3 / step_ms:.4f}")
    print(f"trackers_cpu_ratio={statistics.median(paired_cpu):.4f}")
    print(f"trackers_ratio={statistics.median(paired):.4f}")


if __name__ == "__main__":
    main()
