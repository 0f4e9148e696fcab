"""What ``Recorder(log_to="tensorboard")`` costs on top of recording: the toy trainer's step time with a
plain recorder, with one that also logs every step's ``entropylens/...`` scalars to TensorBoard
(``log_histograms=False``), and with one that logs the scalars and the step histograms (the default:
``entropylens/hist/...``, the entropy ratio and the importance ratio per quadrant, counted on the writer
thread over every token), alternating in one process, each step run by all three from the same saved
state (the same work bit for bit; benchmarks/overhead.py's method). Asserts nothing about time.

  python benchmarks/trackers.py [--steps 40] [--threads 2]

A step's summary is asked for as it closes and logged at the recorder call after the writer thread
has answered (here: at the next step's first record call, inside the timed step), so the timed steps
hold the tracker's work on the training thread: the summary's reply check and building TensorBoard's
event (the file is written by TensorBoard's own thread). The histograms' counting is the writer
thread's (its CPU per step is printed; the writer runs at SCHED_IDLE).
Last line: trackers_ratio=<median of the per-step paired ratios, log_to="tensorboard" with histograms /
recording>
"""

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from entropylens import Recorder
from entropylens.demo.toy import config_for
from entropylens.demo.toy.train import ToyTrainer


class _Answered:
    """A summary the writer has answered (what StepLog finds at a recorder call)."""

    def __init__(self, summary):
        self.summary = summary

    def ready(self):
        return True

    def result(self):
        return self.summary


def _direct_cost(logdir: Path, n: int = 400) -> float:
    """Median seconds of StepLog.log_ready for one answered step summary (its scalars and 5 histograms with
    every bin filled), to a real TensorBoard writer."""
    import numpy as np

    from entropylens.record.trackers import SUMMARY_NAMES, StepLog, TensorBoard
    from entropylens.record.writing.step_table import HISTOGRAMS, HISTOGRAMS_KEY, StepHistogram

    hists = {k: StepHistogram(np.arange(1, 35, dtype=np.int64), 2048.0, 4096.0) for k in HISTOGRAMS}
    summary = {"n_tokens": 2048.0, **{k: 0.25 for k in SUMMARY_NAMES}, HISTOGRAMS_KEY: hists}
    log = StepLog([TensorBoard(logdir)], "direct", {})
    times = []
    for step in range(n):
        log.add(step, _Answered(summary))
        t0 = time.perf_counter()
        log.log_ready()
        times.append(time.perf_counter() - t0)
        time.sleep(0.002)  # untimed: TensorBoard's thread writes the event meanwhile, as it does between steps
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
        modes = {
            "recording": Recorder(d, run="plain"),
            "+tb scalars": Recorder(d, run="tbs", log_to={"tensorboard": Path(d) / "tbs"}, log_histograms=False),
            "+tb histograms": Recorder(d, run="tb", log_to={"tensorboard": Path(d) / "tb"}),
        }
        wall = {m: [] for m in modes}
        cpu = {m: [] for m in modes}
        writer_cpu = {m: [] for m in modes}
        names = list(modes)
        for i in range(a.steps + 2):  # two warm-up rounds
            state = trainer.state()
            k = i % len(names)
            for m in names[k:] + names[:k]:  # the order rotates every step
                trainer.load_state(state)
                rec = modes[m]
                w0 = rec._writer.cpu_seconds
                t0, c0 = time.perf_counter(), time.thread_time()
                trainer.rl_step(i, rec)
                t1, c1 = time.perf_counter(), time.thread_time()
                rec._writer.drain()  # untimed: one recorder's writer work never lands in the other's step
                if i >= 2:
                    wall[m].append(t1 - t0)
                    cpu[m].append(c1 - c0)
                    writer_cpu[m].append(rec._writer.cpu_seconds - w0)
        n_trackers = len(modes["+tb histograms"]._step_log.trackers)  # 1 unless the tracker failed
        for rec in modes.values():
            rec.close()
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        acc = EventAccumulator(
            str(next((Path(d) / "tb").glob("events.*")).parent), size_guidance={"scalars": 0, "histograms": 0}
        )
        acc.Reload()
        n_logged = len(acc.Scalars("entropylens/clip_low_frac"))
        n_hist = len(acc.Histograms("entropylens/hist/entropy_ratio"))
        # the same work timed alone (no step-time noise): a ready summary through StepLog to TensorBoard
        direct = _direct_cost(Path(d) / "tb-direct")
    print(
        f"toy step: {trainer.cfg.prompts * trainer.cfg.group} sequences, {trainer.cfg.updates} updates, "
        f"{a.steps} steps per mode, rotating, torch threads {a.threads}; TensorBoard got {n_logged} steps x "
        f"{len(acc.Tags()['scalars'])} scalars and {n_hist} steps x {len(acc.Tags()['histograms'])} histograms "
        f"(trackers left: {n_trackers})"
    )
    print(f"{'mode':<15} {'wall ms':>9} {'thread cpu ms':>14} {'writer cpu ms':>14}")
    for m in modes:
        print(
            f"{m:<15} {statistics.median(wall[m]) * 1e3:9.2f} {statistics.median(cpu[m]) * 1e3:14.2f} "
            f"{statistics.median(writer_cpu[m]) * 1e3:14.2f}"
        )
    ratios = {}
    for m in names[1:]:
        paired = [t / r for t, r in zip(wall[m], wall["recording"])]
        paired_cpu = [t / r for t, r in zip(cpu[m], cpu["recording"])]
        q = statistics.quantiles(paired, n=4)
        ratios[m] = (statistics.median(paired), statistics.median(paired_cpu))
        print(
            f"paired per-step ratios ({m} / recording): median {ratios[m][0]:.4f} (quartiles {q[0]:.4f}, "
            f"{q[2]:.4f}); training-thread CPU {ratios[m][1]:.4f}"
        )
    step_ms = statistics.median(wall["recording"]) * 1e3
    print(
        f"one step's scalars and histograms through StepLog to TensorBoard, timed alone: {direct * 1e3:.3f} ms on "
        f"the training thread = {direct * 1e3 / step_ms * 100:.3f}% of a {step_ms:.1f} ms step"
    )
    print(f"trackers_direct_ratio={1 + direct * 1e3 / step_ms:.4f}")
    print(f"trackers_scalars_ratio={ratios['+tb scalars'][0]:.4f}")
    print(f"trackers_cpu_ratio={ratios['+tb histograms'][1]:.4f}")
    print(f"trackers_ratio={ratios['+tb histograms'][0]:.4f}")


if __name__ == "__main__":
    main()
