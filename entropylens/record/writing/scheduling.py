"""The writer thread's place on the CPU (Linux): its priority, and the rescue of a starved writer.

Its work can wait; the training step's threads cannot. By default it runs under SCHED_IDLE: the
scheduler gives it a core only when no other task wants one, and a waking training thread (an
OpenMP worker of the trainer's team) takes the core back at once, where a nice-19 thread would keep
it until its slice ends (docs/performance.md). A SCHED_IDLE writer that other busy tasks starve is
rescued: a thread at nice WRITER_NICE takes over (:class:`StarvationCheck`, WriterThread._rescue).
ENTROPYLENS_WRITER_IDLE=0: nice only; ENTROPYLENS_WRITER_NICE=0: normal priority (neither).
"""

from __future__ import annotations

import os
import threading
import time

WRITER_NICE = int(os.environ.get("ENTROPYLENS_WRITER_NICE", "19"))
WRITER_IDLE = WRITER_NICE > 0 and os.environ.get("ENTROPYLENS_WRITER_IDLE", "1") != "0"
# a caller that has waited this long for the writer checks whether the scheduler starves a SCHED_IDLE
# writer (runnable, but it ran under STARVED_SHARE of the time): then the rescue thread takes over
RESCUE_CHECK_S = 0.25
STARVED_SHARE = 0.25


def lower_priority(nice: int, idle: bool = False) -> bool:
    """Raise the calling thread's nice value to ``nice`` (only this thread: Linux keeps one per thread;
    never lowered); ``idle``: also move it to SCHED_IDLE (it then runs only on cores no other task
    wants). False where the platform has no per-thread priority or refuses (``idle`` refused: the
    nice value alone applies)."""
    if nice <= 0 or not hasattr(os, "setpriority") or not hasattr(threading, "get_native_id"):
        return False
    try:
        tid = threading.get_native_id()
        if os.getpriority(os.PRIO_PROCESS, tid) < nice:
            os.setpriority(os.PRIO_PROCESS, tid, nice)
    except OSError:
        return False
    if idle:
        try:
            os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
        except (AttributeError, OSError):
            return False
    return True


def idle_policy(tid: int) -> bool:
    """True when thread ``tid`` runs under SCHED_IDLE."""
    try:
        return os.sched_getscheduler(tid) == os.SCHED_IDLE
    except (AttributeError, OSError):
        return False


def thread_cpu(thread: threading.Thread) -> float:
    """The CPU seconds ``thread`` has used (Linux: its thread clock); 0.0 where unknown."""
    if thread.ident is None:  # not started yet
        return 0.0
    try:
        return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
    except (AttributeError, OSError, TypeError):
        return 0.0


def runnable(thread: threading.Thread) -> bool:
    """True when the kernel lists ``thread`` as running or waiting for a core (state R), i.e. it has
    work and is not blocked on I/O or a lock. False where unknown."""
    try:
        with open(f"/proc/self/task/{thread.native_id}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] == "R"
    except (OSError, IndexError, TypeError):
        return False


class StarvationCheck:
    """Whether the scheduler starves a SCHED_IDLE thread: asked by a caller that waits for it, every
    RESCUE_CHECK_S. Starved: runnable, yet it ran under STARVED_SHARE of the time since the last
    check (other tasks keep every core busy). A thread blocked on I/O (fsync, an upload) is not
    runnable, one that works runs: neither is starved."""

    def __init__(self) -> None:
        self._last: tuple[float, float] | None = None  # (monotonic, thread CPU) at the last check

    def starved(self, thread: threading.Thread) -> bool:
        if not idle_policy(thread.native_id or 0):
            return False
        now, cpu = time.monotonic(), thread_cpu(thread)
        last, self._last = self._last, (now, cpu)
        if last is None or now - last[0] > 2 * RESCUE_CHECK_S:
            return False  # no recent sample: this one starts the window
        return cpu - last[1] < STARVED_SHARE * (now - last[0]) and runnable(thread)
