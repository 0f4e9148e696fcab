"""A TRL GRPOTrainer step with and without entropylens' instrumentation, in one process.

  python benchmarks/trl_overhead.py [--steps 20] [--rounds 3] [--kl] [--top-entropy] [--trackers] [--loss dapo[,M2,...]]
                                    [--sampler] [--profile]
  python benchmarks/trl_overhead.py --defaults --hidden 512 --rounds 10 --steps 14 [--profile] [--switch-interval S]

``--defaults``: TRL as users run it: ``--kl --top-entropy --trackers`` on this setup's loss_type dapo (TRL's default),
use_bias_correction_kl (TRL's default), gradient accumulation 2 and num_iterations 2. ``--trackers``: report_to
TensorBoard (offline) for both trainers; entropylens' trainer then also logs its scalars and per-step histograms
(log_histograms=True, its default). ``--profile``: the training thread's CPU and wall inside TRL's methods (both
trainers) and entropylens' own calls, and the writer thread's CPU by message and file, per step.

``--kl`` (beta 0.04, TRL's bias-corrected KL default) and ``--top-entropy`` (top_entropy_quantile 0.2)
turn TRL's options on for every trainer; ``--loss M`` also times entropylens' loss M replacing TRL's
(``loss=M``: the same options composed; ratio against TRL's own loss at the same options); several, comma-
separated, are each also compared with the first (``--loss grpo,clip_cov,kl_cov``: what Clip-Cov's and KL-Cov's
covariance term and selection cost a step beside entropylens' grpo).
``--sampler`` also times full recording with sampler log-probs (the training-inference mismatch columns:
tokens.sampler_logprob, steps.sampler_* / clipped_mismatched_frac / n_sampled): TRL's generation output gains
``sampling_per_token_logps`` = its old log-probs minus a fixed per-token pattern (:data:`SAMPLER_DELTA`), as
vLLM's would sit there; without vLLM's IS correction TRL's loss ignores it, so the sampler trainer does the same
training as the others (tokens seen are printed per round) and only the recording differs. Ratios against
plain TRL (the step ratio with the new columns) and against full recording without them (their own cost), as
means and per-step pairs. The vLLM weight and is_masked are not exercised (no vLLM here).

Trainers: TRL's own GRPOTrainer, and EntropyLensGRPOTrainer with full recording (TRL's loss kept;
TRL's fused head asked for log_sum_sq_probs too, a hook on the log-probs, rows recorded after the
backward), on the tiny offline setup of examples/trl_grpo.py. Rounds alternate the two; medians over
steps (the first two steps of each run are warm-up and skipped); rounds alternate the order in which the
trainers run. Steps 2 .. n-2 of each run are compared (warm-up and the last step left out: the
last one also waits for the writer's remaining work, shown apart), as means (steps alternate between
generation and update-only steps, so medians fall between the two kinds) and as per-step pairs (step i
of one trainer against step i of the other in the same round); the whole run after warm-up is printed too.

Three clocks per step: wall time; CPU time of the training thread (time.thread_time: with
``--threads 1`` all of torch's work runs on it, so this is what the instrumentation costs the
trainer, robust when other processes share the cores); and the CPU time of the whole process
(the Parquet writer thread included).
With --sampler also trl_sampler_ratio=<sampler mean / plain mean (wall)>, trl_sampler_paired_ratio=<median
per-step sampler / plain> and trl_sampler_columns_ratio=<median per-step sampler / entropylens>.
Last line: trl_overhead_ratio=<instrumented mean / plain mean (wall), steps 2 .. n-2>
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

# --sampler: d = old_logprob - sampler_logprob of the tokens at positions 0, 1, 2 (mod 3): two small gaps and one
# past ln 2 (a mismatched token), so every mismatch column has work to do
SAMPLER_DELTA = (0.05, -0.1, 0.8)


def with_sampler(trainer) -> None:
    """The trainer's generation output gains ``sampling_per_token_logps`` = old log-probs - SAMPLER_DELTA (the
    key vLLM's sampling log-probs arrive under; entropylens records it as tokens.sampler_logprob)."""
    import torch

    generate = trainer._generate_and_score_completions

    def generate_with_sampler(batch):
        out = generate(batch)
        old = out.get("old_per_token_logps")
        if old is None:
            raise SystemExit("--sampler: TRL computed no old log-probs (needs num_iterations > 1 here)")
        t = old.shape[1]
        d = torch.tensor(SAMPLER_DELTA, dtype=old.dtype, device=old.device).repeat(t // len(SAMPLER_DELTA) + 1)[:t]
        out["sampling_per_token_logps"] = old - d
        return out

    trainer._generate_and_score_completions = generate_with_sampler


def sampled_tokens(run_dir) -> int:
    """Token rows with a sampler log-prob in a recorded run (tokens.sampler_logprob): the sampler mode recorded
    them."""
    from entropylens.read.query import connect

    return int(connect(run_dir).execute("SELECT count(sampler_logprob) FROM tokens").fetchone()[0])


# --profile: the calls timed on the training thread, in both trainers where both have them (TRL's own methods,
# entered through the instance: inclusive of what they call) and in entropylens' trainer alone (its own calls)
PROFILED_BOTH = (
    "_generate_and_score_completions",
    "_get_per_token_logps_and_entropies",
    "_compute_loss",
    "training_step",
    "log",
)
PROFILED_EL = ("_el_record", "_el_step_end", "_el_log_summary", "_el_record_sequences")


class CallTimer:
    """Training-thread CPU and wall time inside named methods of one trainer, wrapped on the instance (calls
    from other threads, and a call nested in one of the same name, are not counted twice)."""

    def __init__(self, trainer, names) -> None:
        import threading

        self.totals: dict[str, list[float]] = {}  # name -> [thread cpu s, wall s, calls]
        self._thread = threading.get_ident()
        self._get_ident = threading.get_ident
        for name in names:
            fn = getattr(trainer, name, None)
            if fn is not None:
                setattr(trainer, name, self._wrap(name, fn))
        extras = getattr(trainer, "_el_extras", None)
        if extras is not None:  # the histograms / table to the trackers' own objects
            extras.write = self._wrap("trackers: histograms", extras.write)

    def _wrap(self, name, fn):
        acc = self.totals.setdefault(name, [0.0, 0.0, 0])
        depth = [0]

        def timed(*args, **kwargs):
            if self._get_ident() != self._thread or depth[0]:
                return fn(*args, **kwargs)
            depth[0] += 1
            c0, w0 = time.thread_time(), time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                acc[0] += time.thread_time() - c0
                acc[1] += time.perf_counter() - w0
                acc[2] += 1
                depth[0] -= 1

        return timed


WRITER_CPU: dict[str, dict[str, float]] = {}  # --profile: mode -> writer work -> thread CPU seconds


def time_writer_work(current: list[str]) -> None:
    """--profile: the writer thread's CPU per kind of work, by message (FileWork's handlers) and by file written
    (parquet.write_*; the update's block built from the snapshot: host_copy.build_blocks), for the mode named in
    ``current[0]``. Patched on the classes / modules before any trainer exists (the thread reads them at start)."""
    from entropylens.record.device import host_copy
    from entropylens.record.writing import file_work, parquet
    from entropylens.record.writing import thread as writer_thread

    def timed(fn, label):
        def call(*args, **kwargs):
            c0 = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                acc = WRITER_CPU.setdefault(current[0], {})
                acc[label] = acc.get(label, 0.0) + time.thread_time() - c0

        return call

    for name in ("update", "scalars", "rewards", "sequences", "close", "summary"):
        setattr(file_work.FileWork, name, timed(getattr(file_work.FileWork, name), f"message {name}"))
    for name in ("write_tokens", "write_sequences", "write_steps"):
        setattr(parquet, name, timed(getattr(parquet, name), f"  file {name} (in its message)"))
    writer_thread.build_blocks = timed(host_copy.build_blocks, "blocks built from snapshots (hand-over)")


class StepTimer:
    def __init__(self):
        self.times: list[tuple[float, float, float]] = []  # (wall, thread cpu, process cpu) per step
        self._t0 = None

    def on_step_begin(self, *a, **k):
        self._t0 = (time.perf_counter(), time.thread_time(), time.process_time())

    def on_step_end(self, *a, **k):
        now = (time.perf_counter(), time.thread_time(), time.process_time())
        self.times.append(tuple(b - a for a, b in zip(self._t0, now)))


def print_profile(calls, runs, writer_cpu) -> None:
    """--profile: per step (every step of every run, warm-up included), the training thread's CPU and the wall
    time inside each timed call, plain TRL beside entropylens, and the writer thread's CPU."""
    print("--profile: per step, all steps (ms): training-thread cpu / wall inside each call")
    modes = [m for m in calls if calls[m]]
    print(f"  {'call':<38}" + "".join(f" {m + ' cpu':>16} {m + ' wall':>16}" for m in modes))
    names = list(dict.fromkeys(n for m in modes for ct in calls[m] for n in ct.totals))
    for n in names:
        row = f"  {n:<38}"
        for m in modes:
            steps = sum(len(r) for r in runs[m])
            cpu = sum(ct.totals.get(n, [0.0, 0.0, 0])[0] for ct in calls[m]) / max(1, steps)
            wall = sum(ct.totals.get(n, [0.0, 0.0, 0])[1] for ct in calls[m]) / max(1, steps)
            row += f" {cpu * 1000:16.2f} {wall * 1000:16.2f}"
        print(row)
    row = f"  {'whole step':<38}"
    for m in modes:
        steps = [x for r in runs[m] for x in r]
        row += f" {statistics.fmean(x[1] for x in steps) * 1000:16.2f} {statistics.fmean(x[0] for x in steps) * 1000:16.2f}"
    print(row)
    for m in modes:
        if writer_cpu[m]:
            print(f"  {m}: writer thread cpu {statistics.fmean(writer_cpu[m]) * 1000:.2f} ms per step, of which:")
            steps = sum(len(r) for r in runs[m])
            for label, sec in sorted(WRITER_CPU.get(m, {}).items(), key=lambda kv: -kv[1]):
                print(f"    {label:<44} {sec / max(1, steps) * 1000:8.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(
        description="A TRL GRPOTrainer step with and without entropylens' recording, paired rounds in one process: the ratio of training-thread CPU and of wall time (see the module docstring)."
    )
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=32, help="model width (32: the test's tiny Qwen2)")
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    ap.add_argument("--kl", action="store_true", help="beta 0.04 (TRL builds the reference model)")
    ap.add_argument("--top-entropy", action="store_true", help="top_entropy_quantile 0.2 (TRL's 80/20 mask)")
    ap.add_argument(
        "--trackers",
        action="store_true",
        help="report_to TensorBoard (offline, event files under the temporary output_dir) for every trainer: TRL's scalars, and "
        "entropylens' scalars and per-step histograms (log_histograms=True, its default)",
    )
    ap.add_argument(
        "--defaults",
        action="store_true",
        help="TRL as users run it: --kl --top-entropy --trackers (loss_type dapo, use_bias_correction_kl, GA 2 "
        "and num_iterations 2 are this setup's own)",
    )
    ap.add_argument(
        "--profile",
        action="store_true",
        help="also time, on the training thread, entropylens' own calls (CPU per step) and the writer thread",
    )
    ap.add_argument(
        "--loss",
        default=None,
        help="also time entropylens' loss replacing TRL's (e.g. dapo; comma-separated for several, e.g. "
        "grpo,clip_cov,kl_cov: each against the first, the covariance controls' own cost)",
    )
    ap.add_argument(
        "--attribution",
        action="store_true",
        help="also time attribution=True (every pass through entropylens' head_stats, s_t recorded)",
    )
    ap.add_argument(
        "--sampler", action="store_true", help="also time full recording with sampler log-probs (the mismatch columns)"
    )
    ap.add_argument(
        "--switch-interval",
        type=float,
        default=None,
        help="sys.setswitchinterval for the whole process (Python's default 0.005 s): how long a thread that wants "
        "the GIL waits for the one running Python code (the writer thread's share of the wall time)",
    )
    a = ap.parse_args()
    if a.switch_interval is not None:
        sys.setswitchinterval(a.switch_interval)
    if a.defaults:
        a.kl = a.top_entropy = a.trackers = True
    import torch

    if a.threads:
        torch.set_num_threads(a.threads)
    import trl_grpo
    from transformers import TrainerCallback
    from trl import GRPOTrainer

    class Timer(StepTimer, TrainerCallback):
        def __init__(self):
            StepTimer.__init__(self)

    losses = [x.strip() for x in (a.loss or "").split(",") if x.strip()]
    loss_of = {(f"el-{x}" if len(losses) > 1 else "el-loss"): x for x in losses}  # mode -> entropylens' loss
    modes = [
        "plain",
        "entropylens",
        *(["attribution"] if a.attribution else []),
        *loss_of,
        *(["sampler"] if a.sampler else []),
    ]
    options: dict = {**(dict(beta=0.04) if a.kl else {}), **(dict(top_entropy_quantile=0.2) if a.top_entropy else {})}
    # runs[mode]: one list of (wall, thread cpu, process cpu) per step for each round
    runs: dict[str, list[list[tuple[float, float, float]]]] = {m: [] for m in modes}
    writer_cpu: dict[str, list[float]] = {m: [] for m in modes}  # the writer thread's CPU per step, per run
    tokens: dict[str, list[int]] = {m: [] for m in modes}  # tokens the trainer saw per run: the same work?
    calls: dict[str, list[CallTimer]] = {m: [] for m in modes}  # --profile: one per run
    current = [""]  # the mode running now (--profile's writer timings)
    if a.profile:
        time_writer_work(current)
    sampled: list[int] = []  # tokens with a sampler log-prob the sampler mode recorded, per round
    with tempfile.TemporaryDirectory() as d:
        for r in range(a.rounds):
            order = modes if r % 2 == 0 else modes[::-1]  # alternate the order: drift hits both
            for mode in order:
                saved = None
                if a.kl:  # TRL builds the KL reference from a saved model
                    saved = f"{d}/model{r}"
                    if not Path(saved).exists():
                        trl_grpo.build_model(trl_grpo.build_tokenizer(), r, a.hidden).save_pretrained(saved)
                el = trl_grpo.make_trainer(
                    f"{d}/{mode}{r}",
                    steps=a.steps,
                    seed=r,
                    run=f"{mode}{r}",
                    hidden=a.hidden,
                    attribution=mode == "attribution",
                    model=saved,
                    loss=loss_of.get(mode),
                    erc=None,
                    **options,
                    **(dict(report_to=["tensorboard"]) if a.trackers else {}),  # under output_dir, in d
                )
                if mode == "plain":  # the same model (same seed, fresh, unpatched), args and data, TRL's trainer
                    model = saved or trl_grpo.build_model(el.processing_class, r, a.hidden)
                    tr = GRPOTrainer(
                        model=model,
                        reward_funcs=trl_grpo.digit_reward,
                        args=el.args,
                        train_dataset=el.train_dataset,
                        processing_class=el.processing_class,
                    )
                    el.recorder.close()
                else:
                    tr = el
                if mode == "sampler":
                    with_sampler(tr)
                timer = Timer()
                tr.add_callback(timer)
                current[0] = mode
                if a.profile:
                    calls[mode].append(CallTimer(tr, PROFILED_BOTH + (() if mode == "plain" else PROFILED_EL)))
                tr.train()  # closes the recorder: its writer has done all its work
                if mode != "plain":
                    writer_cpu[mode].append(tr.recorder._writer.cpu_seconds / max(1, len(timer.times)))
                runs[mode].append(timer.times)
                seen = [h["num_tokens"] for h in tr.state.log_history if "num_tokens" in h]
                tokens[mode].append(int(seen[-1]) if seen else -1)
                if mode == "sampler":
                    sampled.append(sampled_tokens(tr.recorder.dir))
    # Steps alternate between a generation step (rollout + updates) and an update-only step
    # (num_iterations = 2, gradient accumulation 2), so a median over steps falls between the two
    # kinds; the last step also waits for the writer's remaining work (the trainer logs every step's
    # summary by the end). So: steps 2 .. n-2 of each run (warm-up and last left out), compared as
    # means and as per-step pairs (step i of one trainer against step i of the other, same round:
    # same kind of step); the last step is shown apart.
    kept = {m: [x for run in rs for x in run[2:-1]] for m, rs in runs.items()}
    mean = {m: [statistics.fmean(x[i] for x in t) for i in range(3)] for m, t in kept.items()}
    last = {m: statistics.median(run[-1][0] for run in rs) for m, rs in runs.items()}
    print(
        f"TRL GRPOTrainer, Qwen2 width {a.hidden} on CPU, options {options or 'none'}"
        f"{', TensorBoard on (histograms)' if a.trackers else ''}, torch threads "
        f"{torch.get_num_threads()}, "
        f"{a.rounds} rounds x {a.steps} steps; steps 2..{a.steps - 2} of each run, means (ms):"
    )
    print(f"  {'trainer':<12} {'wall':>8} {'thread cpu':>11} {'process cpu':>12} {'last step':>10}")
    for m, v in mean.items():
        print(f"  {m:<12} {v[0] * 1000:8.1f} {v[1] * 1000:11.1f} {v[2] * 1000:12.1f} {last[m] * 1000:10.1f}")
    for m, w in writer_cpu.items():
        if w:
            print(
                f"  {m}: writer thread {statistics.median(w) * 1000:.1f} ms CPU per step (all its work, close included)"
            )
    if a.profile:
        print_profile(calls, runs, writer_cpu)
    ratio = [e / p for e, p in zip(mean["entropylens"], mean["plain"])]
    print(f"ratios of the means: wall {ratio[0]:.3f}, training-thread cpu {ratio[1]:.3f}, process cpu {ratio[2]:.3f}")
    if a.attribution:
        att = [e / p for e, p in zip(mean["attribution"], mean["plain"])]
        print(f"attribution ratios: wall {att[0]:.3f}, training-thread cpu {att[1]:.3f}, process cpu {att[2]:.3f}")
    for mode, loss in loss_of.items():
        own = [e / p for e, p in zip(mean[mode], mean["plain"])]
        print(
            f"loss={loss} (recorded) against TRL's own loss unrecorded, options {options or 'none'}: "
            f"wall {own[0]:.3f}, training-thread cpu {own[1]:.3f}, process cpu {own[2]:.3f}"
        )
        rec = [e / p for e, p in zip(mean[mode], mean["entropylens"])]
        print(
            f"loss={loss} against TRL's own loss, both recorded: wall {rec[0]:.3f}, training-thread cpu "
            f"{rec[1]:.3f}, process cpu {rec[2]:.3f}"
        )
        if len(losses) == 1:
            print(f"trl_loss_ratio={rec[0]:.3f}")
    first = next(iter(loss_of), None)
    for mode, loss in list(loss_of.items())[1:]:  # each loss against the first, both entropylens' and recorded
        vs = [e / p for e, p in zip(mean[mode], mean[first])]
        pairs = [e[0] / p[0] for er, pr in zip(runs[mode], runs[first]) for e, p in zip(er[2:-1], pr[2:-1])]
        print(
            f"loss={loss} against loss={losses[0]}: wall {vs[0]:.3f}, training-thread cpu {vs[1]:.3f}, process "
            f"cpu {vs[2]:.3f}; per-step paired wall median {statistics.median(pairs):.3f}"
        )
        print(f"trl_{loss}_vs_{losses[0]}_cpu_ratio={vs[1]:.3f}")
    paired = [e[0] / p[0] for er, pr in zip(runs["entropylens"], runs["plain"]) for e, p in zip(er[2:-1], pr[2:-1])]
    q = statistics.quantiles(paired, n=4) if len(paired) > 1 else [paired[0]] * 3
    print(
        f"per-step paired wall ratios (step i against step i, same round): median {statistics.median(paired):.3f}, "
        f"quartiles {q[0]:.3f} .. {q[2]:.3f}, n = {len(paired)}"
    )
    print(
        "tokens seen per round (prompts + completions; equal when both trainers did the same work): "
        + "; ".join(" / ".join(str(tokens[m][r]) for m in modes) for r in range(a.rounds))
    )
    whole = [
        sum(x[0] for x in er[2:]) / sum(x[0] for x in pr[2:]) for er, pr in zip(runs["entropylens"], runs["plain"])
    ]
    print("whole runs after warm-up (last step included), per round: " + ", ".join(f"{x:.3f}" for x in whole))
    if a.sampler:
        smp = [e / p for e, p in zip(mean["sampler"], mean["plain"])]
        own = [e / p for e, p in zip(mean["sampler"], mean["entropylens"])]
        print(f"sampler log-probs recorded (token rows with one, per round): {', '.join(map(str, sampled))}")
        print(
            f"sampler (full recording + mismatch columns) against plain TRL: wall {smp[0]:.3f}, training-thread "
            f"cpu {smp[1]:.3f}, process cpu {smp[2]:.3f}"
        )
        print(
            f"sampler against full recording without them (the columns' own cost): wall {own[0]:.3f}, "
            f"training-thread cpu {own[1]:.3f}, process cpu {own[2]:.3f}"
        )
        pairs = {
            other: [e[0] / p[0] for er, pr in zip(runs["sampler"], runs[other]) for e, p in zip(er[2:-1], pr[2:-1])]
            for other in ("plain", "entropylens")
        }
        print(
            f"per-step paired wall ratios: sampler / plain median {statistics.median(pairs['plain']):.3f}, "
            f"sampler / entropylens median {statistics.median(pairs['entropylens']):.3f}, n = {len(pairs['plain'])}"
        )
        print(f"trl_sampler_ratio={smp[0]:.3f}")
        print(f"trl_sampler_paired_ratio={statistics.median(pairs['plain']):.3f}")
        print(f"trl_sampler_columns_ratio={statistics.median(pairs['entropylens']):.3f}")
    print(f"trl_overhead_cpu_ratio={ratio[1]:.3f}")
    print(f"trl_overhead_paired_ratio={statistics.median(paired):.3f}")
    print(f"trl_overhead_ratio={ratio[0]:.3f}")


if __name__ == "__main__":
    main()
