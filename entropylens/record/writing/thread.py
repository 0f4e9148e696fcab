"""The recorder's writer thread: everything between the training thread and the files.

The training thread only puts messages (messages.py) on a bounded queue (``put`` blocks when the
queue is full: back-pressure, never a drop). The thread, in queue order:
  Update     waits for the update's host copy (CPU updates: builds the block here, the sample, the
             aggregates and the packing off the training thread; a hand-over's same-shaped updates are
             built together, host_copy.build_blocks), checks the input finite flags, selects the token
             rows (the compaction) and files the exact aggregates in the step table;
  Scalars    adds recorded scalars to a step row (or to every row of a step);
  Sequences  writes a sequences file;
  Close      writes the token files of the closed steps, then their steps files (a present steps
             row implies all its token rows);
  Summary    answers a question about a step's aggregates (for trainer logs), with its histograms and
             token table when asked (step_table.HISTOGRAMS_KEY, TABLE_KEY: the trackers);
  Heartbeat  rewrites run.json (run_info.py).
Before every file it writes (run.json included) the thread checks that this writer still holds its
claim of the run and rank (run_claim.Claim.check); a writer whose run another job took over stops
there with a ClaimLostError. A failure is kept in ``error`` and surfaced by the recorder at its next
call, never swallowed. Its priority and the rescue of a starved thread: scheduling.py.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
import warnings
from pathlib import Path
from typing import Any

from ...caller import caller_stacklevel
from ...storage import Location
from ..device.host_copy import DeferredBlock, HostCopy, build_blocks
from ..run_dir.run_claim import ClaimLostError
from ..run_dir.run_info import RunInfo, write_run_json
from .file_work import FileWork
from .messages import STOP, Batch, Close, Heartbeat, Probes, Reply, Rewards, Scalars, Sequences, Summary, Update
from .openmp import serial_torch_ops
from .scheduling import RESCUE_CHECK_S, WRITER_IDLE, WRITER_NICE, StarvationCheck, lower_priority, thread_cpu

BACKPRESSURE_WARN_S = 5.0  # one warning per run once a hand-over has waited this long for room in the queue
OUTBOX_SIZE = 16  # messages per hand-over at most (bounds the host memory an unflushed outbox holds)


class WriterThread:
    def __init__(
        self,
        run_dir: Path | Location,
        rank: int,
        info: RunInfo,
        *,
        queue_size: int,
        rows_per_file: int,
        heartbeat_s: float,
        fsync: bool = True,
        histograms: bool = False,
        table_every: int = 0,
        claim=None,
    ):
        self.run_dir, self.rank, self.info, self.fsync = run_dir, rank, info, fsync
        self.claim = claim  # run_claim.Claim: checked before every file written (None: not checked)
        self.work = FileWork(
            run_dir,
            rank,
            rows_per_file=rows_per_file,
            fsync=fsync,
            histograms=histograms,
            table_every=table_every,
            claim=claim,
        )  # the thread side: what each message does
        self.error: BaseException | None = None  # a write failure (sticky)
        self._heartbeat_s = heartbeat_s
        self._last_beat = 0.0
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, queue_size))
        # messages wait in an outbox and go over as one batch at a step's end (or every OUTBOX_SIZE):
        # waking the thread per update costs a thread switch (and the GIL) on the training thread
        self._outbox: list = []
        self._warned_wait = False  # the back-pressure warning (once per run)
        self._batch: list = []  # the messages of the hand-over being handled, in order (a rescue goes on here)
        self._stopped = False  # the thread has taken the stop message
        self._cpu_done = 0.0  # CPU seconds of the writer threads that have ended (the idle one after a rescue)
        self.rescued = False  # a rescue thread has taken the work over from a starved SCHED_IDLE thread
        self._starvation = StarvationCheck()
        self.write_run_json()
        self._thread = threading.Thread(
            target=self._loop, args=(WRITER_IDLE,), name=f"entropylens-writer-{info.run}", daemon=True
        )
        self._thread.start()

    # ------------------------------------------------------------ caller side
    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def put(self, item: Any, flush: bool = False) -> None:
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
        item, self._outbox = Batch(self._outbox), []
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
                        "its load",
                        stacklevel=caller_stacklevel(),
                    )

    def update(self, step: int, update: int, copy: HostCopy | DeferredBlock) -> None:
        self.put(Update(step, update, copy))

    def scalars(self, step: int, update: int | None, values: dict[str, Any] | tuple) -> None:
        """values: name -> float, or (floats, names, HostCopy) with device scalars still on their way."""
        self.put(Scalars(step, update, values))

    def rewards(self, step: int, total: float, count: int) -> None:
        self.put(Rewards(step, total, count))

    def sequences(self, step: int, part: int, arrays: dict) -> None:
        self.put(Sequences(step, part, arrays))

    def probes(self, step: int, update: int, rows: list[dict]) -> None:
        self.put(Probes(step, update, rows))

    def close_steps(self, upto: int | None) -> None:
        """Write the token files, then the steps files, of every step <= upto (all when None)."""
        self.put(Close(upto), flush=True)

    def heartbeat(self, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self._last_beat >= self._heartbeat_s:
            self._last_beat = now
            self.put(Heartbeat())

    def summary(self, step: int, names: tuple[str, ...] | None = None) -> dict[str, float]:
        """The step table's summary of ``step`` once every queued message is handled."""
        return self.answer(self.summary_request(step, names))

    def answer(self, reply: Reply) -> dict[str, float]:
        """The reply's summary, waiting for it ({} if the thread has died)."""
        return self._wait(reply) or {}

    def _wait(self, reply: Reply) -> Any:
        """The reply's value, checking every RESCUE_CHECK_S whether the scheduler starves the writer."""
        return reply.wait_for(lambda: self.alive, self.check_starved, RESCUE_CHECK_S)

    def summary_request(self, step: int, names: tuple[str, ...] | None = None) -> Reply:
        """Ask for ``step``'s summary without waiting: the reply is set once the thread has handled
        every message queued before it (its ``done()`` says when; :meth:`answer` blocks)."""
        reply = Reply()
        self.put(Summary(step, reply, names), flush=True)
        return reply

    def drain(self) -> None:
        """Wait until the thread has handled every message handed over so far (the outbox is not
        handed over: what waits there stays for the next hand-over). For benchmarks: one recorder's
        writer work must not run into another's measurement."""
        reply = Reply()
        self._put(Batch([Summary(-1, reply)]))
        self._wait(reply)

    @property
    def cpu_seconds(self) -> float:
        """CPU time the writer thread has used so far (Linux: its thread clock; else 0); after it has
        stopped, its total."""
        done = self._cpu_done
        return done if not self._thread.is_alive() else done + thread_cpu(self._thread)

    @property
    def committed(self) -> int | None:
        """The last step whose steps file the thread has written (None: none yet): after a failure, the
        steps after it are lost."""
        return self.work.committed

    def stopped_message(self, error: BaseException, resumed_after: int | None) -> str:
        """The warning of a recording this thread's failure stopped, naming the first step lost: the one
        after the last step whose steps file it wrote (where none: this job's first, after ``resumed_after``)."""
        done = self.committed if self.committed is not None else resumed_after
        first = 0 if done is None else done + 1
        return (
            f"entropylens: recording stopped at step {first} (the Parquet writer failed: {error}); "
            f"steps {first}.. of run {self.info.run!r} (rank {self.rank}) are not recorded, training goes on"
        )

    def untrained(self) -> tuple[list[tuple[int, int]], int]:
        """Sequences rows no update trained (FileWork.untrained); read once the thread has stopped."""
        return self.work.untrained()

    def take_rejected(self) -> ValueError | None:
        return self.work.rejected.pop(0) if self.work.rejected else None

    def stop(self) -> None:
        self.flush()
        self._put(STOP, after_error=True)
        while True:  # the thread that takes the stop message ends; after a rescue, the rescue thread
            thread = self._thread
            thread.join(RESCUE_CHECK_S)
            if thread.is_alive():
                self.check_starved()
            elif thread is self._thread:
                return

    def check_starved(self) -> None:
        """Called by a caller that waits for the writer (a full queue, a summary, a commit), every
        RESCUE_CHECK_S: a SCHED_IDLE writer the scheduler starves (scheduling.StarvationCheck) is
        rescued (:meth:`_rescue`)."""
        if not self.rescued and self._starvation.starved(self._thread):
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
            "its work over",
            WRITER_NICE,
        )

        def take_over() -> None:
            starved.join()  # it ends after its current message (_loop checks ``rescued``)
            if not self._stopped:
                self._loop(False)

        # created by the caller's thread, it starts with the caller's policy (not SCHED_IDLE)
        self._thread = threading.Thread(target=take_over, name=starved.name + "-rescue", daemon=True)
        self._thread.start()

    def write_run_json(self, fsync: bool = False) -> None:
        """run.json and this rank's status file (run_info.write_run_json); ``fsync``: the final status
        (close) reaches the disk, heartbeats need not. Written only while this writer holds its claim:
        once another job has taken the run over, the lost claim becomes ``error`` and nothing is written."""
        if self.claim is not None:
            try:
                self.claim.check()
            except ClaimLostError as e:
                self.error = self.error or e
                return
        write_run_json(self.run_dir, self.rank, self.info, self.error, self._heartbeat_s, fsync and self.fsync)

    # ------------------------------------------------------------ thread side
    def _loop(self, idle: bool) -> None:
        """Handles the messages in queue order until the stop message; ``idle``: at SCHED_IDLE, and
        returns (without losing a message: the rest of the hand-over stays in ``_batch``) once a
        rescue thread takes over."""
        lower_priority(WRITER_NICE, idle=idle)
        if os.environ.get("ENTROPYLENS_WRITER_OMP", "1") != "0":  # (0: torch's own thread teams, for benchmarks)
            serial_torch_ops()  # never an OpenMP team of its own (entropylens/record/writing/openmp.py)
        handlers = {**self.work.handlers(), Heartbeat: lambda _: self.write_run_json()}
        while not (idle and self.rescued):
            if not self._batch:
                try:  # a quiet queue (a long step) still beats: a live run never looks stale
                    item = self._queue.get(timeout=self._heartbeat_s)
                except queue.Empty:
                    item = Heartbeat()
                if item is STOP:
                    self._stopped = True
                    break
                self._batch = list(item.messages) if isinstance(item, Batch) else [item]
                if idle and self.rescued:
                    break  # the rescue thread handles this hand-over
                if self.error is None:
                    try:  # the hand-over's CPU updates, built together (one set of ops per same-shaped group)
                        build_blocks([m.copy for m in self._batch if isinstance(m, Update)])
                    except Exception:  # noqa: BLE001 - each update then builds alone and its handler surfaces the error
                        pass
            message = self._batch.pop(0)
            if self.error is not None and not isinstance(message, Summary):
                continue  # drain after a failure; the caller sees the error at its next call
            try:
                handlers[type(message)](message)
            except BaseException as e:  # surfaced in the caller, never swallowed
                self.error = e
        self._cpu_done += time.thread_time()
