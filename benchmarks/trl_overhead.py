"""A TRL GRPOTrainer step with and without entropylens' instrumentation, in one process.

  python benchmarks/trl_overhead.py [--steps 20] [--rounds 3] [--kl] [--top-entropy] [--loss dapo[,M2,...]] [--sampler]

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


class StepTimer:
    def __init__(self):
        self.times: list[tuple[float, float, float]] = []  # (wall, thread cpu, process cpu) per step
        self._t0 = None

    def on_step_begin(self, *a, **k):
        self._t0 = (time.perf_counter(), time.thread_time(), time.process_time())

    def on_step_end(self, *a, **k):
        now = (time.perf_counter(), time.thread_time(), time.process_time())
        self.times.append(tuple(b - a for a, b in zip(self._t0, now)))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=32, help="model width (32: the test's tiny Qwen2)")
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    ap.add_argument("--kl", action="store_true", help="beta 0.04 (TRL builds the reference model)")
    ap.add_argument("--top-entropy", action="store_true", help="top_entropy_quantile 0.2 (TRL's 80/20 mask)")
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
    a = ap.parse_args()
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
    options = {**(dict(beta=0.04) if a.kl else {}), **(dict(top_entropy_quantile=0.2) if a.top_entropy else {})}
    # runs[mode]: one list of (wall, thread cpu, process cpu) per step for each round
    runs: dict[str, list[list[tuple[float, float, float]]]] = {m: [] for m in modes}
    writer_cpu: dict[str, list[float]] = {m: [] for m in modes}  # the writer thread's CPU per step, per run
    tokens: dict[str, list[int]] = {m: [] for m in modes}  # tokens the trainer saw per run: the same work?
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
        f"TRL GRPOTrainer, Qwen2 width {a.hidden} on CPU, options {options or 'none'}, torch threads "
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
