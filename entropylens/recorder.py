"""Recorder: every update's token rows and exact step aggregates, into crash-safe Parquet.

    with Recorder("runs", config={"method": "grpo", "eps_low": 0.2}) as rec:
        for step in ...:
            for update, mb in enumerate(minibatches):
                logits = model(...).logits[...]                      # [B, T, V]
                with rec.watch_logits(logits):                       # exact ||dLoss/dz_t|| from backward
                    logp, ent = logprobs_and_entropy(logits, mb.tokens)
                    out = policy_loss(logp, mb.old_logp, mb.adv, mb.mask, entropy=ent, old_entropy=mb.old_ent)
                    rec.record_update(step, update, mask=mb.mask, advantages=mb.adv, logprobs=logp,
                                      old_logprobs=mb.old_logp, entropy=ent, old_entropy=mb.old_ent,
                                      tokens=mb.tokens, seq_ids=mb.seq_ids, loss=out)
                    out.loss.backward()
                rec.record_step(step, update=update, grad_norm=clip_grad_norm_(...), lr=lr)

Layout under ROOT/<run>/: run.json (atomic), tokens/step=S/rank=R/update-U.parquet,
sequences/step=S/rank=R/part-K.parquet, steps/step=S/rank=R/steps.parquet. Every file is
written under a hidden ``.*.tmp`` name and renamed into place when complete. The steps file of a
step is written after all its token files, so a present ``steps`` row implies all its token rows.

This module is the public API (argument checks, identity, the order of calls). The parts:
  tokenbatch.py     the device work of an update: columns, exact aggregates, sample, one packed block
  host_copy.py      the one device -> host copy of that block, without a sync on this thread
  writer_thread.py  the queue, back-pressure, error surfacing, heartbeat and run.json; row selection
  step_table.py     steps rows (aggregates + scalars), closing steps, summaries
  token_buffer.py   token rows waiting for their file
"""

from __future__ import annotations

import atexit
import json
import os
import secrets
import warnings
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import numpy as np
import torch

from . import run_claim, storage, tokenbatch
from .aggregates import AGG_NAMES
from .host_copy import DeferredBlock, HostCopy
from .losses import METHODS, RUN_SETTINGS, resolve_eps, update_settings
from .writer_thread import RunInfo, WriterThread, caller_stacklevel, utc_now


def _earlier_run_info(run_dir) -> dict:
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


class RecorderError(RuntimeError):
    """The recorder could not do its job (bad input, unwritable root, writer failure)."""


class LogitWatch:
    """A hook on a logits tensor [B, T, V] whose backward computes ||dLoss/dz_t||_2 per token (a
    float32 reduction over V on the device). The hook removes itself when it fires. As a context
    manager, its exit removes the hook if it has not fired (run the backward inside the block)."""

    def __init__(self, logits: torch.Tensor):
        self.shape = tuple(logits.shape[:2])  # (B, T)
        self.norms: torch.Tensor | None = None  # [B, T] float32 once the backward ran
        self._handle = logits.register_hook(self._fire)

    def _fire(self, grad: torch.Tensor) -> None:
        self.norms = torch.linalg.vector_norm(grad, dim=-1, dtype=torch.float32).detach()  # [B, T]
        self.remove()

    @property
    def active(self) -> bool:
        return self._handle is not None

    def remove(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def __enter__(self) -> "LogitWatch":
        return self

    def __exit__(self, *exc) -> None:
        self.remove()


@dataclass
class _Pending:
    """An update whose packing waits for the backward pass (watch_logits) or the next call."""

    step: int
    update: int
    columns: dict  # name -> [B, T]
    mask: torch.Tensor  # [B, T] bool
    finite: tokenbatch.FiniteFlags  # per checked input: all masked-in values finite (CPU: flags None, see snapshot)
    seq: torch.Tensor  # [B]
    group: torch.Tensor  # [B]
    tokens: torch.Tensor | None  # [B, T]
    loss_value: torch.Tensor | None
    watch: LogitWatch | None
    sensitivity: torch.Tensor | None  # [B, T] entropy sensitivity (attribution columns), or None
    temperature: float


def _run_level_eps(config: dict) -> tuple[float, float]:
    """eps as the loss would resolve it for the configured method (losses.resolve_eps); without a
    known method 0.2 / eps_low."""
    method = next((m for m in (config.get("loss_method"), config.get("method")) if m in METHODS), None)
    if method is not None:
        return resolve_eps(method, config.get("eps_low"), config.get("eps_high"))
    low = float(config["eps_low"]) if config.get("eps_low") is not None else 0.2
    high = float(config["eps_high"]) if config.get("eps_high") is not None else low
    return low, high


class Recorder:
    """Records policy updates of one run (one rank) to ``root/<run>/``. A context manager.

    ``config`` (method, eps_low, eps_high, beta1, ...) goes into run.json; without a ``loss`` object
    the recorder derives ratio / clip region / quadrant with eps resolved for config's method as the
    loss would (``losses.resolve_eps``) and ``tau``. ``sample`` in (0, 1] keeps whole sequences by a
    hash of (run, seq id); step aggregates always cover all tokens. ``on_error="warn"`` turns a
    writer failure into one warning (recording stops, training goes on, run.json says so).
    ``fsync`` (default on): each file and its directory are flushed to disk before the steps file
    that commits the step (safe against power loss, not only against a killed process).
    ``alarms`` (True, or an ``alarms.Thresholds``): the rules of ``entropylens check`` run live on
    each closed step's summary and warn (``alarms.EntropyAlarm``) once per rule; ``stop_on`` (rule names,
    e.g. ``("collapse", "nonfinite")``, or "all") makes :attr:`should_stop` true once one of them fires
    (the loop reads it and stops); ``probe`` runs the
    parameter-space entropy probe on one update. A directory that already holds a run of this id is
    refused (``run_claim.RunExistsError``) unless ``overwrite=True``, which first removes the old run's
    files; the default run id is new each time. ``resume=K`` continues the run a killed job left (the
    same ``run=``) after step K, the last step of the checkpoint the job resumes from: this rank's files
    of later steps are removed (a warning counts the committed ones: the resumed job records them
    again), recording starts after K, run.json keeps the first job's config (a different method is
    refused), start and loss settings and lists each resume. Compacted steps must lie at or before K.
    With several ranks pass the same K to every rank. ``log_to`` ("tensorboard", "wandb", "trackio", a
    ``trackers.Tracker``, a callable ``f(step, metrics)``, a list, or ``{name: option}``): each step's
    ``entropylens/...`` metrics (the names TRL's trackers get) go to these trackers at the step's own
    index, once the writer has answered its summary, without the training thread waiting (rank 0 only;
    ``entropylens.trackers``, docs/trackers.md). ``log_histograms``: with them each step's histograms of the
    entropy ratio and of the importance ratio by quadrant (exact over all its masked-in tokens, counted on
    the writer thread: 32 log-spaced bins over [0.5, 2] plus under- and overflow) as
    ``entropylens/hist/...``; ``log_table_every=N``: every N steps (step % N == 0; 0 never) a table
    ``entropylens/tokens`` of 64 sampled token rows to W&B and Trackio. Both default (None) to on (N = 50)
    when ``log_to`` names a tracker, off otherwise; an explicit value applies with or without ``log_to``
    (``step_summary_later(step, names)`` then answers them for the names ``trackers.EXTRA_NAMES``). With
    ``alarms=`` and ``log_to``, each finding is also the trackers' own alert (W&B, Trackio; TensorBoard: a
    text summary); :meth:`on_alarm` adds any other listener.
    ``tokenizer`` (a tokenizer object, a local path or hub
    name, or a list of token strings: id -> text) lets a token viewer show each recorded token id's text:
    run.json's ``config.tokenizer`` names it (``token_text.tokenizer_info``: a list is stored inline), and
    rank 0 saves a copy of an object that has no loadable name in ``<run>/tokenizer/``
    (``token_text.save_tokenizer``). Texts of sequences are never decoded for you: pass
    ``record_sequences(..., texts=)``.
    """

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
        alarms=None,
        stop_on=(),
        overwrite: bool = False,
        resume: int | None = None,
        log_to=None,
        tokenizer=None,
        log_histograms: bool | None = None,
        log_table_every: int | None = None,
    ):
        if not 0.0 < sample <= 1.0:
            raise ValueError(f"sample must be in (0, 1], got {sample}")
        if on_error not in ("raise", "warn"):
            raise ValueError(f"on_error must be 'raise' or 'warn', got {on_error!r}")
        if not 0.0 < tau <= 1.0:
            raise ValueError(f"tau must be in (0, 1], got {tau}")
        self.config = dict(config or {})
        if tokenizer is not None:  # checked (a vocabulary of strings) before anything is on disk
            from .token_text import tokenizer_info

            self.config["tokenizer"] = tokenizer_info(tokenizer)
        self._alarm_thresholds = None
        if alarms:  # live alarms (entropylens.alarms): True for the defaults, or a Thresholds
            from .alarms import Thresholds

            self._alarm_thresholds = alarms if isinstance(alarms, Thresholds) else Thresholds()
        from .alarms import check_stop_on

        self._stop_on = check_stop_on(stop_on)
        if self._stop_on and self._alarm_thresholds is None:
            raise ValueError("stop_on needs alarms= (True or an alarms.Thresholds): the live rules that fire")
        self.tau, self.sample, self.on_error = float(tau), float(sample), on_error
        self.eps_low, self.eps_high = _run_level_eps(self.config)
        dist_on = torch.distributed.is_available() and torch.distributed.is_initialized()
        self.rank = int(rank if rank is not None else (torch.distributed.get_rank() if dist_on else 0))
        self.world_size = int(
            world_size if world_size is not None else (torch.distributed.get_world_size() if dist_on else 1)
        )
        resuming = resume is not None
        if resuming:  # checked before anything is created on disk
            if overwrite:
                raise ValueError("resume and overwrite exclude each other: resume continues the run, overwrite replaces it")
            if run is None:
                raise ValueError("resume needs the run id of the run to continue (run=...)")
            if isinstance(resume, bool) or not isinstance(resume, (int, np.integer)) or resume < 0:
                raise ValueError(f"resume must be the step the job resumes after (an int >= 0: the checkpoint's last "
                                 f"step), got {resume!r}")
        if log_to is not None:  # unknown names and missing packages fail here, before anything is on disk
            from . import trackers

            log_to = trackers.resolve(log_to) if self.rank == 0 else []
        if log_table_every is not None and (isinstance(log_table_every, bool) or int(log_table_every) < 0):
            raise ValueError(f"log_table_every must be an int >= 0 (0: no table), got {log_table_every!r}")
        tracked = bool(log_to)  # this rank logs to a tracker: the histograms and the table are on by default
        log_histograms = tracked if log_histograms is None else bool(log_histograms)
        log_table_every = (50 if tracked else 0) if log_table_every is None else int(log_table_every)
        if run is None:
            run = self._default_run_id(dist_on)
        if not run or "/" in run or run.startswith("."):
            raise ValueError(f"run id must be a plain directory name, got {run!r}")
        self.run = run
        self._alarms = None  # LiveAlarms, made at the first closed step when alarms= is set
        self.root = storage.location(root, storage_options)  # a local directory or s3://bucket/prefix
        self.dir = self.root / run
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
        self._resumed_after = int(resume) if resuming else None  # steps <= it are the earlier job's, committed
        earlier = {}
        if resuming:
            earlier = _earlier_run_info(self.dir)
            known = earlier.get("config") or {}
            if known.get("method") and self.config.get("method") not in (None, known["method"]):
                raise ValueError(f"resume: run {run!r} was recorded with method {known['method']!r}, config says "
                                 f"{self.config['method']!r}")
            self.config = {**known, **self.config}  # the earlier job's settings, unless given again
            self.eps_low, self.eps_high = _run_level_eps(self.config)
            removed = run_claim.resume(self.dir, self.rank, self.world_size, self._resumed_after)
            if removed:
                warnings.warn(f"entropylens: resume={int(resume)} removed {len(removed)} complete step(s) of run "
                              f"{run!r} (rank {self.rank}) recorded after step {int(resume)}: {_step_list(removed)}; "
                              "the resumed job records them again", stacklevel=2)
        else:
            run_claim.claim(self.dir, self.rank, self.world_size, overwrite)  # one run per directory (#13)
        if tokenizer is not None and self.rank == 0:  # the run's own copy where run.json names none to load
            from .token_text import save_tokenizer

            save_tokenizer(tokenizer, self.dir)
        self._salt = tokenbatch.run_hash(run)
        self._disabled = False
        self._closed = False
        self._step_updates: dict = {}  # updates recorded in the current step -> (had seq_ids, its mask or
        # whether that mask selects a token, once asked)
        self._scalars = None  # alarms.ScalarLog, made at the first record_step (_scalar_log)
        self._closed_upto = -1  # steps <= this were handed to the writer for good
        self._alarms_seen = -1  # the live alarms have observed the steps <= this
        self._alarm_replies: list = []  # (step, the writer's reply): summaries asked for by end_step
        self._probing = False  # probe(): its record_step may name an update without token rows
        self._step_scalars_seen: tuple[int, set[str]] = (-1, set())  # (step, its whole-step scalars so far)
        self._warned_rescalar = False
        self._last_step = -1
        self._sequence_parts: dict[int, int] = {}
        self._pending: _Pending | None = None
        self._watch: LogitWatch | None = None
        self._info = RunInfo(run=run, world_size=self.world_size, config=self.config, eps_low=self.eps_low,
                             eps_high=self.eps_high, tau=self.tau, sample=self.sample)
        if resuming:
            self._last_step = self._closed_upto = self._alarms_seen = self._resumed_after
            self._info.started_at = str(earlier.get("started_at") or self._info.started_at)
            self._info.loss = earlier.get("loss") or None
            self._info.resumed = list(earlier.get("resumed") or []) + [{"after_step": self._resumed_after,
                                                                        "at": utc_now()}]
            try:  # the earlier job's files keep their version's meanings (run.json says the oldest)
                self._info.schema_version = min(self._info.schema_version, int(earlier["schema_version"]))
            except (KeyError, TypeError, ValueError):
                pass
        self._writer = WriterThread(self.dir, self.rank, self._info, queue_size=queue_size,
                                    rows_per_file=rows_per_file, heartbeat_s=heartbeat_s, fsync=fsync,
                                    histograms=log_histograms, table_every=log_table_every)
        self._step_log = None  # trackers.StepLog (log_to=): step summaries asked for as steps close
        self._step_logged = self._last_step  # steps <= this were asked for (or are the earlier job's)
        if log_to:
            from .trackers import StepLog

            self._step_log = StepLog(log_to, run, self.config)
            if self._alarm_thresholds is not None and self._step_log.trackers:  # findings as the trackers' alerts
                self.on_alarm(lambda finding: self._step_log.alert(finding, self._stop_on))
        atexit.register(self._atexit)

    def _default_run_id(self, dist_on: bool) -> str:
        method = str(self.config.get("method", "run"))
        run_id = f"{method}-{datetime.now().strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"
        if dist_on and self.world_size > 1:  # one-time agreement on the id; never per step
            box = [run_id]
            torch.distributed.broadcast_object_list(box, src=0)
            run_id = box[0]
        return run_id

    def __enter__(self) -> "Recorder":
        return self

    def __exit__(self, exc_type, exc, traceback) -> None:
        self.close(status="failed" if exc_type is not None else "finished", _raise=exc_type is None)

    # ------------------------------------------------------------------ public API
    def watch_logits(self, logits: torch.Tensor, tokens: torch.Tensor | None = None) -> LogitWatch:
        """Hook ``logits`` [B, T, V] so that its backward computes ||dLoss/dz_t||_2 per token for the
        next recorded update. Use as ``with rec.watch_logits(logits): ...`` (the exit removes an
        unfired hook) or as a plain call (an unfired hook is removed when the update is finalised)."""
        self._check_alive()
        self._finalize_pending()  # the previous update's backward is done: its hook has fired
        if not isinstance(logits, torch.Tensor) or logits.dim() != 3:
            raise ValueError(f"watch_logits: logits must be [B, T, V], got {getattr(logits, 'shape', type(logits))}")
        if not logits.requires_grad:
            raise ValueError("watch_logits: logits do not require grad (call it on the training forward pass)")
        if tokens is not None and tuple(tokens.shape) != tuple(logits.shape[:2]):
            raise ValueError(f"watch_logits: tokens shape {tuple(tokens.shape)} != logits [B, T] {tuple(logits.shape[:2])}")
        self._remove_hook()
        self._watch = LogitWatch(logits)
        return self._watch

    def record_update(
        self,
        step: int,
        update: int,
        *,
        mask: torch.Tensor,
        advantages: torch.Tensor,
        logprobs: torch.Tensor,
        old_logprobs: torch.Tensor,
        entropy: torch.Tensor | None = None,
        old_entropy: torch.Tensor | None = None,
        tokens: torch.Tensor | None = None,
        seq_ids: torch.Tensor | None = None,
        group_ids: torch.Tensor | None = None,
        loss: Any = None,
        entropy_sensitivity: torch.Tensor | None = None,
        temperature: float = 1.0,
    ) -> None:
        """One policy update (a mini-batch). Tensors are [B, T] (advantages [B] or [B, T]; seq_ids,
        group_ids [B]). Only masked-in tokens become rows. ``loss``: a ``policy_loss`` output whose
        columns are stored as they are. ``entropy_sensitivity`` [B, T] (stats.entropy_sensitivity, or
        ``logprobs_and_entropy(..., sensitivity=True)``) with the sampling ``temperature`` adds the
        entropy attribution: tokens.entropy_effect / entropy_effect_dropped and the steps' budget sums (a loss
        with an entropy bonus, ``loss.config['entropy_coef']`` != 0, needs the bonus's own term as the loss column
        ``entropy_effect_bonus`` [B, T], as ``policy_update`` measures it: without it entropy_effect is null,
        tokenbatch.entropy_bonus_rule). ``seq_ids`` (unique within the step, the same id for the
        same sequence in every update) may be left out only when the step has one update with tokens:
        then the sequences are 0..B-1. A mask that selects no token is a legitimate update (TRL and verl hand
        over such micro-batches: all completions truncated or tool output): it makes no token rows,
        only a steps row with n_tokens 0, and needs no seq_ids. No host sync happens here (on CUDA,
        NaN/Inf in the inputs is reported at the next call; only a step of several updates, some
        without seq_ids, reads their "any token?" flags)."""
        self._check_alive()
        step, update = int(step), int(update)
        self._finalize_pending()
        self._validate_update(step, update, mask, advantages, logprobs, old_logprobs, entropy, old_entropy,
                              tokens, seq_ids, group_ids)
        if entropy_sensitivity is not None and tuple(entropy_sensitivity.shape) != tuple(mask.shape):
            raise ValueError(f"entropy_sensitivity shape {tuple(entropy_sensitivity.shape)} does not match mask "
                             f"shape {tuple(mask.shape)}")
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        if self._disabled:
            return
        self._advance_to(step)
        m = mask.bool()
        b, _ = m.shape
        dev = m.device
        # (had seq_ids, its mask): whether the mask selects a token is asked only where a step's updates
        # come without seq_ids (_validate_update), so the hot path runs no extra op for it
        self._step_updates[update] = (seq_ids is not None, m)
        settings = getattr(loss, "config", {}) or {}
        if settings and self._info.loss is None:  # the run-level settings (method, eps, ...), once, into run.json
            self._info.loss = {k: settings[k] for k in RUN_SETTINGS if k in settings}
            self._writer.heartbeat(force=True)
            cfg = self._info.config or {}
            named = cfg.get("loss_method", cfg.get("method"))  # loss_method: a run named apart from its loss
            if named is not None and settings.get("method") not in (None, named):
                warnings.warn(f"entropylens: Recorder(config={{'method': {named!r}}}) but the loss is "
                              f"{settings['method']!r}: the runs table and the report name the run {named!r}; "
                              f"run.json's loss block says {settings['method']!r}. Pass the loss's method in "
                              "config", stacklevel=caller_stacklevel())
        per_update = update_settings(settings)  # beta1 etc.: they may change over a run -> steps rows
        if per_update:
            self._writer.scalars(step, update, per_update)
        columns = tokenbatch.derive_columns(
            mask=m, advantages=advantages, logprobs=logprobs, old_logprobs=old_logprobs, entropy=entropy,
            old_entropy=old_entropy, loss_columns=getattr(loss, "columns", None),
            eps_low=settings.get("eps_low", self.eps_low), eps_high=settings.get("eps_high", self.eps_high),
            tau=settings.get("tau", self.tau),
        )  # the attribution columns (entropy_sensitivity) are added with the aggregates (tokenbatch.update_block)
        if entropy_sensitivity is not None:  # an entropy bonus whose own term the loss did not measure: null effect
            tokenbatch.entropy_bonus_rule(columns, settings)
        seq = seq_ids.to(dev).long() if seq_ids is not None else torch.arange(b, device=dev)  # [B]
        group = group_ids.to(dev).long() if group_ids is not None else torch.full((b,), -1, device=dev)  # [B]
        inputs = {"logprobs": logprobs, "old_logprobs": old_logprobs, "advantages": advantages, "entropy": entropy,
                  "old_entropy": old_entropy}
        # a policy_loss given these very tensors (and mask) found them finite already: not checked again
        pre = getattr(loss, "checked", None) or {}
        same_mask = pre.get("mask") is mask
        checked = {name: (columns["advantage"] if name == "advantages" else x) for name, x in inputs.items()
                   if x is not None and not (same_mask and pre.get(name) is x)}
        if dev.type == "cpu" or not checked:
            # checked on the snapshot's own copies of these columns (tokenbatch.snapshot, when the update is
            # finalised; the error is raised there, as before): the same test in 3 ops instead of ~15
            finite = None
        else:
            stacked = torch.stack([x.detach().float().reshape(m.shape) for x in checked.values()])  # [k, B, T]
            finite = ((stacked * 0 == 0) | ~m).flatten(1).all(dim=1)  # [k]: x * 0 is NaN iff x is NaN or +-inf
        watch = self._watch if self._watch is not None and (self._watch.active or self._watch.norms is not None) \
            else None
        self._pending = _Pending(
            step=step, update=update, columns=columns, mask=m, finite=tokenbatch.FiniteFlags(tuple(checked), finite),
            seq=seq, group=group,
            tokens=tokens.to(dev) if tokens is not None else None,
            loss_value=getattr(loss, "loss", None), watch=watch, sensitivity=entropy_sensitivity,
            temperature=float(temperature),
        )
        if watch is None or not watch.active:
            self._finalize_pending()  # nothing to wait for

    def record_step(self, step: int, *, update: int | None = None, grad_norm=None, lr=None, **metrics) -> None:
        """Scalars of a step (update=None: the whole step, e.g. reward mean) or of one update
        (its own optimizer step: grad norm before clipping, lr). Values may be tensors (CUDA tensors
        are not read here, which would synchronise: one non-blocking copy, read by the writer thread).
        NaN and +-inf are stored as they are (a NaN grad norm is a blow-up, never a missing value: the
        alarm rule ``nonfinite``); the first one of a run warns (``alarms.NonFiniteWarning``, naming the
        step and the value; a CUDA value once its copy has landed, at a later record_step). ``lr`` must
        be a finite number >= 0 (NaN, inf or a negative lr is refused: a broken schedule, not a
        measurement); a CUDA tensor lr is not read here and is only warned about when not finite."""
        self._check_alive()
        step = int(step)
        self._finalize_pending()
        self._refuse_closed(step, "record_step")
        if update is not None and not self._probing and not self._disabled:
            known = self._step_updates if step == self._last_step else {}
            if int(update) not in known:  # a steps row of its own, without tokens: an off-by-one in update=
                have = ", ".join(str(u) for u in sorted(known)) or "none"
                raise ValueError(f"record_step({step}, update={int(update)}): step {step} has no update {int(update)} "
                                 f"recorded (its updates: {have}); record the update first, or leave out update= "
                                 "for a value of the whole step")
        values = {"grad_norm": grad_norm, "lr": lr, **metrics}
        values = {k: v for k, v in values.items() if v is not None}
        columns: dict[str, str] = {}  # column -> the name it came from
        for k in values:
            if k not in _PLAIN_NAMES and not k.replace("_", "").replace("/", "").replace(".", "").replace("-", "").isalnum():
                raise ValueError(f"metric name {k!r}: use letters, digits, '_', '/', '.', '-'")
            col = k.replace("/", "_").replace(".", "_").replace("-", "_")
            if col in _RECORDER_COLUMNS:
                raise ValueError(f"metric name {k!r}: the steps column {col!r} is the recorder's own (from the "
                                 "recorded updates); record it under another name")
            if col in columns:
                raise ValueError(f"metric names {columns[col]!r} and {k!r} are both the steps column {col!r}")
            columns[col] = k
        values = {col: values[k] for col, k in columns.items()}
        for k, v in values.items():
            if not isinstance(v, (int, float, np.number, np.ndarray, torch.Tensor)):
                raise ValueError(f"metric {columns[k]!r}: expected a number, got {type(v).__name__}")
            size = v.size if isinstance(v, np.ndarray) else v.numel() if isinstance(v, torch.Tensor) else 1
            if size != 1:
                raise ValueError(f"metric {columns[k]!r}: expected one number, got a tensor of shape {tuple(v.shape)}")
        _check_lr(step, values.get("lr"))
        self._advance_to(step)
        if update is None:
            self._warn_replaced_step_scalars(step, set(values))
        # device tensors (a grad norm on CUDA) reach the host by one non-blocking copy that the writer
        # thread waits for (no synchronising .item() on this thread); everything else becomes a float now
        on_device = [k for k, v in values.items() if isinstance(v, torch.Tensor) and v.device.type in _DEFERRED_DEVICES]
        values = {k: v if k in on_device else _scalar(v) for k, v in values.items()}
        host, device = values, None
        if on_device:
            stacked = torch.stack([values.pop(k).detach().reshape(()).float() for k in on_device]).double()  # [k]
            device = (tuple(on_device), HostCopy(stacked))
            values = (values, *device)
        if not self._disabled:
            self._scalar_log().add(step, None if update is None else int(update), host, device)
            self._writer.scalars(step, None if update is None else int(update), values)

    def _scalar_log(self):
        """record_step's values on the host side (alarms.ScalarLog: the run's one non-finite warning, and
        the live alarms' grad_norm / lr), made at the first record_step."""
        log = self._scalars
        if log is None:
            from .alarms import LiveAlarms, ScalarLog

            log = self._scalars = ScalarLog(self.run, keep=self._alarm_thresholds is not None)
            if self._alarm_thresholds is not None:
                if self._alarms is None:
                    self._alarms = LiveAlarms(self.run, self._alarm_thresholds, self._stop_on)
                self._alarms.scalar_log = log
        return log

    def _warn_replaced_step_scalars(self, step: int, names: set[str]) -> None:
        """Warn (once per run) when a whole-step scalar is set twice for one step: the later value replaces
        the earlier one, which loses e.g. the first grad norm of a step with two optimizer steps."""
        seen_step, seen = self._step_scalars_seen
        if seen_step != step:
            seen = set()
            self._step_scalars_seen = (step, seen)
        again = sorted(seen & names)
        seen |= names
        if again and not self._warned_rescalar:
            self._warned_rescalar = True
            warnings.warn(f"entropylens: record_step({step}) set {', '.join(again)} for the whole step again; the "
                          "later value replaces the earlier one. With several optimizer steps in one step (several "
                          "mini-batches), record each one's grad_norm / lr with update=<its last update>",
                          stacklevel=3)

    def record_sequences(self, step: int, *, seq_ids, rewards, advantages, lengths, group_ids=None, texts=None) -> None:
        """One row per sequence: reward, advantage, response length (all [B]); optional group ids and texts
        (``texts``: [B] strings, each response's decoded text; never decoded here, even with a tokenizer:
        the token ids are in the tokens table and ``token_text`` decodes them)."""
        self._check_alive()
        step = int(step)
        self._finalize_pending()
        self._refuse_closed(step, "record_sequences")
        self._advance_to(step)
        arrays = {
            "seq": _host_arg("seq_ids", seq_ids, np.int32),
            "reward": _host_arg("rewards", rewards, np.float32),
            "advantage": _host_arg("advantages", advantages, np.float32),
            "length": _host_arg("lengths", lengths, np.int32),
        }
        if arrays["seq"].ndim != 1:
            raise ValueError(f"record_sequences: seq_ids must be 1-D [B], got shape {arrays['seq'].shape}")
        n = len(arrays["seq"])
        arrays["group"] = _host_arg("group_ids", group_ids, np.int32) if group_ids is not None else np.full(n, -1, np.int32)
        for k, v in arrays.items():
            if v.ndim != 1 or len(v) != n:
                raise ValueError(f"record_sequences: {k} must be 1-D of length {n}, got shape {v.shape}")
        if not np.isfinite(arrays["reward"]).all():
            raise ValueError("record_sequences: rewards contain NaN or Inf")
        if texts is not None and len(texts) != n:
            raise ValueError(f"record_sequences: texts has {len(texts)} entries for {n} sequences")
        if texts is not None:
            arrays["text"] = list(texts)
        if self._disabled:
            return
        part = self._sequence_parts.get(step, 0)
        self._sequence_parts[step] = part + 1
        self._writer.rewards(step, float(arrays["reward"].astype(np.float64).sum()), n)
        self._writer.sequences(step, part, arrays)

    def probe(self, step: int, model, optimizer, loss_fn, batch, *, update: int = 0,
              max_grad_norm: float | None = None) -> list[dict]:
        """The parameter-space entropy probe (entropylens.probe, opt-in: call it every K steps in place
        of one update's backward + optimizer step): runs that ONE real update on ``batch`` and records,
        per gradient part (each quadrant's kept and dropped gradient, momentum, the real step), the
        entropy change grad(H) . step(part) the optimizer's own step direction predicts, beside the
        measured change, in the ``probes`` table. ``loss_fn(model, batch)`` returns a
        :class:`entropylens.probe.ProbeForward` (it may record the update itself while grad is
        enabled). Also records the update's grad_norm (before clipping) and lr. Returns the rows."""
        from .probe import probe_update

        self._check_alive()
        step, update = int(step), int(update)
        self._finalize_pending()
        self._refuse_closed(step, "probe")
        self._advance_to(step)
        rows = probe_update(model, optimizer, loss_fn, batch, max_grad_norm=max_grad_norm)
        self._finalize_pending()
        before_clip = rows[-1].pop("grad_norm_before_clip", None)
        for r in rows:
            r["update"] = update
        if not self._disabled:
            self._writer.probes(step, update, rows)
        self._probing = True  # the probed update's own row, whether or not loss_fn recorded its tokens
        try:
            self.record_step(step, update=update, grad_norm=before_clip, lr=rows[-1]["lr"])
        finally:
            self._probing = False
        return rows

    def end_step(self, step: int | None = None) -> int:
        """The step is over: hand every step up to ``step`` (default: every step recorded so far) to
        the writer thread to write now, without waiting (:meth:`commit` waits). Otherwise a step's files
        are written when a later step begins, so a job killed in between (during the next rollout)
        lost the step it had finished. Those steps are closed: recording into them again raises.
        Live alarms (``alarms=``) ask for the step's summary without waiting and warn once the writer
        has answered (seen at the next recorder call, at the latest at close). Returns the last closed
        step (-1 when nothing was recorded)."""
        return self._close_through(step, "end_step", wait=False)

    def commit(self, step: int | None = None) -> int:
        """Write every step up to ``step`` now (default: every step recorded so far, the one in
        progress included) and wait until their files are renamed into place (and on disk, with
        ``fsync=True``): from then on a kill loses nothing of them. Those steps are closed:
        recording into them again raises, later steps record as usual. Returns the last committed
        step (-1 when nothing was recorded). For checkpoints: record the step, save the model, then
        ``commit()``: a job killed after it has lost none of the steps before the checkpoint. Costs a
        wait for the writer thread (its backlog, then the step's files), so call it at checkpoints,
        not every step (:meth:`end_step` closes a step without the wait)."""
        return self._close_through(step, "commit", wait=True)

    def _close_through(self, step: int | None, what: str, wait: bool) -> int:
        self._check_alive()
        self._finalize_pending()
        if step is not None and int(step) < 0:
            raise ValueError(f"{what}: step must be >= 0, got {int(step)}")
        if step is not None and int(step) > self._last_step:
            raise ValueError(f"step {int(step)} has not been recorded (the last recorded step is {self._last_step})")
        upto = self._last_step if step is None else int(step)
        if upto > self._closed_upto and not self._disabled:
            if upto == self._last_step:  # the others were observed as later steps closed them
                self._observe_alarms(upto, wait=wait)
                self._track_step(upto)
            self._writer.close_steps(upto=upto)
            self._closed_upto = upto
        if wait and not self._disabled:
            self._writer.drain()
        if self._step_log is not None:
            self._step_log.log_ready()
        self._check_alive()  # a write that failed meanwhile raises here
        return upto

    def close(self, status: str = "finished", _raise: bool = True) -> None:
        """Flush, wait for the writer, write the final status."""
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
                    if self._last_step >= 0:
                        self._observe_alarms(self._last_step)
                    self._observe_answered(wait=True)
                    self._track_step(self._last_step)
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
        if error is not None and self.on_error == "raise" and _raise:
            self._writer.error = None
            raise RecorderError(f"the Parquet writer failed: {error}") from error
        if rejected is not None and _raise:
            raise rejected

    def step_summary(self, step: int) -> dict[str, float]:
        """Token-weighted means of the exact aggregates over the updates of ``step`` recorded so far
        (n_* counts summed); empty once the step has been written. For trainer logs (waits for the
        writer thread to take in the queued updates)."""
        return self.step_summary_later(step).result()

    def step_summary_later(self, step: int, names: "tuple[str, ...] | None" = None) -> "PendingSummary":
        """:meth:`step_summary` without waiting: returns at once; ``.ready()`` says whether the writer
        thread has answered, ``.result()`` gives the summary (waiting if needed). For trainer logs that
        must not wait on the writer thread's disk writes (a step's files, fsync included). ``names``:
        only these aggregates (and n_tokens), the rest is not computed."""
        self._finalize_pending()
        return PendingSummary(self._writer.summary_request(int(step), names), self._writer)

    @property
    def should_stop(self) -> bool:
        """True once a live alarm whose rule is in ``stop_on`` has fired (``stop_reason`` says which): a
        training loop reads it after each step and stops. The rules see a step once the writer thread has
        its summary (no wait at the step's end), so the stop can come a step or two after the finding's
        step; the finding names its step."""
        if self._alarm_replies:
            self._observe_answered()
        return self._alarms is not None and self._alarms.stop is not None

    def on_alarm(self, listener) -> None:
        """Call ``listener(finding)`` (an ``alarms.Finding``) at each live alarm finding, on the training
        thread, as the rules see the step (one call per finding; a listener that raises warns). Needs
        ``alarms=``."""
        if self._alarm_thresholds is None:
            raise ValueError("on_alarm needs alarms= (True or an alarms.Thresholds): the live rules that fire")
        if self._alarms is None:
            from .alarms import LiveAlarms

            self._alarms = LiveAlarms(self.run, self._alarm_thresholds, self._stop_on)
        self._alarms.listeners.append(listener)

    def observe_alarms(self) -> None:
        """Run the live alarm rules now on every step closed so far, waiting for the writer's answers (its
        findings warn, reach the :meth:`on_alarm` listeners and set :attr:`should_stop`): for a trainer
        whose trackers close before the recorder does (the TRL trainer's last step)."""
        self._observe_answered(wait=True)

    @property
    def stop_reason(self) -> str | None:
        """The finding that set :attr:`should_stop` (``run=... step=... rule=...``), or None."""
        return self._alarms.stop.line() if self._alarms is not None and self._alarms.stop is not None else None

    @property
    def has_hook(self) -> bool:
        return self._watch is not None and self._watch.active

    # ------------------------------------------------------------------ internals
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
                warnings.warn(f"entropylens: recording stopped, the Parquet writer failed: {error}", stacklevel=3)
                self._disabled = True
                self._info.status = "failed"
                self._remove_hook()
            else:
                self.close(status="failed", _raise=False)
                raise RecorderError(f"the Parquet writer failed: {error}") from error

    def _remove_hook(self) -> None:
        if self._watch is not None:
            self._watch.remove()
            self._watch = None

    def _validate_update(self, step, update, mask, advantages, logprobs, old_logprobs, entropy, old_entropy,
                         tokens, seq_ids, group_ids) -> None:
        if step < 0 or update < 0:
            raise ValueError(f"step and update must be >= 0, got step={step} update={update}")
        if step < self._last_step:
            raise ValueError(f"step {step} recorded after step {self._last_step}: steps must not go back"
                             + (f" (the run resumed after step {self._resumed_after})"
                                if self._resumed_after is not None and step <= self._resumed_after else ""))
        if step <= self._closed_upto:
            raise ValueError(f"step {step} was already written (steps <= {self._closed_upto} are closed: by a later "
                             "step, by end_step(), commit() or resume=); record into later steps")
        same_step = self._step_updates if step == self._last_step else {}
        if update in same_step:
            raise ValueError(f"step {step} update {update} was already recorded")
        if mask.dim() != 2:
            raise ValueError(f"mask must be [B, T], got shape {tuple(mask.shape)}")
        shape = tuple(mask.shape)
        for name, x in (("logprobs", logprobs), ("old_logprobs", old_logprobs), ("entropy", entropy),
                        ("old_entropy", old_entropy), ("tokens", tokens)):
            if x is not None and tuple(x.shape) != shape:
                raise ValueError(f"{name} shape {tuple(x.shape)} does not match mask shape {shape}")
        if tuple(advantages.shape) not in ((shape[0],), shape):
            raise ValueError(f"advantages must be [B] or [B, T] = {shape}, got {tuple(advantages.shape)}")
        for name, x in (("seq_ids", seq_ids), ("group_ids", group_ids)):
            if x is not None and tuple(x.shape) != (shape[0],):
                raise ValueError(f"{name} must be [B] = ({shape[0]},), got {tuple(x.shape)}")
        if same_step and (seq_ids is None or not all(had for had, _ in same_step.values())):
            # rows without seq_ids are numbered 0..B-1: they collide with another update's rows. An update
            # whose mask selects no token (a micro-batch of truncated or tool-only completions: TRL and
            # verl hand those over as any other) makes no rows, so it needs no ids and collides with none
            with_rows = [u for u in sorted(same_step) if self._selects_a_token(u)]
            if bool(mask.bool().any()):  # host syncs, only on this path
                with_rows.append(update)
            unnamed = [u for u in with_rows if not (same_step[u][0] if u in same_step else seq_ids is not None)]
            if unnamed and len(with_rows) > 1:
                raise ValueError(
                    f"seq_ids: step {step} has more than one update with tokens and update{'s' * (len(unnamed) > 1)} "
                    f"{', '.join(map(str, unnamed))} came without seq_ids; pass seq_ids [B] to every update of such "
                    "a step (unique within the step, the same id for the same sequence), or rows of different "
                    "mini-batches would share ids 0..B-1")
        watch = self._watch
        if watch is not None and (watch.active or watch.norms is not None) and watch.shape != shape:
            raise ValueError(f"watch_logits was given [B, T] = {watch.shape}, the update has {shape}")

    def _selects_a_token(self, update: int) -> bool:
        """Whether update ``update`` of the current step has a masked-in token (read from its mask once, a
        host sync, then kept as a bool)."""
        had_ids, selects = self._step_updates[update]
        if isinstance(selects, torch.Tensor):
            selects = bool(selects.any())
            self._step_updates[update] = (had_ids, selects)
        return selects

    def _refuse_closed(self, step: int, what: str) -> None:
        """A step already written (closed by a later step, commit() or resume=) takes nothing more."""
        if step <= self._closed_upto:
            raise ValueError(f"step {step} was already written; {what} must come before later steps, end_step(), commit() and resume=")

    def _observe_alarms(self, step: int, wait: bool = True) -> None:
        """Live alarms (``alarms=``): the closing step's summary through the rules; one warning per rule.
        Each step is observed once (a step closed by :meth:`commit` is not observed again). With
        ``wait=False`` (:meth:`end_step`) the summary is asked for now, before the step closes, and
        observed once the writer has answered (:meth:`_observe_answered`)."""
        if self._alarm_thresholds is None or step <= self._alarms_seen:
            return
        self._alarms_seen = step
        self._alarm_replies.append((step, self._writer.summary_request(step)))
        self._observe_answered(wait=wait)

    def _observe_answered(self, wait: bool = False) -> None:
        """Feed the live alarms the summaries the writer has answered, in step order (all of them,
        waiting, with ``wait``)."""
        while self._alarm_replies and (wait or self._alarm_replies[0][1].done()):
            step, reply = self._alarm_replies.pop(0)
            if self._alarms is None:
                from .alarms import LiveAlarms

                self._alarms = LiveAlarms(self.run, self._alarm_thresholds, self._stop_on)
            self._alarms.observe(step, self._writer.answer(reply))

    def _track_step(self, step: int) -> None:
        """``log_to``: ask for the summary of ``step`` (once, before it closes) without waiting."""
        if self._step_log is None or step <= self._step_logged or self._disabled:
            return
        from .trackers import EXTRA_NAMES, SUMMARY_NAMES

        self._step_logged = step
        names = SUMMARY_NAMES + EXTRA_NAMES if self._writer.histograms or self._writer.table_every else SUMMARY_NAMES
        self._step_log.add(step, PendingSummary(self._writer.summary_request(step, names), self._writer))

    def _advance_to(self, step: int) -> None:
        """A later step closes the earlier ones: their steps rows are written (after their tokens)."""
        if self._step_log is not None and self._step_log.waiting:
            self._step_log.log_ready()  # the answered summaries of closed steps, without waiting
        if step > self._last_step:
            if self._alarm_replies:
                self._observe_answered()
            if self._last_step >= 0 and not self._disabled:
                self._observe_alarms(self._last_step)
                self._track_step(self._last_step)
                self._writer.close_steps(upto=step - 1)
                self._closed_upto = step - 1
            self._last_step = step
            self._step_updates = {}
            self._writer.heartbeat()

    def _finalize_pending(self) -> None:
        """Aggregates and packing on the device, the one host copy (non-blocking on CUDA), and the
        block handed to the writer thread, which selects the rows."""
        pending = self._pending
        if pending is None:
            return
        self._pending = None
        norms = None
        if pending.watch is not None:
            norms = pending.watch.norms
            pending.watch.remove()
            if self._watch is pending.watch:
                self._watch = None
        columns = pending.columns
        if norms is not None:
            columns["logit_grad_norm"] = norms
        # else: a logit_grad_norm column given with the loss (no logits: verl's closed form from sum pi^2)
        if pending.mask.device.type == "cpu":
            # the host is the device: the writer thread does the sample, the aggregates and the packing
            # (off the training thread) on a private copy of the update (three stacked copies)
            copy = DeferredBlock(tokenbatch.snapshot(columns, pending.mask, pending.loss_value, pending.finite,
                                                     pending.seq, pending.group, pending.tokens, pending.sensitivity,
                                                     pending.temperature),
                                 self._salt, self.sample)
        else:
            packed, layout = tokenbatch.update_block(columns, pending.mask, pending.loss_value, pending.finite,
                                                     pending.seq, pending.group, pending.tokens, self._salt,
                                                     self.sample, pending.sensitivity, pending.temperature)
            copy = HostCopy(packed, layout)
        if copy.on_host:  # the flags can be read now without a sync: bad input fails this call
            bad = [name for name, ok in copy.finite().items() if not ok]
            if bad:
                if pending.step == self._last_step:
                    self._step_updates.pop(pending.update, None)
                raise ValueError(f"{bad[0]} contains NaN or Inf at masked-in positions "
                                 f"(step {pending.step}, update {pending.update})")
        self._writer.update(pending.step, pending.update, copy)


class PendingSummary:
    """A step summary the writer thread answers later (:meth:`Recorder.step_summary_later`)."""

    def __init__(self, reply, writer) -> None:
        self._reply, self._writer = reply, writer

    def ready(self) -> bool:
        return self._reply.done() or not self._writer.alive

    def result(self) -> dict[str, float]:
        return self._writer.answer(self._reply)


_PLAIN_NAMES = frozenset(("grad_norm", "lr"))
# steps columns the recorder fills from the updates (or keys rows by): a metric of that name would
# overwrite or be dropped, so record_step refuses it (grad_norm, lr, reward_mean and the loss
# settings are the caller's to give)
_RECORDER_COLUMNS = frozenset(AGG_NAMES) | {"step", "update", "rank", "run", "loss"}
_DEFERRED_DEVICES = ("cuda",)  # record_step scalars on these devices reach the host by a non-blocking copy


def _check_lr(step: int, lr) -> None:
    """record_step's lr: a finite number >= 0 (a CUDA tensor is not read: that would synchronise)."""
    if lr is None or (isinstance(lr, torch.Tensor) and lr.device.type in _DEFERRED_DEVICES):
        return
    x = _scalar(lr)
    if not (np.isfinite(x) and x >= 0):
        raise ValueError(f"record_step({step}): lr must be a finite number >= 0, got {x}")


def _scalar(v) -> float:
    if isinstance(v, torch.Tensor):
        return float(v.detach().float().cpu()) if v.device.type != "cpu" or v.dim() else float(v.item())
    return float(v)


def _host_arg(name: str, x, dtype) -> np.ndarray:
    """:func:`_host`, with a one-line error naming the argument when ``x`` is not numbers."""
    try:
        return _host(x, dtype)
    except (TypeError, ValueError) as e:
        raise ValueError(f"record_sequences: {name} must be [B] numbers (a tensor, array or list), got "
                         f"{type(x).__name__}: {e}") from None


def _host(x, dtype) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().numpy()
    return np.asarray(x).astype(dtype, copy=False)
