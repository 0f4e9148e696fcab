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
in its own module, whose docstring says its job and the state it owns):
  lifecycle.py      the run: arguments, claim or resume, the writer thread, close (RecorderError)
  inputs.py         the checks of an update's tensors, a step's scalars and sequences
  update.py         watch_logits, record_update, the pending update (LogitWatch); the hot path
  steps.py          the step state (StepState), record_step, record_sequences, probe, end_step, commit
  summaries.py      step_summary(_later) (PendingSummary), live alarms (alarms=, stop_on), log_to
  loss_output.py    what record_update(loss=...) reads (LossOutput: a Protocol)
Below them, one way down, each stage handing the next what it needs:
  token_columns.py  an update's token columns on its device (ratio, quadrant, clip, entropy ratio)
  blocks.py         the update's block: attribution, sample, exact aggregates, packed (on the device, or from a snapshot)
  packed_block.py   the packed block's format: one int32 tensor per update, split back on the host
  host_copy.py      the one device -> host copy of that block, without a sync on this thread
  writer_thread.py  the queue, back-pressure, error surfacing, heartbeat and run.json; row selection
  step_table.py     steps rows (aggregates + scalars), closing steps, summaries
  token_buffer.py   token rows waiting for their file
"""

from __future__ import annotations

from types import FunctionType

from .inputs import InputChecks
from .lifecycle import RecorderError, RunLifecycle
from .loss_output import CheckedLossOutput, LossOutput
from .steps import StepRecording, StepState
from .summaries import PendingSummary, StepReports
from .update import LogitWatch, UpdateRecording

__all__ = ["Recorder", "RecorderError", "LogitWatch", "PendingSummary", "StepState", "LossOutput", "CheckedLossOutput"]


class Recorder(RunLifecycle, UpdateRecording, StepRecording, StepReports, InputChecks):
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
    ``entropylens.record.trackers``, docs/trackers.md). ``log_histograms``: with them each step's histograms of the
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
