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

This module is the public API: :class:`Recorder`, put together from one part per job (each a mixin
in its own module under training/, whose docstring says its job and the state it owns):
  training/lifecycle.py    the run: arguments, claim or resume, the writer thread, close (RecorderError)
  training/inputs.py       the checks of an update's tensors, a step's scalars and sequences
  training/update.py       watch_logits, record_update, the pending update (LogitWatch); the hot path
  training/steps.py        the step state (StepState), record_step, record_sequences, probe, end_step, commit
  training/summaries.py    step_summary(_later) (PendingSummary), live alarms (alarms=, stop_on), log_to
  training/loss_output.py  what record_update(loss=...) reads (LossOutput: a Protocol)
Below them, one way down, each stage handing the next what it needs:
  device/       an update's token columns (token_columns.py), its block of attribution, sample and exact
                aggregates (blocks.py), packed in one int32 tensor (packed_block.py), copied to the host once
                without a sync on this thread (host_copy.py)
  writing/      the writer thread (thread.py: queue, back-pressure, errors, heartbeat), what each message does
                (file_work.py), steps rows (step_table.py), token rows waiting for their file
                (token_buffer.py), Parquet (parquet.py), the thread's CPU place (scheduling.py, openmp.py)
  run_dir/      run.json and status files (run_info.py), one run per directory (run_claim.py)
"""

from __future__ import annotations

from types import FunctionType

from .training.inputs import InputChecks
from .training.lifecycle import RecorderError, RunLifecycle
from .training.loss_output import CheckedLossOutput, LossOutput
from .training.steps import StepRecording, StepState
from .training.summaries import PendingSummary, StepReports
from .training.update import LogitWatch, UpdateRecording

__all__ = ["Recorder", "RecorderError", "LogitWatch", "PendingSummary", "StepState", "LossOutput", "CheckedLossOutput"]


class Recorder(RunLifecycle, UpdateRecording, StepRecording, StepReports, InputChecks):
    """Records policy updates of one run (one rank) to ``root/<run>/``. A context manager (its exit closes the
    recorder: status "failed" when the block raised, else "finished").

    Every argument is checked before anything is on disk. :meth:`on_alarm` adds any other listener of the
    live alarms. Texts of sequences are never decoded for you: pass ``record_sequences(..., texts=)``.

    Args:
        root: where the run's directory ``root/<run>/`` goes: a local directory or an object-store URL such as
            ``s3://bucket/prefix``. The run directory is made and must be writable (a probe file is written).
        run: the run id, a plain directory name (no '/', no leading '.', no control character). None
            (default): a new id each time, ``<config's method, or "run">-<YYYYmmdd-HHMMSS>-<4 hex digits>``,
            rank 0's id broadcast to every rank when torch.distributed runs with several ranks.
        config: the run's settings (method, eps_low, eps_high, beta1, ...), stored in run.json. Without a
            ``loss`` object the recorder derives ratio / clip region / quadrant with eps resolved for config's
            method (``loss_method`` or ``method``) as the loss would (``losses.resolve_eps``; without a known
            method eps_low defaults to 0.2 and eps_high to eps_low) and ``tau``.
        tau: the HP / LP threshold of the quadrants, in (0, 1] (a token is HP when its probability p >= tau);
            a ``loss`` whose config carries a tau overrides it for that update. Default 0.5.
        sample: in (0, 1]: the share of sequences whose token rows are kept, whole sequences, chosen by a hash
            of (run, seq id); step aggregates always cover all tokens. Default 1.0.
        rank: this process's rank. None (default): torch.distributed's rank when it is initialised, else 0.
        world_size: the number of ranks. None (default): torch.distributed's world size when it is
            initialised, else 1.
        queue_size: how many hand-overs the training thread may run ahead of the writer thread (default 16);
            a full queue makes it wait, nothing is dropped.
        on_error: "raise" (default): a writer failure raises :class:`RecorderError` at the next call.
            "warn": it is one warning instead (recording stops, training goes on, run.json says so).
        heartbeat_s: seconds between the heartbeats written to run.json (default 10); readers show a running
            run whose heartbeat is older than 3 intervals as stale.
        rows_per_file: token rows per file: a step's updates are buffered until they hold this many rows,
            then written as one file (a file holds whole updates of one step). Default 262144.
        storage_options: options of the object-store filesystem of ``root`` (fsspec: endpoint, keys); None:
            the environment's (``AWS_ENDPOINT_URL``, ...).
        fsync: each file and its directory are flushed to disk before the steps file that commits the step
            (safe against power loss, not only against a killed process). Default True.
        alarms: True (the default thresholds) or an ``alarms.Thresholds``: the rules of ``entropylens check``
            run live on each closed step's summary and warn (``alarms.EntropyAlarm``) once per rule. None
            (default): no live alarms.
        stop_on: rule names (e.g. ``("collapse", "nonfinite")``), one name, or "all": :attr:`should_stop` turns
            true once one of them fires (the loop reads it and stops). Needs ``alarms``. Default: none.
        overwrite: a directory that already holds a run of this id is refused (``run_claim.RunExistsError``)
            unless ``overwrite=True``, which first removes the old run's files (each rank its own; rank 0 also
            the run's shared files and those of ranks >= world_size). Default False.
        resume: K: continue the run a killed job left (the same ``run=``) after step K, the last step of the
            checkpoint the job resumes from: this rank's files of later steps are removed (a warning counts
            the committed ones: the resumed job records them again), recording starts after K, run.json keeps
            the first job's config (a different method is refused), start and loss settings and lists each
            resume. Compacted steps must lie at or before K. With several ranks pass the same K to every
            rank. None (default): a new run.
        log_to: "tensorboard", "wandb", "trackio", a ``trackers.Tracker``, a callable ``f(step, metrics)``, a
            list, or ``{name: option}``: each step's ``entropylens/...`` metrics (the names TRL's trackers
            get) go to these trackers at the step's own index, once the writer has answered its summary,
            without the training thread waiting (rank 0 only; ``entropylens.record.trackers``,
            docs/trackers.md). With ``alarms`` each finding is also the trackers' own alert (W&B, Trackio;
            TensorBoard: a text summary). None (default): no tracker.
        tokenizer: a tokenizer object, a local path or hub name, or a list of token strings (id -> text): lets
            a token viewer show each recorded token id's text. run.json's ``config.tokenizer`` names it
            (``token_text.tokenizer_info``: a list is stored inline), and rank 0 saves a copy of an object
            that has no loadable name in ``<run>/tokenizer/`` (``token_text.save_tokenizer``). None: none.
        log_histograms: each step's histograms of the entropy ratio and of the importance ratio by quadrant
            (exact over all its masked-in tokens, counted on the writer thread: 32 log-spaced bins over
            [0.5, 2] plus under- and overflow) as ``entropylens/hist/...``. None (default): on when
            ``log_to`` names a tracker, off otherwise; an explicit value applies with or without ``log_to``
            (``step_summary_later(step, names)`` then answers them for the names ``trackers.EXTRA_NAMES``).
        log_table_every: N: every N steps (step % N == 0; 0 never) a table ``entropylens/tokens`` of 64
            sampled token rows to W&B and Trackio. None (default): 50 when ``log_to`` names a tracker, 0
            otherwise; an explicit value applies with or without ``log_to``.

    Raises:
        ValueError: when sample or tau is not in (0, 1], on_error is neither "raise" nor "warn", the run id
            is not a plain directory name, stop_on names an unknown rule or comes without alarms,
            log_table_every is < 0, log_to names an unknown tracker or tokenizer is a list that is not all
            strings; when resume comes with overwrite, without run, is not an int >= 0, finds no run, a run of
            another method, compacted steps after K or no step K on disk (rank 0); and
            ``run_claim.RunExistsError`` (a ValueError) when the directory holds a run of this id and
            overwrite is False.
        TypeError: when log_to is none of the forms above.
        ImportError: when log_to names a tracker whose package is not installed.
        RecorderError: when the run directory cannot be made or written.
    """


def _named_here(cls: type, parts: tuple[type, ...]) -> None:
    """The parts' methods named as the facade's (``Recorder.record_update``: Python's own errors on bad
    arguments, reprs and help say so, as when one class held them all), and the public classes named
    as this module's (``entropylens.record.recorder.RecorderError`` in tracebacks and pickles)."""
    for part in parts:
        for name, member in vars(part).items():
            for f in (member, getattr(member, "fget", None)):  # a method, or a property's getter
                if isinstance(f, FunctionType):
                    f.__qualname__ = f"{cls.__name__}.{name}"
    for public in (RecorderError, LogitWatch, PendingSummary):
        public.__module__ = __name__


_named_here(Recorder, Recorder.__mro__[1:-1])
