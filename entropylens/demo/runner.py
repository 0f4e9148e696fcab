"""`entropylens demo`: train the toy policy under several methods, record each run, write the report.

Runs go to worker processes (one per core by default), each with ONE intra-op torch thread: the
toy model is far too small to gain from threads, and spare threads spin against other jobs on a
busy machine (docs/design.md). The supervised warm-up, shared by every run with
the same seed, is computed once per seed and its weights handed to the runs: the first seed's in this
process while the workers start (spawning a worker imports torch: seconds), the others in the workers.

The default demo trains DEMO_STEPS steps per run (the fast regime's entropy collapses within ~40
steps); ``steps=`` (``--steps``) runs longer. The toy's training maths are the fast regime's.
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ..record.run_dir.run_claim import RunExistsError, runs_exist_message
from .toy.config import DEMO_DEFAULT, ToyConfig, config_for
from .workers import available_cores, quiet_resource_tracker
from .workers import one_thread_env as _one_thread_env
from .workers import worker_context as _worker_context

# --quick: a few small steps per run, for tests and a first look (a few seconds per run).
QUICK = dict(steps=6, prompts=8, group=4, minibatches=2, epochs=2, sft_steps=40)
# The default demo's RL steps per run (the fast regime's ToyConfig.steps is 120): GRPO's entropy falls
# from 1.15 to ~0.25 by step 32 (-78%) and ERC's run separates from the others from step ~20, so 32 steps
# show the collapse, ERC's band, clipping by quadrant and the entropy budget in about a quarter of the
# time (the default demo in about a minute on 2 cores).
DEMO_STEPS = 32
# The demo records without fsync (Recorder(fsync=False)): a killed demo still leaves only whole files
# (each is written under a temporary name, then renamed) and a run's steps stay committed by their steps
# file; fsync adds durability against an OS crash or power loss only, which a demo's disposable output
# does not need, at 6-8 fsyncs per step that the training thread waits on at step boundaries (measured in
# docs/performance.md).
DEMO_FSYNC = False


@dataclass
class DemoResult:
    runs_dir: Path
    report_dir: Path | None
    runs: list  # RunResult, in the order of the configs
    workers: int = 1
    phases: dict = field(default_factory=dict)  # wall seconds: "warm-up + training", "report", "total"
    summary: object = None  # the report's run table (report.summary_table), when the demo wrote a report


def default_workers(n_runs: int) -> int:
    """One worker process per core, never more than there are runs."""
    return max(1, min(available_cores(), n_runs))


def run_id(cfg: ToyConfig) -> str:
    return f"{cfg.name}-s{cfg.seed}"


def _prepare_out(runs_dir: Path, report_dir: Path | None, ids: list[str], overwrite: bool) -> None:
    """Refuse to mix a new run into an old one of the same id; with ``overwrite`` remove the old ones."""
    existing = [i for i in ids if (runs_dir / i).exists()]
    if existing and not overwrite:
        raise RunExistsError(runs_exist_message(runs_dir, existing))
    for i in existing:
        shutil.rmtree(runs_dir / i)
    if overwrite and report_dir is not None and report_dir.exists():
        shutil.rmtree(report_dir)


def mismatch_runs(methods, mismatch: str = "", tis: float = 2.0) -> list[tuple[str, str, dict]]:
    """(run name, method, overrides) of the demo's runs: each method alone; with a ``mismatch`` sampler
    (toy/sampler.py: 'bf16', 'temp:S') each method twice instead, <method>-<sampler> without an IS
    correction and <method>-<sampler>-tis with TIS at cap ``tis``."""
    if not mismatch:
        return [(m, m, {}) for m in methods]
    slug = mismatch.replace(":", "")
    return [
        row
        for m in methods
        for row in (
            (f"{m}-{slug}", m, {"mismatch": mismatch}),
            (f"{m}-{slug}-tis", m, {"mismatch": mismatch, "tis": tis}),
        )
    ]


def demo_configs(
    methods=DEMO_DEFAULT,
    *,
    steps: int | None = None,
    seeds: int = 1,
    quick: bool = False,
    probe_every: int = 0,
    mismatch: str = "",
    tis: float = 2.0,
) -> list[ToyConfig]:
    """The demo's runs: each method x seed in the fast regime, DEMO_STEPS steps (QUICK's small runs
    with ``quick``; ``steps`` when given); the probe on every ``probe_every``-th step when > 0; with a
    ``mismatch`` sampler, each method with and without TIS (:func:`mismatch_runs`)."""
    overrides: dict[str, Any] = dict(QUICK) if quick else {"steps": DEMO_STEPS}  # ToyConfig fields
    if steps is not None:
        overrides["steps"] = steps
    if probe_every:  # the parameter-space entropy probe on every K-th step (ToyConfig.probe_every)
        overrides["probe_every"] = probe_every
    return [
        replace(config_for(m, seed=s, **overrides, **extra), name=name)
        for name, m, extra in mismatch_runs(methods, mismatch, tis)
        for s in range(seeds)
    ]


# ------------------------------------------------------------------ worker side
_EVENTS = None  # a multiprocessing queue in a worker process; None in-process


def _init_worker(events) -> None:
    """Worker start: one intra-op thread (and one inter-op thread) for the whole process."""
    import torch

    global _EVENTS
    _EVENTS = events
    torch.set_num_threads(1)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # pragma: no cover - already set
        pass
    _import_model()  # while the parent computes the warm-up, not at the start of the first run


def _import_model() -> None:
    """Import what training imports lazily (the toy and transformers' Qwen2 modules: seconds)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM  # noqa: F401

    from .toy import model, train  # noqa: F401


def _post(sink, event: tuple) -> None:
    if sink is not None:
        sink(event)
    elif _EVENTS is not None:
        _EVENTS.put(event)


def _warm_job(cfg: ToyConfig, label: str, sink=None) -> dict:
    from .toy.train import torch_threads, warm_state

    with torch_threads(1):
        return warm_state(cfg, lambda i, n: _post(sink, ("warm", label, i, n)))


def _run_job(cfg: ToyConfig, runs_dir: str, run: str, state: dict | None, sink=None):
    from .toy.train import set_warm_state, torch_threads, train

    if state is not None:
        set_warm_state(cfg, state)
    _post(sink, ("start", run, 0, cfg.steps))
    with torch_threads(1):
        res = train(
            cfg,
            runs_dir,
            run=run,
            fsync=DEMO_FSYNC,
            on_step=lambda s, r, h: _post(sink, ("step", run, s + 1, cfg.steps, r, h)),
        )
    _post(sink, ("done", run, cfg.steps, cfg.steps, res.seconds))
    return res


# ------------------------------------------------------------------ driver
def run_demo(
    out: str | Path = "entropylens-demo",
    *,
    methods: tuple[str, ...] = DEMO_DEFAULT,
    steps: int | None = None,
    seeds: int = 1,
    quick: bool = False,
    report: bool = True,
    progress: bool = True,
    console=None,
    workers: int | None = None,
    overwrite: bool = False,
    probe_every: int = 0,
    mismatch: str = "",
    tis: float = 2.0,
) -> DemoResult:
    """Train every (method, seed), record under ``out/runs/<method>-s<seed>``, report to ``out/report``.

    Configs are validated and the output checked for runs of the same ids (refused unless
    ``overwrite``) before any training starts. ``workers``: processes training runs in parallel,
    default one per core (at most one per run); each trains with one torch thread. Progress: live
    bars when ``console`` (default: stdout) is a terminal, plain periodic lines otherwise."""
    from .progress import make_progress

    if seeds < 1:
        raise ValueError(f"seeds must be >= 1, got {seeds}")
    if workers is not None and workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    t_start = time.perf_counter()
    cfgs = demo_configs(
        methods, steps=steps, seeds=seeds, quick=quick, probe_every=probe_every, mismatch=mismatch, tis=tis
    )  # fail early
    ids = [run_id(c) for c in cfgs]
    if len(set(ids)) != len(ids):
        raise ValueError(f"a run is named twice: {', '.join(ids)}")
    out = Path(out)
    runs_dir = out / "runs"
    report_dir = out / "report" if report else None
    _prepare_out(runs_dir, report_dir, ids, overwrite)
    runs_dir.mkdir(parents=True, exist_ok=True)
    n_workers = min(workers or default_workers(len(cfgs)), len(cfgs))

    from .toy.train import warm_key

    warm: dict[tuple, ToyConfig] = {}
    for c in cfgs:
        warm.setdefault(warm_key(c), c)
    labels = {k: f"warm-up seed {c.seed}" for k, c in warm.items()}
    with make_progress(console, enabled=progress) as bar:
        bar.header(
            f"{len(cfgs)} run(s) in {n_workers} worker process(es), 1 torch thread each; "
            f"supervised warm-up ({cfgs[0].sft_steps} steps) first"
        )
        for k, c in warm.items():
            bar.add(labels[k], c.sft_steps, warmup=True)
        for c, i in zip(cfgs, ids):
            bar.add(i, c.steps)
        phases: dict[str, float] = {}
        tables: list = []  # the report's run table, for the caller to print (no second connection)
        if n_workers == 1:
            states = {k: _warm_job(c, labels[k], bar.handle) for k, c in warm.items()}
            results = [_run_job(c, str(runs_dir), i, states[warm_key(c)], bar.handle) for c, i in zip(cfgs, ids)]
            phases["warm-up + training"] = time.perf_counter() - t_start
            if report_dir is not None:
                from ..report.build import write_report

                t0 = time.perf_counter()
                write_report(runs_dir, report_dir, runs=ids, on_summary=tables.append)
                phases["report"] = time.perf_counter() - t0
        else:
            results = _in_workers(
                cfgs, ids, warm, labels, runs_dir, n_workers, bar, report_dir, phases, t_start, tables
            )
    phases["total"] = time.perf_counter() - t_start
    return DemoResult(runs_dir, report_dir, results, n_workers, phases, tables[0] if tables else None)


def _prime() -> int:
    """A no-op job: submitting one per worker starts every worker at once (the pool spawns on demand)."""
    return os.getpid()


# The report's figures, most expensive first (CPU seconds measured on the default demo's runs: the
# analysis and the drawing): the workers take them one at a time, so the two finish together.
FIGURE_ORDER = (
    "ratio_vs_prob",
    "entropy_change",
    "entropy_ratio",
    "entropy_budget",
    "grad_share",
    "mismatch",
    "quadrant_share",
    "clipping_removed",
    "clipped_prob",
    "kl",
    "clip_by_quadrant",
    "reward",
    "entropy",
    "drift_by_prob",
    "grad_norm",
    "probe",
    "covariance_by_quadrant",
    "covariance_law",
    "entropy_performance",
)
_REPORT_CON: dict = {}  # in a worker: one DuckDB connection per (runs dir, runs) for all its figures


def _figure_job(runs_dir: str, report_dir: str, ids: list[str], name: str) -> tuple:
    """One figure of the report, drawn in a worker -> (png or None, caption)."""
    from ..report.build import open_report, render_figure

    key = (runs_dir, tuple(ids))
    if key not in _REPORT_CON:
        _REPORT_CON.clear()
        _REPORT_CON[key] = open_report(runs_dir, ids)
    return render_figure(_REPORT_CON[key], report_dir, name)


def _in_workers(
    cfgs,
    ids,
    warm,
    labels,
    runs_dir: Path,
    n_workers: int,
    bar,
    report_dir: Path | None,
    phases: dict,
    t_start: float,
    tables: list,
) -> list:
    """The runs in ``n_workers`` spawned processes. The first seed's warm-up runs here while the
    workers start (a spawned worker spends seconds importing torch); other seeds' warm-ups run in the
    workers. A run is submitted as soon as its seed's weights exist. Events from the workers drive
    ``bar`` while the parent waits. Then the report: the workers draw the figures, one at a time, most
    expensive first (FIGURE_ORDER), while this process computes the run table; then it writes the pages.
    Wall times go into ``phases``."""
    import multiprocessing as mp
    import queue
    import threading
    from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait

    from .toy.train import warm_key

    ctx = _worker_context(mp)
    quiet_resource_tracker()  # before the queue: its semaphores are the tracker's to remove
    events = ctx.Queue()

    def drain(timeout: float = 0.0) -> None:
        while True:
            try:
                bar.handle(events.get(timeout=timeout) if timeout else events.get_nowait())
            except queue.Empty:
                break

    keys = list(warm)
    starter = None
    with ProcessPoolExecutor(n_workers, mp_context=ctx, initializer=_init_worker, initargs=(events,)) as pool:
        try:
            # Start every worker now, from a thread: starting one waits for the fork server's imports.
            wf: dict = {}
            primes: list = []

            def start_workers() -> None:
                wf.update({pool.submit(_warm_job, warm[k], labels[k]): k for k in keys[1:]})
                primes.extend(pool.submit(_prime) for _ in range(n_workers))

            starter = threading.Thread(target=start_workers, name="entropylens-demo-start", daemon=True)
            with _one_thread_env():  # the fork server (and so every worker) starts with one thread
                starter.start()
                states = {keys[0]: _warm_job(warm[keys[0]], labels[keys[0]], bar.handle)}  # here, meanwhile
                starter.join()
            rf: dict = {}

            def submit_ready() -> None:
                for n, (c, i) in enumerate(zip(cfgs, ids)):
                    if n not in rf and warm_key(c) in states:
                        rf[n] = pool.submit(_run_job, c, str(runs_dir), i, states[warm_key(c)])

            submit_ready()
            pending = set(wf) | set(rf.values()) | set(primes)
            while pending:
                done, pending = wait(pending, timeout=0.2, return_when=FIRST_COMPLETED)
                for f in done:
                    f.result()  # a worker's exception, raised here
                    if f in wf:
                        states[wf[f]] = f.result()
                        before = set(rf.values())
                        submit_ready()
                        pending |= set(rf.values()) - before
                drain()
            results = [rf[n].result() for n in range(len(cfgs))]
            phases["warm-up + training"] = time.perf_counter() - t_start
            drain(timeout=0.05)  # the last events
            if report_dir is not None:
                t0 = time.perf_counter()
                figs = {n: pool.submit(_figure_job, str(runs_dir), str(report_dir), ids, n) for n in FIGURE_ORDER}
                from ..report.build import FIGURES, write_report  # imported here while the workers draw

                for fig in FIGURES:  # a figure FIGURE_ORDER does not name yet: last
                    if fig.name not in figs:
                        figs[fig.name] = pool.submit(_figure_job, str(runs_dir), str(report_dir), ids, fig.name)
                write_report(
                    runs_dir,
                    report_dir,
                    runs=ids,
                    elsewhere=tuple(figs),
                    done=lambda: {n: f.result() for n, f in figs.items()},
                    on_summary=tables.append,
                )
                phases["report"] = time.perf_counter() - t0
        except BaseException:
            if starter is not None:
                starter.join()  # the workers it is starting: known to the pool, then stopped with the rest
            _stop_workers(pool)
            raise
    return results


def _stop_workers(pool) -> None:
    """Abandon the workers' jobs and stop them now. Leaving the pool's ``with`` waits for every running
    job, and a worker whose progress events nobody reads any more cannot even exit (its queue's
    feeder thread waits to flush them into a full pipe): `entropylens demo | head` would hang there."""
    processes = list((getattr(pool, "_processes", None) or {}).values())  # shutdown() forgets them
    pool.shutdown(wait=False, cancel_futures=True)
    for p in processes:
        if p.is_alive():
            p.terminate()
