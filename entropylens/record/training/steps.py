"""The Recorder's steps: where they stand (:class:`StepState`), their scalars and sequences, and closing them.

Part of :class:`entropylens.record.recorder.Recorder` (a mixin: the facade's docstring is the user's guide).
:class:`StepRecording` holds ``record_step``, ``record_sequences``, ``probe``, ``end_step`` and
``commit``, and ``_advance_to``: a later step closes the earlier ones (their steps rows are written
after their tokens). It owns ``_steps`` (a :class:`StepState`, made when the run opens),
``_probing`` and ``_warned_rescalar``; the writer thread, the live alarms and the trackers it hands
each closing step to belong to the other parts.

Scalars on a device in ``_DEFERRED_DEVICES`` (a grad norm on CUDA) are not read on this thread, which
would synchronise: one non-blocking copy (``host_copy.HostCopy``) that the writer thread waits for.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ...caller import caller_stacklevel
from ..device.host_copy import HostCopy
from .base import RecorderBase
from .inputs import Scalar, Vector, checked_texts, sequence_arrays, step_values

if TYPE_CHECKING:
    from ...rl.probe import ProbeForward

_DEFERRED_DEVICES = ("cuda",)  # record_step scalars on these devices reach the host by a non-blocking copy


class StepState:
    """Where the run's steps stand: the step being recorded, what is closed, what was asked for.

    ``resumed_after``: steps <= it are the earlier job's, committed (``resume=``; None otherwise); the
    step counters start there (-1 for a new run)."""

    __slots__ = (
        "resumed_after",
        "last",
        "closed_upto",
        "alarms_seen",
        "logged",
        "updates",
        "scalars_seen",
        "sequence_parts",
        "warned_text",
    )

    def __init__(self, resumed_after: int | None = None) -> None:
        self.resumed_after = resumed_after
        start = -1 if resumed_after is None else resumed_after
        self.last = start  # the step being recorded (steps never go back)
        self.closed_upto = start  # steps <= this were handed to the writer for good
        self.alarms_seen = start  # the live alarms have observed the steps <= this
        self.logged = start  # log_to: summaries of steps <= this were asked for (or are the earlier job's)
        # updates recorded in step `last` -> (had seq_ids, its mask or whether that mask selects a token, once asked)
        self.updates: dict[int, tuple[bool, torch.Tensor | bool]] = {}
        self.scalars_seen: tuple[int, set[str]] = (-1, set())  # (step, its whole-step scalars so far)
        self.sequence_parts: dict[int, int] = {}  # step -> record_sequences calls so far (its part files)
        self.warned_text = False  # a text with invalid code points was replaced (said once per recorder)

    def refuse_closed(self, step: int, what: str) -> None:
        """A step already written (closed by a later step, commit() or resume=) takes nothing more."""
        if step <= self.closed_upto:
            raise ValueError(
                f"step {step} was already written; {what} must come before later steps, end_step(), commit() and resume="
            )

    def selects_a_token(self, update: int) -> bool:
        """Whether update ``update`` of the current step has a masked-in token (read from its mask once, a
        host sync, then kept as a bool)."""
        had_ids, selects = self.updates[update]
        if isinstance(selects, torch.Tensor):
            selects = bool(selects.any())
            self.updates[update] = (had_ids, selects)
        return selects


def _check_lr(step: int, lr: Scalar | None) -> None:
    """record_step's lr: a finite number >= 0 (a CUDA tensor is not read: that would synchronise)."""
    if lr is None or (isinstance(lr, torch.Tensor) and lr.device.type in _DEFERRED_DEVICES):
        return
    x = _scalar(lr)
    if not (np.isfinite(x) and x >= 0):
        raise ValueError(f"record_step({step}): lr must be a finite number >= 0, got {x}")


def _scalar(v: Scalar) -> float:
    if isinstance(v, torch.Tensor):
        return float(v.detach().float().cpu()) if v.device.type != "cpu" or v.dim() else float(v.item())
    return float(v)


class StepRecording(RecorderBase):
    """record_step, record_sequences, probe, end_step, commit; closing the steps (module docstring)."""

    def record_step(
        self,
        step: int,
        *,
        update: int | None = None,
        grad_norm: Scalar | None = None,
        lr: Scalar | None = None,
        **metrics: Scalar | None,
    ) -> None:
        """Scalars of a step (update=None: the whole step, e.g. reward mean) or of one update (its own
        optimizer step: grad norm before clipping, lr). Values may be tensors (CUDA tensors are not read
        here, which would synchronise: one non-blocking copy, read by the writer thread). NaN and +-inf are
        stored as they are (a NaN grad norm is a blow-up, never a missing value: the alarm rule
        ``nonfinite``); the first one of a run warns (``alarms.NonFiniteWarning``, naming the step and the
        value; a CUDA value once its copy has landed, at a later record_step). A whole-step value given twice
        for one step replaces the earlier one (one warning per run).

        Args:
            step: the step; a step already written (closed) is refused.
            update: None (default): the values are the whole step's. An int: they go to that update's steps
                row, and the update must have been recorded in this step already.
            grad_norm: the grad norm before clipping (a number or a one-element tensor), or None.
            lr: the learning rate, a finite number >= 0 (NaN, inf or a negative lr is refused: a broken
                schedule, not a measurement); a CUDA tensor lr is not read here and is only warned about
                when not finite. Or None.
            **metrics: more scalars by name (letters, digits and '_', '/', '.', '-'; '/', '.' and '-' become
                '_' in the steps column), each one number; none may be a column of the recorder's own (the
                aggregates, step, update, rank, run, loss). None values are left out.

        Raises:
            ValueError: when the step is closed, ``update`` names an update not recorded in this step, a
                metric's name is not allowed, two names make one column, a value is not one number, or lr
                is not a finite number >= 0; also an earlier update's bad input found since, as at every
                call.
            RecorderError: when the recorder is closed or its writer failed (``on_error="raise"``).
        """
        self._check_alive()
        step = int(step)
        self._finalize_pending()
        steps = self._steps
        steps.refuse_closed(step, "record_step")
        if update is not None and not self._probing and not self._disabled:
            known = steps.updates if step == steps.last else {}
            if int(update) not in known:  # a steps row of its own, without tokens: an off-by-one in update=
                have = ", ".join(str(u) for u in sorted(known)) or "none"
                raise ValueError(
                    f"record_step({step}, update={int(update)}): step {step} has no update {int(update)} "
                    f"recorded (its updates: {have}); record the update first, or leave out update= "
                    "for a value of the whole step"
                )
        values = step_values(grad_norm, lr, metrics)
        _check_lr(step, values.get("lr"))
        self._advance_to(step)
        if update is None:
            self._warn_replaced_step_scalars(step, set(values))
        # device tensors (a grad norm on CUDA) reach the host by one non-blocking copy that the writer
        # thread waits for (no synchronising .item() on this thread); everything else becomes a float now
        on_device = [k for k, v in values.items() if isinstance(v, torch.Tensor) and v.device.type in _DEFERRED_DEVICES]
        host: dict[str, Any] = {k: v if k in on_device else _scalar(v) for k, v in values.items()}
        device: tuple[tuple[str, ...], HostCopy] | None = None
        payload: dict[str, Any] | tuple = host  # messages.Scalars: host floats, or (floats, names, HostCopy)
        if on_device:
            stacked = torch.stack([host.pop(k).detach().reshape(()).float() for k in on_device]).double()  # [k]
            device = (tuple(on_device), HostCopy(stacked))
            payload = (host, *device)
        if not self._disabled:
            self._scalar_log().add(step, None if update is None else int(update), host, device)
            self._writer.scalars(step, None if update is None else int(update), payload)

    def _warn_replaced_step_scalars(self, step: int, names: set[str]) -> None:
        """Warn (once per run) when a whole-step scalar is set twice for one step: the later value replaces
        the earlier one, which loses e.g. the first grad norm of a step with two optimizer steps."""
        seen_step, seen = self._steps.scalars_seen
        if seen_step != step:
            seen = set()
            self._steps.scalars_seen = (step, seen)
        again = sorted(seen & names)
        seen |= names
        if again and not self._warned_rescalar:
            self._warned_rescalar = True
            warnings.warn(
                f"entropylens: record_step({step}) set {', '.join(again)} for the whole step again; the "
                "later value replaces the earlier one. With several optimizer steps in one step (several "
                "mini-batches), record each one's grad_norm / lr with update=<its last update>",
                stacklevel=3,
            )

    def record_sequences(
        self,
        step: int,
        *,
        seq_ids: Vector,
        rewards: Vector,
        advantages: Vector,
        lengths: Vector,
        group_ids: Vector | None = None,
        texts: Sequence[str | None] | None = None,
    ) -> None:
        """One row per sequence (the sequences table). Lone surrogates in a text are written as U+FFFD (one
        warning). A sequence that no update at this step or a later one trains (its tokens join nothing) is
        counted and named in one warning at close. Several calls for one step write several part files.

        Args:
            step: the step; a step already written (closed) is refused.
            seq_ids: [B] the sequences' ids, each once: the ids record_update gives their tokens.
            rewards: [B] rewards, finite.
            advantages: [B] advantages.
            lengths: [B] response lengths (tokens).
            group_ids: [B] group ids (the prompt's group), or None (-1).
            texts: [B] strings or None, each response's decoded text; never decoded here, even with a
                tokenizer: the token ids are in the tokens table and ``token_text`` decodes them. None: no
                texts.

        Raises:
            ValueError: when the step is closed, an array is not 1-D numbers of the one length B, a reward
                is NaN or Inf, texts does not have B entries, or a seq id is given twice; also an earlier
                update's bad input found since, as at every call.
            TypeError: when a text is not a str or None.
            RecorderError: when the recorder is closed or its writer failed (``on_error="raise"``).
        """
        self._check_alive()
        step = int(step)
        self._finalize_pending()
        self._steps.refuse_closed(step, "record_sequences")
        arrays = sequence_arrays(seq_ids, rewards, advantages, lengths, group_ids, texts)
        replaced = 0
        if "text" in arrays:
            arrays["text"], replaced = checked_texts(arrays["text"])
        self._advance_to(step)
        if replaced and not self._steps.warned_text:
            self._steps.warned_text = True
            warnings.warn(
                f"entropylens: record_sequences({step}): {replaced} text{'s' * (replaced > 1)} held lone "
                "surrogates (code points UTF-8 cannot store), written with U+FFFD in their place; later "
                "ones are replaced without a warning",
                stacklevel=caller_stacklevel(),
            )
        if self._disabled:
            return
        n = len(arrays["seq"])
        parts = self._steps.sequence_parts
        part = parts.get(step, 0)
        parts[step] = part + 1
        self._writer.rewards(step, float(arrays["reward"].astype(np.float64).sum()), n)
        self._writer.sequences(step, part, arrays)

    def probe(
        self,
        step: int,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        loss_fn: Callable[[torch.nn.Module, Any], ProbeForward],
        batch: Any,
        *,
        update: int = 0,
        max_grad_norm: float | None = None,
    ) -> list[dict[str, Any]]:
        """The parameter-space entropy probe (entropylens.rl.probe, opt-in: call it every K steps in place
        of one update's backward + optimizer step): runs that ONE real update on ``batch`` and records,
        per gradient part (each quadrant's kept and dropped gradient, momentum, the real step), the
        entropy change grad(H) . step(part) the optimizer's own step direction predicts, beside the
        measured change, in the ``probes`` table. Also records the update's grad_norm (before clipping)
        and lr (:meth:`record_step` with ``update``). The caller does not step the optimizer again for this
        batch.

        Args:
            step: the step; a step already written (closed) is refused.
            model: the policy (a torch.nn.Module), passed to ``loss_fn``.
            optimizer: its optimizer (torch.optim.Optimizer), stepped once here; its parameters that require
                grad are the ones probed.
            loss_fn: ``loss_fn(model, batch)`` returns a :class:`entropylens.rl.probe.ProbeForward` (logprobs
                and entropy with grad, the mask, a policy_loss output's columns); it may record the update
                itself while grad is enabled. It is called twice: for the update and, without grad, for the
                entropy after it.
            batch: the update's batch, passed to ``loss_fn`` as it is.
            update: the update's index within the step (default 0).
            max_grad_norm: clip the gradient to this norm before the step (``clip_grad_norm_``); None
                (default): no clipping.

        Returns:
            The probe's rows (the probes table's), one dict per gradient part: part, tokens, grad_norm,
            predicted_dh, measured_dh (the 'step' row only), entropy_before, optimizer, lr, update.

        Raises:
            ValueError: when the step is closed, the optimizer holds no parameter that requires grad, or
                loss_fn's logprobs or entropy carry no grad.
            RecorderError: when the recorder is closed or its writer failed (``on_error="raise"``).
        """
        from ...rl.probe import probe_update

        self._check_alive()
        step, update = int(step), int(update)
        self._finalize_pending()
        self._steps.refuse_closed(step, "probe")
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
        """The step is over: hand every step up to ``step`` to the writer thread to write now, without
        waiting (:meth:`commit` waits). Otherwise a step's files are written when a later step begins, so a
        job killed in between (during the next rollout) lost the step it had finished. Those steps are
        closed: recording into them again raises. Live alarms (``alarms=``) ask for the step's summary
        without waiting and warn once the writer has answered (seen at the next recorder call, at the
        latest at close).

        Args:
            step: the last step to close, <= the last recorded step; None (default): every step recorded so
                far.

        Returns:
            The last closed step (-1 when nothing was recorded).

        Raises:
            ValueError: when step is < 0 or has not been recorded yet; also an earlier update's bad input
                found since, as at every call.
            RecorderError: when the recorder is closed or its writer failed (``on_error="raise"``).
        """
        return self._close_through(step, "end_step", wait=False)

    def commit(self, step: int | None = None) -> int:
        """Write every step up to ``step`` now and wait until their files are renamed into place (and on
        disk, with ``fsync=True``): from then on a kill loses nothing of them. Those steps are closed:
        recording into them again raises, later steps record as usual. For checkpoints: record the step,
        save the model, then ``commit()``: a job killed after it has lost none of the steps before the
        checkpoint. Costs a wait for the writer thread (its backlog, then the step's files), so call it at
        checkpoints, not every step (:meth:`end_step` closes a step without the wait).

        Args:
            step: the last step to commit, <= the last recorded step; None (default): every step recorded so
                far, the one in progress included.

        Returns:
            The last committed step (-1 when nothing was recorded).

        Raises:
            ValueError: when step is < 0 or has not been recorded yet; also an earlier update's bad input
                found since, as at every call.
            RecorderError: when the recorder is closed or its writer failed (``on_error="raise"``), a write
                failing meanwhile included.
        """
        return self._close_through(step, "commit", wait=True)

    def _close_through(self, step: int | None, what: str, wait: bool) -> int:
        self._check_alive()
        self._finalize_pending()
        steps = self._steps
        if step is not None and int(step) < 0:
            raise ValueError(f"{what}: step must be >= 0, got {int(step)}")
        if step is not None and int(step) > steps.last:
            raise ValueError(f"step {int(step)} has not been recorded (the last recorded step is {steps.last})")
        upto = steps.last if step is None else int(step)
        if upto > steps.closed_upto and not self._disabled:
            if upto == steps.last:  # the others were observed as later steps closed them
                self._observe_alarms(upto, wait=wait)
                self._track_step(upto)
            self._writer.close_steps(upto=upto)
            steps.closed_upto = upto
        if wait and not self._disabled:
            self._writer.drain()
        if self._step_log is not None:
            self._step_log.log_ready()
        self._check_alive()  # a write that failed meanwhile raises here
        return upto

    def _advance_to(self, step: int) -> None:
        """A later step closes the earlier ones: their steps rows are written (after their tokens)."""
        if self._step_log is not None and self._step_log.waiting:
            self._step_log.log_ready()  # the answered summaries of closed steps, without waiting
        steps = self._steps
        if step > steps.last:
            if self._alarm_replies:
                self._observe_answered()
            if steps.last >= 0 and not self._disabled:
                self._observe_alarms(steps.last)
                self._track_step(steps.last)
                self._writer.close_steps(upto=step - 1)
                steps.closed_upto = step - 1
            steps.last = step
            steps.updates = {}
            self._writer.heartbeat()
