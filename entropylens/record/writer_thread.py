"""The recorder's writer thread: everything between the training thread and the files.

The training thread only puts messages on a bounded queue (``put`` blocks when the queue is full:
back-pressure, never a drop). The thread, in queue order:
  update     waits for the update's host copy (CPU updates: builds the block here, the sample, the
             aggregates and the packing off the training thread; a hand-over's same-shaped updates are
             built together, host_copy.build_blocks), checks the input finite flags, selects the token
             rows (the compaction) and files the exact aggregates in the step table;
  scalars    adds recorded scalars to a step row (or to every row of a step);
  sequences  writes a sequences file;
  close      writes the token files of the closed steps, then their steps files (a present steps
             row implies all its token rows);
  summary    answers a question about a step's aggregates (for trainer logs), with its histograms and
             token table when asked (step_table.HISTOGRAMS_KEY, TABLE_KEY: the trackers);
  heartbeat  rewrites run.json.
A failure is kept in ``error`` and surfaced by the recorder at its next call, never swallowed.
run.json (rank 0 only) is written atomically from :class:`RunInfo`; with several ranks each
rank also writes ranks/rank-R.json (its own status and heartbeat).
"""

from __future__ import annotations

import json
import logging
import os
import queue
import sys
import threading
import time
import warnings
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from .. import storage
from . import packed_block
from . import writer as parquet
from .host_copy import DeferredBlock, HostCopy, build_blocks
from ..schema import QUADRANT_NAMES, SCHEMA_VERSION
from .step_table import StepTable
from .threads import serial_torch_ops
from .token_buffer import TokenBuffer

_STOP = object()
# The writer thread's priority (Linux: a thread is a task with its own scheduling policy and nice
# value). Its work can wait; the training step's threads cannot. By default it runs under SCHED_IDLE:
# the scheduler gives it a core only when no other task wants one, and a waking training thread (an
# OpenMP worker of the trainer's team) takes the core back at once, where a nice-19 thread keeps it
# until its slice ends (the toy's full recording against the recorder off: 1.008x at SCHED_IDLE,
# 1.045x at nice 19, 120 paired steps in one process; docs/performance.md). A SCHED_IDLE writer that
# other busy tasks starve is rescued (WriterThread._rescue): a thread at nice WRITER_NICE takes over.
# ENTROPYLENS_WRITER_IDLE=0: nice only; ENTROPYLENS_WRITER_NICE=0: normal priority (neither).
WRITER_NICE = int(os.environ.get("ENTROPYLENS_WRITER_NICE", "19"))
WRITER_IDLE = WRITER_NICE > 0 and os.environ.get("ENTROPYLENS_WRITER_IDLE", "1") != "0"
BACKPRESSURE_WARN_S = 5.0  # one warning per run once a hand-over has waited this long for room in the queue
OUTBOX_SIZE = 16  # messages per hand-over at most (bounds the host memory an unflushed outbox holds)
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


def caller_stacklevel() -> int:
    """The ``stacklevel`` of the first caller outside entropylens (a warning then names the user's line,
    whichever recorder method led to it)."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # entropylens/, not record/
    frame, level = sys._getframe(1), 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(package + os.sep):
        frame, level = frame.f_back, level + 1
    return level - 1 if frame is None else level


def utc_now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def atomic_write_text(path: "Path | storage.Location", text: str, fsync: bool = False) -> None:
    """Local: a hidden temporary file renamed into place; object storage: one PUT (storage.py)."""
    storage.location(path).write_text(text, fsync=fsync)


@dataclass
class RunInfo:
    """What run.json says about the run (the recorder updates status and loss settings)."""

    run: str
    world_size: int
    config: dict
    eps_low: float
    eps_high: float
    tau: float
    sample: float
    status: str = "running"
    loss: dict | None = None  # the loss's run-level settings (method, eps, agg, ...)
    started_at: str = field(default_factory=utc_now)
    resumed: list = field(default_factory=list)  # [{"after_step": K, "at": time}] per resume (Recorder(resume=))
    # the oldest schema version any of the run's files was written with (a run resumed by a newer
    # version keeps the older one: readers null the columns whose meaning changed since, schema.changed_meaning)
    schema_version: int = SCHEMA_VERSION

    def to_dict(self, error: BaseException | None) -> dict[str, Any]:
        loss = self.loss or {}
        return {
            "run": self.run,
            "method": self.config.get("method") or loss.get("method"),
            "config": self.config,
            "model": self.config.get("model"),
            "seed": self.config.get("seed"),
            "schema_version": self.schema_version,
            "world_size": self.world_size,
            "started_at": self.started_at,
            "heartbeat_at": utc_now(),
            "status": self.status,
            "error": None if error is None else str(error),
            "loss": self.loss,
            "eps_low": loss.get("eps_low", self.eps_low),
            "eps_high": loss.get("eps_high", self.eps_high),
            "tau": loss.get("tau", self.tau),
            "sample": self.sample,
            "quadrants": QUADRANT_NAMES,
            **({"resumed": self.resumed} if self.resumed else {}),
        }


class _Reply:
    """A one-shot answer from the writer thread."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self.value: Any = None

    def set(self, value: Any) -> None:
        self.value = value
        self._done.set()

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, writer: "WriterThread") -> Any:
        """The value, once set (None if the writer has died). While waiting, checks every
        RESCUE_CHECK_S whether the scheduler starves the writer (:meth:`WriterThread.check_starved`)."""
        while not self._done.wait(RESCUE_CHECK_S):
            if not writer.alive:
                return None
            writer.check_starved()
        return self.value


class WriterThread:
    def __init__(self, run_dir: Path, rank: int, info: RunInfo, *, queue_size: int, rows_per_file: int,
                 heartbeat_s: float, fsync: bool = True, histograms: bool = False, table_every: int = 0):
        self.run_dir, self.rank, self.info = run_dir, rank, info
        # for the trackers (Recorder(log_histograms=, log_table_every=)): each update's tokens counted into
        # the step's histograms; on steps divisible by table_every (> 0) a sample of its token rows
        self.histograms, self.table_every = bool(histograms), int(table_every)
        # fsync: every file (and its directory) reaches the disk before the steps file that commits its
        # step is renamed into place, and that steps file before the next one: safe against power loss
        self.fsync = fsync
        self.error: BaseException | None = None  # a write failure (sticky)
        self._rejected: list[ValueError] = []  # bad inputs found once the block reached the host
        self._steps = StepTable()
        self._tokens = TokenBuffer(rows_per_file)
        self._heartbeat_s = heartbeat_s
        self._last_beat = 0.0
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, queue_size))
        # messages wait in an outbox and go over as one batch at a step's end (or every OUTBOX_SIZE):
        # waking the thread per update costs a thread switch (and the GIL) on the training thread
        self._outbox: list[tuple] = []
        self._warned_wait = False  # the back-pressure warning (once per run)
        self._batch: list[tuple] = []  # the messages of the hand-over being handled, in order (a rescue goes on here)
        self._stopped = False  # the thread has taken the stop message
        self._cpu_done = 0.0  # CPU seconds of the writer threads that have ended (the idle one after a rescue)
        self.rescued = False  # a rescue thread has taken the work over from a starved SCHED_IDLE thread
        self._last_check: tuple[float, float] | None = None  # (monotonic, writer CPU) at the last starvation check
        self.write_run_json()
        self._thread = threading.Thread(target=self._loop, args=(WRITER_IDLE,), name=f"entropylens-writer-{info.run}",
                                        daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ caller side
    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def put(self, item: tuple, flush: bool = False) -> None:
        """Into the outbox; the outbox goes to the thread when ``flush`` or full (:meth:`flush`)."""
        self._outbox.append(item)
        if flush or len(self._outbox) >= OUTBOX_SIZE:
            self.flush()

    def flush(self) -> None:
        """Hand the outbox to the thread as one message. Blocks while the queue is full
        (back-pressure, never a drop); returns without queueing once the thread has failed (the
        caller's next check raises)."""
        if not self._outbox:
            return
        item, self._outbox = ("batch", self._outbox), []
        self._put(item)

    def _put(self, item: Any, after_error: bool = False) -> None:
        """Into the queue, waiting for room (checking for a starved writer while it waits). Gives up
        once the thread has died, or has failed unless ``after_error`` (a failed thread still drains)."""
        waited = 0.0
        while True:
            try:
                self._queue.put(item, timeout=RESCUE_CHECK_S)
                return
            except queue.Full:
                if (self.error is not None and not after_error) or not self._thread.is_alive():
                    return
                self.check_starved()
                waited += RESCUE_CHECK_S
                if waited >= BACKPRESSURE_WARN_S and not self._warned_wait:
                    self._warned_wait = True
                    warnings.warn(
                        f"entropylens: the training loop has waited {waited:.1f} s for the writer thread (its queue "
                        f"of {self._queue.maxsize} hand-overs is full). If the machine's cores are busy with other "
                        f"work, the writer (SCHED_IDLE, then nice {WRITER_NICE}) gets little CPU: "
                        "ENTROPYLENS_WRITER_NICE=0 gives it a fair share; a larger queue_size or sample < 1 lowers "
                        "its load", stacklevel=caller_stacklevel())

    def update(self, step: int, update: int, copy: "HostCopy | DeferredBlock") -> None:
        self.put(("update", step, update, copy))

    def scalars(self, step: int, update: int | None, values: "dict[str, Any] | tuple") -> None:
        """values: name -> float, or (floats, names, HostCopy) with device scalars still on their way."""
        self.put(("scalars", step, update, values))

    def rewards(self, step: int, total: float, count: int) -> None:
        self.put(("rewards", step, total, count))

    def sequences(self, step: int, part: int, arrays: dict) -> None:
        self.put(("sequences", step, part, arrays))

    def probes(self, step: int, update: int, rows: list[dict]) -> None:
        self.put(("probes", step, update, rows))

    def close_steps(self, upto: int | None) -> None:
        """Write the token files, then the steps files, of every step <= upto (all when None)."""
        self.put(("close", upto), flush=True)

    def heartbeat(self, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self._last_beat >= self._heartbeat_s:
            self._last_beat = now
            self.put(("heartbeat",))

    def summary(self, step: int, names: "tuple[str, ...] | None" = None) -> dict[str, float]:
        """The step table's summary of ``step`` once every queued message is handled."""
        return self.answer(self.summary_request(step, names))

    def answer(self, reply: _Reply) -> dict[str, float]:
        """The reply's summary, waiting for it ({} if the thread has died)."""
        return reply.wait(self) or {}

    def summary_request(self, step: int, names: "tuple[str, ...] | None" = None) -> _Reply:
        """Ask for ``step``'s summary without waiting: the reply is set once the thread has handled
        every message queued before it (its ``done()`` says when; ``wait(thread)`` blocks)."""
        reply = _Reply()
        self.put(("summary", step, reply, names), flush=True)
        return reply

    def drain(self) -> None:
        """Wait until the thread has handled every message handed over so far (the outbox is not
        handed over: what waits there stays for the next hand-over). For benchmarks: one recorder's
        writer work must not run into another's measurement."""
        reply = _Reply()
        self._put(("batch", [("summary", -1, reply)]))
        reply.wait(self)

    @property
    def cpu_seconds(self) -> float:
        """CPU time the writer thread has used so far (Linux: its thread clock; else 0); after it has
        stopped, its total."""
        done = self._cpu_done
        return done if not self._thread.is_alive() else done + thread_cpu(self._thread)

    def take_rejected(self) -> ValueError | None:
        return self._rejected.pop(0) if self._rejected else None

    def stop(self) -> None:
        self.flush()
        self._put(_STOP, after_error=True)
        while True:  # the thread that takes the stop message ends; after a rescue, the rescue thread
            thread = self._thread
            thread.join(RESCUE_CHECK_S)
            if thread.is_alive():
                self.check_starved()
            elif thread is self._thread:
                return

    def check_starved(self) -> None:
        """Called by a caller that waits for the writer (a full queue, a summary, a commit), every
        RESCUE_CHECK_S: when the SCHED_IDLE writer thread is runnable yet ran under STARVED_SHARE of
        the time since the last check, other tasks keep every core busy and the scheduler starves
        it. Then :meth:`_rescue`. A writer blocked on I/O (fsync, an upload) is not runnable, one
        that works runs: neither is rescued."""
        if self.rescued or not idle_policy(self._thread.native_id or 0):
            return
        now, cpu = time.monotonic(), thread_cpu(self._thread)
        last, self._last_check = self._last_check, (now, cpu)
        if last is None or now - last[0] > 2 * RESCUE_CHECK_S:
            return  # no recent sample: this one starts the window
        if cpu - last[1] < STARVED_SHARE * (now - last[0]) and runnable(self._thread):
            self._rescue()

    def _rescue(self) -> None:
        """A thread at nice WRITER_NICE (SCHED_OTHER: a waiting caller's core goes to it even while
        other processes keep the cores busy) takes the work over: the SCHED_IDLE thread stops after
        the message it is handling, and the new one goes on from the next message, in order. For the
        rest of the run the writer runs at nice WRITER_NICE."""
        self.rescued = True
        starved = self._thread
        logging.getLogger("entropylens").info(
            "entropylens: the writer thread (SCHED_IDLE) was starved by other busy tasks; a nice-%d thread takes "
            "its work over", WRITER_NICE)

        def take_over() -> None:
            starved.join()  # it ends after its current message (_loop checks ``rescued``)
            if not self._stopped:
                self._loop(False)

        # created by the caller's thread, it starts with the caller's policy (not SCHED_IDLE)
        self._thread = threading.Thread(target=take_over, name=starved.name + "-rescue", daemon=True)
        self._thread.start()

    def write_run_json(self, fsync: bool = False) -> None:
        """``fsync``: the final status (close) reaches the disk; heartbeats need not. With several
        ranks every rank also writes its own ``ranks/rank-R.json`` (status, heartbeat, error): the
        readers combine them into the run's status, so a rank that failed or died stays visible."""
        info = {**self.info.to_dict(self.error), "heartbeat_s": self._heartbeat_s}  # readers: stale after a few
        if self.info.world_size > 1:
            mine = {"rank": self.rank, **{k: info[k] for k in ("status", "heartbeat_at", "heartbeat_s", "error")}}
            atomic_write_text(self.run_dir / "ranks" / f"rank-{self.rank}.json", json.dumps(mine) + "\n",
                              fsync=fsync and self.fsync)
        if self.rank == 0:
            text = json.dumps(info, indent=2, default=str) + "\n"
            atomic_write_text(self.run_dir / "run.json", text, fsync=fsync and self.fsync)

    # ------------------------------------------------------------ thread side
    def _loop(self, idle: bool) -> None:
        """Handles the messages in queue order until the stop message; ``idle``: at SCHED_IDLE, and
        returns (without losing a message: the rest of the hand-over stays in ``_batch``) once a
        rescue thread takes over."""
        lower_priority(WRITER_NICE, idle=idle)
        if os.environ.get("ENTROPYLENS_WRITER_OMP", "1") != "0":  # (0: the old behaviour, for benchmarks)
            serial_torch_ops()  # never an OpenMP team of its own (entropylens/record/threads.py)
        handlers = {
            "update": self._on_update, "scalars": self._on_scalars, "rewards": self._on_rewards,
            "sequences": self._on_sequences, "close": self._on_close, "summary": self._on_summary,
            "heartbeat": lambda: self.write_run_json(),
            "probes": lambda step, update, rows: parquet.write_probes(self.run_dir, step, self.rank, update, rows,
                                                                       fsync=self.fsync),
        }
        while not (idle and self.rescued):
            if not self._batch:
                try:  # a quiet queue (a long step) still beats: a live run never looks stale
                    item = self._queue.get(timeout=self._heartbeat_s)
                except queue.Empty:
                    item = ("heartbeat",)
                if item is _STOP:
                    self._stopped = True
                    break
                self._batch = list(item[1]) if item[0] == "batch" else [item]
                if idle and self.rescued:
                    break  # the rescue thread handles this hand-over
                if self.error is None:
                    try:  # the hand-over's CPU updates, built together (one set of ops per same-shaped group)
                        build_blocks([m[3] for m in self._batch if m[0] == "update"])
                    except Exception:  # noqa: BLE001 - each update then builds alone and its handler surfaces the error
                        pass
            message = self._batch.pop(0)
            kind, args = message[0], message[1:]
            if self.error is not None and kind != "summary":
                continue  # drain after a failure; the caller sees the error at its next call
            try:
                handlers[kind](*args)
            except BaseException as e:  # surfaced in the caller, never swallowed
                self.error = e
        self._cpu_done += time.thread_time()

    def _on_update(self, step: int, update: int, copy: "HostCopy | DeferredBlock") -> None:
        block = copy.wait()  # a DeferredBlock builds it here (CPU): aggregates and packing off the caller
        host = packed_block.unpack(block, copy.layout)
        bad = [name for name, ok in host.finite.items() if not ok]
        if bad:  # the update is dropped; the caller raises this at its next call
            self._rejected.append(ValueError(
                f"{bad[0]} contains NaN or Inf at masked-in positions (step {step}, update {update})"))
            return
        self._steps.add_aggregates(step, update, host.aggregates)
        ratios = host.entropy_ratios()
        if ratios is not None:
            self._steps.add_entropy_ratios(step, ratios)
        if self.histograms:  # counts per update (bincount): no token arrays kept for them
            self._steps.add_histograms(step, ratios, *host.importance_ratios())
        if self.table_every > 0 and step % self.table_every == 0:
            self._steps.add_sample(step, update, host)
        # its rows are selected when its file is complete, with the file's other updates (token_buffer.py)
        for file_step, updates, arrays in self._tokens.add(step, update, host):
            parquet.write_tokens(self.run_dir, file_step, self.rank, updates, arrays, fsync=self.fsync)

    def _on_scalars(self, step: int, update: int | None, values: "dict[str, Any] | tuple") -> None:
        if isinstance(values, tuple):  # (floats, names, HostCopy of device scalars [k] float64)
            floats, names, copy = values
            values = {**floats, **dict(zip(names, copy.wait().tolist()))}
        if update is None:
            self._steps.add_step_scalars(step, values)
        else:
            self._steps.add_update_scalars(step, update, values)

    def _on_rewards(self, step: int, total: float, count: int) -> None:
        self._steps.add_rewards(step, total, count)

    def _on_sequences(self, step: int, part: int, arrays: dict) -> None:
        parquet.write_sequences(self.run_dir, step, self.rank, part, arrays, fsync=self.fsync)

    def _on_close(self, upto: int | None) -> None:
        for file_step, updates, arrays in self._tokens.flush(upto):
            parquet.write_tokens(self.run_dir, file_step, self.rank, updates, arrays, fsync=self.fsync)
        for step, rows in self._steps.close(upto):
            parquet.write_steps(self.run_dir, step, self.rank, rows, fsync=self.fsync)

    def _on_summary(self, step: int, reply: _Reply, names: "tuple[str, ...] | None" = None) -> None:
        reply.set(self._steps.summary(step, names))
