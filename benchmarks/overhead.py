"""The toy trainer's step time with the recorder off, on (sample=1, with attribution and exact
logit-gradient norms, fsync on and off), and on with sample=0.1, alternating in one process;
medians over many steps. Asserts nothing about time.

Two clocks per mode: wall time of the step, and CPU time of the training thread (time.thread_time:
what the recorder costs the caller, robust when other processes share the cores; the writer
thread's work runs on another thread). Each recorder's writer thread works during its own steps
(what its previous step left in the outbox, and mid-step hand-overs); after a step, what was
handed over is drained before the next mode runs (untimed: its wall time is printed as "drain"),
so one recorder's writer work never lands in another mode's step (before, each mode was charged
with the previous mode's writer work: sample=0.1 and no-fsync looked dearer than full). The writer
thread's own CPU per step is printed too. Then the cost of fsync per file on this disk: a token
file of one toy step written with and without fsync (file + directory), alternating.

  python benchmarks/overhead.py [--steps 30] [--fsync-files 40] [--modes off,full,hook,clip_cov,kl_cov]   (ENTROPYLENS_WRITER_IDLE=0: writer at nice 19, not SCHED_IDLE; ENTROPYLENS_WRITER_NICE=0: normal priority)
Columns: wall ms and its ratio to "off"; the training thread's CPU ms (time.thread_time) and ratio;
the writer thread's CPU ms per step; the untimed drain after each step.
Every mode runs each step from the same saved state (weights, Adam state, sampling generator), so
all modes train the same steps bit for bit (checked: the weights after each mode's step must be
equal; a mismatch is printed); the order of the modes rotates every step. Besides the pooled
medians, the median of the per-step paired ratios full / off (the same step from the same state) is
printed, with its 95% bootstrap interval.
Last line: overhead_ratio=<full-recording median / off median (wall)>; with --modes ...,hook also
hook_paired_overhead_ratio=<median per-step hook / off>: the loss hook (integrations/loss_hook.py) beside
policy_loss, with entropy and a logit hook, instead of policy_update (ToyTrainer.loss_hook); with
--modes ...,clip_cov,kl_cov: full recording with Clip-Cov / KL-Cov in place of grpo (the step from the same
state: the same rollout, another loss), clip_cov_paired_ratio= / kl_cov_paired_ratio= <median per-step / full>:
what the per-token covariance term, the selection and their columns cost an update.
"""

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from entropylens import Recorder
from entropylens.demo.toy import config_for
from entropylens.demo.toy.train import ToyTrainer
from entropylens.integrations.loss_hook import LossHook
from entropylens.record.writing.parquet import write_tokens
from entropylens.record.writing.scheduling import WRITER_IDLE, WRITER_NICE
from entropylens.rl.losses import resolve_eps

LOSS_MODES = ("clip_cov", "kl_cov")  # modes that train the step with another loss (full recording)


def fsync_cost(n: int, rows: int) -> tuple[float, float]:
    """Median ms to write one token file of ``rows`` rows without / with fsync (file + directory)."""
    rng = np.random.default_rng(0)
    arrs = {
        "update": np.zeros(rows, np.int16),
        "seq": np.arange(rows, dtype=np.int32) // 16,
        "group": np.zeros(rows, np.int32),
        "pos": np.arange(rows, dtype=np.int32) % 16,
        "token_id": rng.integers(0, 16, rows).astype(np.int32),
        **{
            c: rng.standard_normal(rows).astype(np.float32)
            for c in ("logprob", "old_logprob", "advantage", "entropy", "old_entropy", "grad_coef", "logit_grad_norm")
        },
        "quadrant": rng.integers(0, 5, rows).astype(np.int8),
        "clip": rng.integers(-1, 2, rows).astype(np.int8),
        "clipped": rng.random(rows) < 0.1,
    }
    times = {False: [], True: []}
    with tempfile.TemporaryDirectory(dir=Path.cwd()) as d:  # the disk the runs go to, not a tmpfs
        for i in range(n):
            for fsync in (False, True):
                t0 = time.perf_counter()
                write_tokens(Path(d), i, 0, int(fsync), arrs, fsync=fsync)
                times[fsync].append(time.perf_counter() - t0)
    return statistics.median(times[False]) * 1e3, statistics.median(times[True]) * 1e3


def fingerprint(trainer: ToyTrainer) -> bytes:
    """The weights' bytes: equal after two modes' runs of a step iff they trained it identically."""
    return b"".join(p.detach().numpy().tobytes() for p in trainer.model.parameters())


def median_ci(xs: list[float], resamples: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95% percentile-bootstrap interval of the median of ``xs`` (how far the machine's noise lets one
    run's median move)."""
    rng = np.random.default_rng(seed)
    arr = np.asarray(xs)
    meds = np.median(rng.choice(arr, size=(resamples, arr.size), replace=True), axis=1)
    return float(np.quantile(meds, 0.025)), float(np.quantile(meds, 0.975))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=30, help="measured steps per mode")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=64, help="toy model width (64: the demo's ~90k parameters)")
    ap.add_argument("--prompts", type=int, default=16, help="prompts per step (x 8 samples)")
    ap.add_argument("--fsync-files", type=int, default=40, help="token files per fsync setting (0: skip)")
    ap.add_argument("--sft-steps", type=int, default=50, help="supervised warm-up steps of the toy before RL")
    ap.add_argument(
        "--modes",
        default="off,full,full-nofsync,sample=0.1",
        help="comma-separated subset of off,full,full-nofsync,sample=0.1,hook (off and full always run); "
        "fewer modes give the headline pair more steps in the same time",
    )
    a = ap.parse_args()
    wanted = {"off", "full", *a.modes.split(",")}
    unknown = wanted - {"off", "full", "full-nofsync", "sample=0.1", "hook", *LOSS_MODES}
    if unknown:
        ap.error(f"unknown mode(s): {', '.join(sorted(unknown))}")
    torch.set_num_threads(a.threads)
    trainer = ToyTrainer(config_for("grpo", sft_steps=a.sft_steps, hidden=a.hidden, prompts=a.prompts))
    cfg = trainer.cfg
    with tempfile.TemporaryDirectory() as d:
        make = {
            "off": lambda: None,
            "full": lambda: Recorder(d, run="full"),
            "full-nofsync": lambda: Recorder(d, run="nf", fsync=False),
            "sample=0.1": lambda: Recorder(d, run="s01", sample=0.1),
            "hook": lambda: Recorder(d, run="hook"),  # the loss hook beside policy_loss (loss_hook.py)
            **{m: (lambda m=m: Recorder(d, run=m)) for m in LOSS_MODES},
        }  # full recording, another loss
        eps = resolve_eps(cfg.method, cfg.eps_low, cfg.eps_high)
        base_kw = dict(trainer.loss_kw)
        # the covariance controls' modes: the same step from the same state, entropylens' Clip-Cov / KL-Cov in
        # place of grpo (the per-token covariance term, the selection, its columns), with full recording
        loss_kw = {
            m: {
                **base_kw,
                "method": m,
                **(dict(generator=torch.Generator().manual_seed(20_000)) if m == "clip_cov" else {}),
            }
            for m in LOSS_MODES
            if m in wanted
        }
        modes = {m: f() for m, f in make.items() if m in wanted}
        wall = {m: [] for m in modes}
        cpu = {m: [] for m in modes}
        writer_cpu = {m: [] for m in modes}
        drain = {m: [] for m in modes}
        names = list(modes)
        diverged = 0  # steps whose modes ended with different weights (the pairs would not be the same work)
        for i in range(a.steps + 2):  # two warm-up rounds
            trainer.loss_kw = base_kw  # the state of grpo's step (a loss mode's generator is its own)
            state = trainer.state()
            # every mode runs step i from the same state (weights, Adam moments, sampling generator):
            # the same rollout, the same updates, bit for bit (the recorder never changes training), so a
            # pair differs only by the recorder and the machine. The order of the modes rotates every step:
            # no mode always runs first after the rollout's allocations or right after another's writer work
            after: list = []
            for m in names[i % len(names) :] + names[: i % len(names)]:
                trainer.load_state(state)
                rec = modes[m]
                trainer.loss_kw = loss_kw.get(m, base_kw)
                trainer.loss_hook = (
                    LossHook(
                        rec,
                        eps_low=eps[0],
                        eps_high=eps[1],
                        dual_clip=cfg.dual_clip,
                        temperature=cfg.temperature,
                        on_error="raise",
                    )
                    if m == "hook"
                    else None
                )
                w0 = rec._writer.cpu_seconds if rec else 0.0
                t0, c0 = time.perf_counter(), time.thread_time()
                trainer.rl_step(i, rec)
                t1, c1 = time.perf_counter(), time.thread_time()
                if m not in LOSS_MODES:  # another loss trains other weights: left out of the identity check
                    after.append(fingerprint(trainer))
                if rec:
                    rec._writer.drain()  # untimed: this recorder's handed-over work ends before the next mode
                if i >= 2:
                    wall[m].append(t1 - t0)
                    cpu[m].append(c1 - c0)
                    drain[m].append(time.perf_counter() - t1)
                    writer_cpu[m].append((rec._writer.cpu_seconds - w0) if rec else 0.0)
            diverged += any(f != after[0] for f in after)
        rescued = [m for m, r in modes.items() if r and r._writer.rescued]  # starved and handed to a nice thread
        for rec in modes.values():
            if rec:
                rec.close()
    base_wall, base_cpu = statistics.median(wall["off"]), statistics.median(cpu["off"])
    print(
        f"toy step: width {cfg.hidden}, {cfg.prompts * cfg.group} sequences x 16 tokens, {cfg.updates} updates, "
        f"{a.steps} steps per mode, alternating, torch threads {a.threads}, writer thread "
        f"{'SCHED_IDLE' if WRITER_IDLE else f'nice {WRITER_NICE}'}"
        f"{' (rescued in: ' + ', '.join(rescued) + ')' if rescued else ''}, "
        f"load average {os.getloadavg()[0]:.1f} at the end"
    )
    print(
        f"every mode trained each step from the same state: {a.steps + 2 - diverged} of {a.steps + 2} steps "
        f"({a.steps} measured, 2 warm-up rounds) ended with identical weights in all modes"
    )
    print(
        f"{'recorder':<14} {'wall ms':>9} {'ratio':>7} {'thread cpu ms':>14} {'ratio':>7} {'writer cpu ms':>14} "
        f"{'drain ms':>9}"
    )
    for m in modes:
        w, c = statistics.median(wall[m]), statistics.median(cpu[m])
        wc, dr = statistics.median(writer_cpu[m]), statistics.median(drain[m])
        print(
            f"{m:<14} {w * 1000:9.1f} {w / base_wall:7.3f} {c * 1000:14.1f} {c / base_cpu:7.3f} {wc * 1000:14.1f} "
            f"{dr * 1000:9.1f}"
        )
    if a.fsync_files:
        rows = cfg.prompts * cfg.group * 16 * cfg.epochs  # every update of the step: each sequence once per epoch
        plain, synced = fsync_cost(a.fsync_files, rows)
        print(
            f"token file of one step ({rows} rows): {plain:.2f} ms without fsync, {synced:.2f} ms with fsync "
            f"(file + directory), on the writer thread"
        )
    # paired: each step's full / off, both run from the same state (the same rollout and updates): the
    # toy's step time moves by +-20% as training goes on (data-dependent kernels, e.g. exp in the far
    # tail), which the pair cancels; their median is robust to drifts of the machine's speed too
    paired = [f / o for f, o in zip(wall["full"], wall["off"])]
    paired_cpu = [f / o for f, o in zip(cpu["full"], cpu["off"])]
    q = statistics.quantiles(paired, n=4)
    lo, hi = median_ci(paired)
    print(
        f"paired per-step ratios (full / off): median {statistics.median(paired):.3f} (95% bootstrap interval "
        f"{lo:.3f}-{hi:.3f}; quartiles {q[0]:.3f}, {q[2]:.3f}); training-thread CPU {statistics.median(paired_cpu):.3f}"
    )
    print(f"paired_overhead_ratio={statistics.median(paired):.3f}")
    print(f"cpu_overhead_ratio={statistics.median(cpu['full']) / base_cpu:.3f}")
    print(f"overhead_ratio={statistics.median(wall['full']) / base_wall:.3f}")
    for m in LOSS_MODES:  # the covariance controls against full recording with grpo, paired per step
        if m in wall:
            pw = statistics.median(x / f for x, f in zip(wall[m], wall["full"]))
            pc = statistics.median(x / f for x, f in zip(cpu[m], cpu["full"]))
            print(f"loss {m} against grpo, both recorded, paired per step: wall {pw:.3f}, training-thread CPU {pc:.3f}")
            print(f"{m}_paired_ratio={pw:.3f}")
            print(f"{m}_paired_cpu_ratio={pc:.3f}")
    if "hook" in wall:  # the loss hook (integrations.loss_hook) against recording off, paired per step
        hook = [h / o for h, o in zip(wall["hook"], wall["off"])]
        print(f"hook_paired_overhead_ratio={statistics.median(hook):.3f}")


if __name__ == "__main__":
    main()
