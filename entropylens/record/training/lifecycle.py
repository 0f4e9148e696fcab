"""The Recorder's run: opening it (new, or resumed after a step), keeping it alive, closing it.

Part of :class:`entropylens.record.recorder.Recorder` (the facade's docstring documents the arguments).
:class:`RunLifecycle` (a mixin) holds ``__init__``: every argument is checked before anything is on
disk, then the run directory is claimed (run_claim.py: one run per directory) or, with ``resume=K``,
this rank's files of steps after K are removed and run.json's earlier settings kept; then the writer
thread starts (writing/thread.py). ``close`` flushes, stops the writer and writes the final status
(and warns of sequences that no update trained: ``_warn_untrained``);
``_check_alive`` turns a writer failure into an error (or, with ``on_error="warn"``, one warning and a
recorder that records nothing more). It owns the run's identity and settings (``run``, ``root``,
``dir``, ``rank``, ``world_size``, ``config``, ``tau``, ``sample``, ``on_error``, ``eps_low``,
``eps_high``, ``_salt``), ``_info`` (run.json), ``_writer``, ``_disabled`` and ``_closed``.
"""

from __future__ import annotations

import atexit
import json
import os
import secrets
import warnings
from collections.abc import Iterable
from datetime import datetime
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
import torch

from ... import storage
from ...caller import caller_stacklevel
from ...rl.losses import METHODS, resolve_eps
from ..device import blocks
from ..run_dir import run_claim
from ..run_dir.run_info import RunInfo, utc_now
from ..writing.thread import WriterThread
from .base import RecorderBase
from .steps import StepState

if TYPE_CHECKING:
    from ...alarms import Thresholds
    from ..trackers import LogTo

_Self = TypeVar("_Self", bound="RunLifecycle")  # the Recorder (the facade above this part: not imported here)


class RecorderError(RuntimeError):
    """The recorder could not do its job (bad input, unwritable root, writer failure)."""


def _earlier_run_info(run_dir: storage.Location) -> dict[str, Any]:
    """The run.json a resumed run continues (its config, loss settings, start and earlier resumes stay);
    {} where it cannot be read (a torn run.json: the resumed run writes it anew)."""
    try:
        info = json.loads((run_dir / "run.json").read_text())
        return info if isinstance(info, dict) else {}
    except Exception:  # noqa: BLE001
        return {}


def _step_list(steps: list[int]) -> str:
    """'6-7' or '3, 5, 9' (up to 8 named)."""
    steps = sorted(steps)
    if steps == list(range(steps[0], steps[-1] + 1)) and len(steps) > 2:
        return f"{steps[0]}-{steps[-1]}"
    return ", ".join(str(x) for x in steps[:8]) + (", ..." if len(steps) > 8 else "")


def _run_level_eps(config: dict[str, Any]) -> tuple[float, float]:
    """eps as the loss would resolve it for the configured method (losses.resolve_eps); without a
    known method 0.2 / eps_low."""
    method = next((m for m in (config.get("loss_method"), config.get("method")) if m in METHODS), None)
    if method is not None:
        return resolve_eps(method, config.get("eps_low"), config.get("eps_high"))
    low = float(config["eps_low"]) if config.get("eps_low") is not None else 0.2
    high = float(config["eps_high"]) if config.get("eps_high") is not None else low
    return low, high


def _check_resume(run: str | None, resume: object, overwrite: bool) -> None:
    """``resume=`` with what it needs (checked before anything is created on disk)."""
    if overwrite:
        raise ValueError("resume and overwrite exclude each other: resume continues the run, overwrite replaces it")
    if run is None:
        raise ValueError("resume needs the run id of the run to continue (run=...)")
    if isinstance(resume, bool) or not isinstance(resume, (int, np.integer)) or resume < 0:
        raise ValueError(
            f"resume must be the step the job resumes after (an int >= 0: the checkpoint's last step), got {resume!r}"
        )


class RunLifecycle(RecorderBase):
    """Opening, resuming and closing the run (module docstring)."""

    def __init__(
        self,
        root: str | os.PathLike,
        run: str | None = None,
        *,
        config: dict | None = None,
        tau: float = 0.5,
        sample: float = 1.0,
        rank: int | None = None,
        world_size: int | None = None,
        queue_size: int = 16,
        on_error: str = "raise",
        heartbeat_s: float = 10.0,
        rows_per_file: int = 262_144,
        storage_options: dict | None = None,
        fsync: bool = True,
        alarms: bool | Thresholds | None = None,
        stop_on: str | Iterable[str] = (),
        overwrite: bool = False,
        resume: int | None = None,
        log_to: LogTo | None = None,
        tokenizer: Any = None,
        log_histograms: bool | None = None,
        log_table_every: int | None = None,
    ) -> None:
        if not 0.0 < sample <= 1.0:
            raise ValueError(f"sample must be in (0, 1], got {sample}")
        if on_error not in ("raise", "warn"):
            raise ValueError(f"on_error must be 'raise' or 'warn', got {on_error!r}")
        if not 0.0 < tau <= 1.0:
            raise ValueError(f"tau must be in (0, 1], got {tau}")
        self.config = dict(config or {})
        if tokenizer is not None:  # checked (a vocabulary of strings) before anything is on disk
            from ...token_text import tokenizer_info

            self.config["tokenizer"] = tokenizer_info(tokenizer)
        self._check_alarm_settings(alarms, stop_on)
        self.tau, self.sample, self.on_error = float(tau), float(sample), on_error
        self.eps_low, self.eps_high = _run_level_eps(self.config)
        dist_on = torch.distributed.is_available() and torch.distributed.is_initialized()
        self.rank = int(rank if rank is not None else (torch.distributed.get_rank() if dist_on else 0))
        self.world_size = int(
            world_size if world_size is not None else (torch.distributed.get_world_size() if dist_on else 1)
        )
        if resume is not None:
            _check_resume(run, resume, overwrite)
        log_to, log_histograms, log_table_every = self._check_tracker_settings(log_to, log_histograms, log_table_every)
        if run is None:
            run = self._default_run_id(dist_on)
        if not run or "/" in run or run.startswith(".") or any(ch < " " or ch == "\x7f" for ch in run):
            raise ValueError(f"run id must be a plain directory name (no '/' or control character), got {run!r}")
        self.run = run
        self._open_dir(root, storage_options, resuming=resume is not None)
        self._steps = StepState(int(resume) if resume is not None else None)
        earlier = self._claim_or_resume(overwrite)
        if tokenizer is not None and self.rank == 0:  # the run's own copy where run.json names none to load
            from ...token_text import save_tokenizer

            save_tokenizer(tokenizer, self.dir)
        self._salt = blocks.run_hash(run)
        self._disabled = False
        self._closed = False
        self._probing = False  # probe(): its record_step may name an update without token rows
        self._warned_rescalar = False
        self._pending = None  # update._Pending: an update waiting for its backward
        self._watch = None  # update.LogitWatch
        self._info = self._run_info(earlier)
        self._writer = WriterThread(
            self.dir,
            self.rank,
            self._info,
            queue_size=queue_size,
            rows_per_file=rows_per_file,
            heartbeat_s=heartbeat_s,
            fsync=fsync,
            histograms=log_histograms,
            table_every=log_table_every,
            claim=self._claim,
        )
        self._start_step_log(log_to)
        atexit.register(self._atexit)

    def _open_dir(self, root: str | os.PathLike, storage_options: dict | None, resuming: bool) -> None:
        """``root/<run>/``, made and found writable (a probe file)."""
        self.root = storage.location(root, storage_options)  # a local directory or s3://bucket/prefix
        self.dir = self.root / self.run
        if resuming and not self.dir.isdir():
            raise ValueError(f"resume: {self.dir} holds no run to resume")
        try:
            self.dir.mkdirs()
            probe = self.dir / f".probe-{self.rank}.tmp"
            probe.write_bytes(b"")
            probe.remove()
        except Exception as e:  # noqa: BLE001 - OSError locally; credentials/bucket errors on S3
            why = getattr(e, "strerror", None) or str(e).splitlines()[0] if str(e) else type(e).__name__
            raise RecorderError(f"cannot write the run directory {self.dir}: {why}") from None

    def _claim_or_resume(self, overwrite: bool) -> dict[str, Any]:
        """A new run claims its directory; a resumed one (``_steps.resumed_after``) removes this rank's
        files of later steps and takes the earlier job's config. Returns the earlier run.json ({})."""
        after = self._steps.resumed_after  # steps <= it are the earlier job's, committed
        self._claim = run_claim.Claim.new(self.dir, self.rank, self.world_size)  # one writer per run and rank
        if after is None:
            run_claim.claim(self.dir, self.rank, self.world_size, overwrite, writer=self._claim)
            return {}
        run = self.run
        earlier = _earlier_run_info(self.dir)
        known = earlier.get("config") or {}
        if known.get("method") and self.config.get("method") not in (None, known["method"]):
            raise ValueError(
                f"resume: run {run!r} was recorded with method {known['method']!r}, config says "
                f"{self.config['method']!r}"
            )
        self.config = {**known, **self.config}  # the earlier job's settings, unless given again
        self.eps_low, self.eps_high = _run_level_eps(self.config)
        removed = run_claim.resume(self.dir, self.rank, self.world_size, after, writer=self._claim)
        if removed:
            n = len(removed)
            warnings.warn(
                f"entropylens: resume={after} removed {n} complete step{'s' if n != 1 else ''} of run "
                f"{run!r} (rank {self.rank}) recorded after step {after}: {_step_list(removed)}; "
                "the resumed job records them again",
                stacklevel=3,
            )  # the line that made the Recorder
        return earlier

    def _run_info(self, earlier: dict[str, Any]) -> RunInfo:
        """run.json's contents; a resumed run keeps the earlier job's start, loss settings and resumes."""
        info = RunInfo(
            run=self.run,
            world_size=self.world_size,
            config=self.config,
            eps_low=self.eps_low,
            eps_high=self.eps_high,
            tau=self.tau,
            sample=self.sample,
        )
        after = self._steps.resumed_after
        if after is not None:
            info.started_at = str(earlier.get("started_at") or info.started_at)
            info.loss = earlier.get("loss") or None
            info.resumed = list(earlier.get("resumed") or []) + [{"after_step": after, "at": utc_now()}]
            try:  # the earlier job's files keep their version's meanings (run.json says the oldest)
                info.schema_version = min(info.schema_version, int(earlier["schema_version"]))
            except (KeyError, TypeError, ValueError):
                pass
        return info

    def _default_run_id(self, dist_on: bool) -> str:
        method = str(self.config.get("method", "run"))
        run_id = f"{method}-{datetime.now().strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"
        if dist_on and self.world_size > 1:  # one-time agreement on the id; never per step
            box = [run_id]
            torch.distributed.broadcast_object_list(box, src=0)
            run_id = box[0]
        return run_id

    def __enter__(self: _Self) -> _Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.close(status="failed" if exc_type is not None else "finished", _raise=exc_type is None)

    def close(self, status: str = "finished", _raise: bool = True) -> None:
        """Flush, wait for the writer, write the final status. A second call does nothing.

        Any pending update is finalised, the live alarms observe the last step, every step is written and the
        trackers (``log_to``) get the remaining summaries; then the writer thread stops and run.json gets the
        final status. A finished run with sequences that no update trained warns once (their seq ids).

        Args:
            status: the run's final status in run.json, "finished" (default) or "failed"; "failed" whatever
                is given when finalising the pending update raised or the writer failed.
            _raise: False leaves a writer failure and a rejected input unraised (the context manager's exit
                passes False when its block raised; the atexit hook too). Default True.

        Raises:
            RecorderError: when the writer thread failed (``on_error="raise"``).
            ValueError: when the writer thread rejected an update (:class:`NonFiniteInput`: NaN or Inf at
                masked-in positions; or seq ids shared by rows of one update), or finalising the pending
                update found such an input.
        """
        if self._closed:
            return
        self._closed = True
        rejected = None
        try:
            if not self._disabled and self._writer.error is None:
                try:
                    self._finalize_pending()
                except Exception:
                    status = "failed"
                    raise
                finally:
                    last = self._steps.last
                    if last >= 0:
                        self._observe_alarms(last)
                    self._observe_answered(wait=True)
                    self._track_step(last)
                    self._writer.close_steps(upto=None)
                    if self._step_log is not None:
                        self._step_log.log_ready(wait=True)
        finally:
            if self._step_log is not None:
                self._step_log.close()
            self._remove_hook()
            self._writer.stop()
            rejected = self._writer.take_rejected()
            if self._writer.error is not None:
                status = "failed"
            self._info.status = status
            try:
                self._writer.write_run_json(fsync=True)
            except OSError:
                pass
            try:
                atexit.unregister(self._atexit)
            except Exception:
                pass
        error = self._writer.error
        if error is None and status == "finished" and not self._disabled:  # a crashed loop left steps unfinished
            self._warn_untrained()
        if error is not None and self.on_error == "warn" and not self._disabled:  # not said yet: no call after it
            self._disabled = True
            warnings.warn(
                self._writer.stopped_message(error, self._steps.resumed_after), stacklevel=caller_stacklevel()
            )
        if error is not None and self.on_error == "raise" and _raise:
            self._writer.error = None
            raise RecorderError(f"the Parquet writer failed: {error}") from error
        if rejected is not None and _raise:
            raise rejected

    def _warn_untrained(self) -> None:
        """One warning (at close) for the sequences rows that no update at their step or later trained: their
        rewards join no tokens (a seq id that differs between record_sequences and record_update)."""
        rows, more = self._writer.untrained()
        if not rows:
            return
        n = len(rows) + more
        few = ", ".join(f"{i} (step {s})" for s, i in rows[:5]) + (", ..." if n > min(len(rows), 5) else "")
        warnings.warn(
            f"entropylens: {n} sequence{'s' * (n > 1)} of record_sequences in run {self.run!r} (rank "
            f"{self.rank}) matched no recorded update at {'their' if n > 1 else 'its'} step or a later "
            f"one: seq {few}; their rewards join no tokens. Pass record_update the same seq_ids",
            stacklevel=caller_stacklevel(),
        )

    def _atexit(self) -> None:
        if not self._closed:
            try:
                self.close(status="finished", _raise=False)
            except Exception:
                pass

    def _check_alive(self) -> None:
        if self._closed:
            raise RecorderError(f"recorder for run {self.run!r} is closed")
        rejected = self._writer.take_rejected()
        if rejected is not None:
            raise rejected
        error = self._writer.error
        if error is not None and not self._disabled:
            if self.on_error == "warn":
                warnings.warn(
                    self._writer.stopped_message(error, self._steps.resumed_after), stacklevel=caller_stacklevel()
                )
                self._disabled = True
                self._info.status = "failed"
                self._remove_hook()
            else:
                self.close(status="failed", _raise=False)
                raise RecorderError(f"the Parquet writer failed: {error}") from error
