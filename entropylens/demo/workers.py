"""The demo's worker processes: a fork server that imports torch, transformers, the toy and the report
once and forks every worker from that state (one import for all workers, not one each).

Light on purpose (multiprocessing only): ``entropylens demo`` calls :func:`start_fork_server` before it
imports torch itself, so the server's imports (seconds of CPU) run on the second core while this
process imports torch and computes the warm-up, instead of after.
"""

from __future__ import annotations

import contextlib
import os
import sys

# Modules the fork server imports once for all workers (torch, transformers' Qwen2, the toy, and the
# report's modules: the workers draw the report's figures at the end).
PRELOAD = [
    "entropylens.demo.runner",
    "transformers.models.qwen2.modeling_qwen2",
    "entropylens.demo.toy.train",
    "entropylens.report.build",
    "matplotlib.pyplot",
    "entropylens.demo.forkserver_exit",
]  # the server's own exit skips the interpreter teardown
# The fork server starts as `python -c ...`, which puts the current directory first on its sys.path
# (Python < 3.12 does not apply the parent's): in a source checkout (README's `pip install .` then
# `entropylens demo` in the clone) `entropylens/` there would shadow the installed package, whose
# `analyses` and `cli` live elsewhere in the checkout. PYTHONSAFEPATH=1 (Python >= 3.11) leaves the
# current directory out; before 3.11 the server preloads only third-party modules and the workers
# import entropylens after taking the parent's sys.path.
SAFE_PATH = sys.version_info >= (3, 11)


def worker_context(mp):
    """Workers never fork from this process: a forked child inherits torch's OpenMP pool and other
    native threads (a demo started inside a process that already ran torch, e.g. a test session,
    segfaulted in a forked worker). A fork server (a fresh process that imports torch, transformers
    and the toy once, and runs no torch op) forks them instead: one import for all workers, not one
    each (seconds of CPU on 2 cores). Spawn where there is no fork server (Windows)."""
    if "forkserver" not in mp.get_all_start_methods():  # pragma: no cover - Windows
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD if SAFE_PATH else [m for m in PRELOAD if not m.startswith("entropylens")])
    return ctx


@contextlib.contextmanager
def one_thread_env():
    """OMP_NUM_THREADS (torch's OpenMP, pyarrow's pool), MKL_NUM_THREADS and OPENBLAS_NUM_THREADS = 1
    in the environment while the workers start, so every runtime in them starts with one thread, as
    under OMP_NUM_THREADS=1 (torch.set_num_threads(1) alone leaves e.g. pyarrow's pool at one thread
    per core); this process's environment is restored after. Also PYTHONSAFEPATH=1: the fork server
    never imports entropylens from the current directory (see SAFE_PATH)."""
    names = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "PYTHONSAFEPATH")
    before = {k: os.environ.get(k) for k in names}
    os.environ.update({k: "1" for k in names})
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def available_cores() -> int:
    """CPU cores this process may run on (the affinity mask where the OS has one)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - macOS / Windows
        return max(1, os.cpu_count() or 1)


def quiet_resource_tracker() -> None:
    """Start multiprocessing's resource tracker (the process that removes the semaphores of the workers'
    queues when the demo ends) with its stderr on /dev/null. When the demo stops at once (its reader went
    away: `entropylens demo | head`), a queue's semaphore can be mid-cleanup as the process exits; the
    tracker then removes it, and would say so on the user's terminal ("There appear to be 1 leaked
    semaphore objects"). It still removes them, silently. Idempotent (a tracker already
    running is left as it is)."""
    from multiprocessing import resource_tracker

    tracker = resource_tracker._resource_tracker
    if getattr(tracker, "_fd", None) is not None:
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    saved = os.dup(2)
    try:
        sys.stderr.flush()
        os.dup2(devnull, 2)  # the tracker inherits fd 2 (it passes sys.stderr's descriptor)
        tracker.ensure_running()
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def start_fork_server(n_runs: int, workers: int | None = None) -> bool:
    """Start the fork server now (its imports run in the background) when a demo of ``n_runs`` runs will
    use worker processes (``workers``, default one per core, > 1). Returns whether it started one.
    Idempotent: the pool of :func:`worker_context` later uses the same server."""
    import multiprocessing as mp

    n = min(workers or available_cores(), n_runs)
    if n < 2 or "forkserver" not in mp.get_all_start_methods():
        return False
    from multiprocessing import forkserver

    worker_context(mp)  # the preload list
    quiet_resource_tracker()
    with one_thread_env():  # the server (and so every worker) starts with one-thread runtimes
        forkserver.ensure_running()
    return True
