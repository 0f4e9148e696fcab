"""The Recorder's policy updates: the logit hook, an update's columns, the pending update and its hand-over.

Part of :class:`entropylens.record.recorder.Recorder`. :class:`UpdateRecording` (a mixin) holds
``watch_logits`` and ``record_update`` (the hot path: no host sync, checks in
``inputs.InputChecks``). An update waits as a :class:`_Pending` until its backward has run
(the hook has fired) or the next recorder call; ``_finalize_pending`` then does the device work
(token_columns.py, blocks.py), the one host copy (host_copy.py) and hands the block to the writer thread. It owns
``_pending`` and ``_watch``, and run.json's loss block (``_info.loss``, from the first loss given).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from ...caller import caller_stacklevel
from ...rl.losses import RUN_SETTINGS, update_settings
from ..device import blocks, packed_block, token_columns
from ..device.host_copy import DeferredBlock, HostCopy
from .base import RecorderBase
from .inputs import NonFiniteInput
from .loss_output import LossOutput


class LogitWatch:
    """A hook on a logits tensor [B, T, V] whose backward computes ||dLoss/dz_t||_2 per token (a
    float32 reduction over V on the device). The hook removes itself when it fires. As a context
    manager, its exit removes the hook if it has not fired (run the backward inside the block)."""

    def __init__(self, logits: torch.Tensor) -> None:
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

    def __enter__(self) -> LogitWatch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


@dataclass
class _Pending:
    """An update whose packing waits for the backward pass (watch_logits) or the next call."""

    step: int
    update: int
    columns: dict  # name -> [B, T]
    mask: torch.Tensor  # [B, T] bool
    finite: packed_block.FiniteFlags  # per checked input: all masked-in values finite (CPU: flags None, see snapshot)
    seq: torch.Tensor  # [B]
    group: torch.Tensor  # [B]
    tokens: torch.Tensor | None  # [B, T]
    loss_value: torch.Tensor | None
    watch: LogitWatch | None
    sensitivity: torch.Tensor | None  # [B, T] entropy sensitivity (attribution columns), or None
    temperature: float


def _checked_values(name: str, x: torch.Tensor) -> torch.Tensor:
    """An input as its finite check sees it (float32): a log-prob's -inf (a token of probability 0) as 0,
    so that only NaN and +inf fail there (blocks.LOG_PROB_INPUTS)."""
    x = x.detach().float()
    return x.masked_fill(x == float("-inf"), 0.0) if name in blocks.LOG_PROB_INPUTS else x


class UpdateRecording(RecorderBase):
    """watch_logits, record_update, the pending update (module docstring)."""

    def watch_logits(self, logits: torch.Tensor, tokens: torch.Tensor | None = None) -> LogitWatch:
        """Hook ``logits`` so that its backward computes ||dLoss/dz_t||_2 per token for the next recorded
        update. Use as ``with rec.watch_logits(logits): ...`` (the exit removes an unfired hook) or as a
        plain call (an unfired hook is removed when the update is finalised). The previous update is
        finalised first (its backward is done), and an earlier unfired hook is removed.

        Args:
            logits: the training forward pass's logits [B, T, V], requiring grad; the update recorded next
                must have the same [B, T].
            tokens: optional [B, T] token ids; only their shape is checked against the logits.

        Returns:
            The :class:`LogitWatch` (a context manager; ``.norms`` [B, T] float32 once the backward ran).

        Raises:
            ValueError: when logits is not a 3-d tensor, does not require grad, or tokens is not [B, T];
                also an earlier update's bad input (NaN or Inf, shared seq ids) found since, as at every call.
            RecorderError: when the recorder is closed or its writer failed (``on_error="raise"``).
        """
        self._check_alive()
        self._finalize_pending()  # the previous update's backward is done: its hook has fired
        if not isinstance(logits, torch.Tensor) or logits.dim() != 3:
            raise ValueError(f"watch_logits: logits must be [B, T, V], got {getattr(logits, 'shape', type(logits))}")
        if not logits.requires_grad:
            raise ValueError("watch_logits: logits do not require grad (call it on the training forward pass)")
        if tokens is not None and tuple(tokens.shape) != tuple(logits.shape[:2]):
            raise ValueError(
                f"watch_logits: tokens shape {tuple(tokens.shape)} != logits [B, T] {tuple(logits.shape[:2])}"
            )
        self._remove_hook()
        self._watch = LogitWatch(logits)
        return self._watch

    @property
    def has_hook(self) -> bool:
        return self._watch is not None and self._watch.active

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
        loss: LossOutput | None = None,
        entropy_sensitivity: torch.Tensor | None = None,
        temperature: float = 1.0,
        sampler_logprobs: torch.Tensor | None = None,
        is_masked: torch.Tensor | None = None,
    ) -> None:
        """One policy update (a mini-batch). Only masked-in tokens become rows. A mask that selects no token
        is a legitimate update (TRL and verl hand over such micro-batches: all completions truncated or tool
        output): it makes no token rows, only a steps row with n_tokens 0, and needs no seq_ids. No host sync
        happens here (on CUDA, NaN/Inf in the inputs is reported at the next call; only a step of several
        updates, some without seq_ids, reads their "any token?" flags). With a hook from
        :meth:`watch_logits` the update waits for its backward (or the next recorder call).

        Args:
            step: the step (>= 0); steps never go back, and a closed step (by a later step, :meth:`end_step`,
                :meth:`commit` or ``resume=``) takes no more updates.
            update: the update's index within the step (>= 0), each recorded once.
            mask: [B, T], true (nonzero) on the response tokens the update trains on.
            advantages: [B] (one per sequence) or [B, T].
            logprobs: [B, T] the current policy's log-probs of the tokens.
            old_logprobs: [B, T] the old (sampling) policy's log-probs.
            entropy: [B, T] the current policy's entropies, or None.
            old_entropy: [B, T] the old policy's entropies, or None (then no entropy ratio).
            tokens: [B, T] token ids (the tokens table's token_id), or None.
            seq_ids: [B] sequence ids, unique within the step, the same id for the same sequence in every
                update (they join the sequences rows). May be left out only when the step has one update with
                tokens: then the sequences are 0..B-1.
            group_ids: [B] group ids (the prompt's group), or None (-1).
            loss: a ``policy_loss`` output (any ``LossOutput``) whose columns are stored as they are, and whose
                config (method, eps, ...) goes into run.json (the first one given) and the steps rows. None: the
                recorder derives ratio, clip region and quadrant from the run's settings.
            entropy_sensitivity: [B, T] (stats.entropy_sensitivity, or ``logprobs_and_entropy(...,
                sensitivity=True)``); with the sampling ``temperature`` adds the entropy attribution:
                tokens.entropy_effect / entropy_effect_dropped and the steps' budget sums (a loss with an
                entropy bonus, ``loss.config['entropy_coef']`` != 0, needs the bonus's own term as the loss
                column ``entropy_effect_bonus`` [B, T], as ``policy_update`` measures it: without it
                entropy_effect is null, token_columns.entropy_bonus_rule).
            temperature: the sampling temperature (> 0, default 1.0), for the entropy attribution.
            sampler_logprobs: [B, T] the sampling engine's log-prob of each token (vLLM, SGLang: the
                training-inference mismatch, tokens.sampler_logprob; NaN where it did not score a token,
                stored as null). Left out: the column is null, never 0.
            is_masked: [B, T] or [B, 1] bool: the tokens the IS correction masked (tokens.is_masked). Left out:
                the column is null, never 0.

        Raises:
            ValueError: when step or update is < 0, the step went back or is closed, the update was
                recorded already, a tensor's shape does not match the mask's (advantages [B] or [B, T];
                seq_ids, group_ids [B]), a step's second update with tokens lacks seq_ids, seq ids repeat
                across rows with tokens (checked here on CPU, at the next call on a device), the logits hook
                has another [B, T], or temperature <= 0; :class:`NonFiniteInput` (a ValueError) for NaN or
                Inf at masked-in positions of an input (at this call, or at a later one where it is found
                later: on a device, after a pending backward, or on the writer thread; that update is dropped,
                the recorder stays usable).
            RecorderError: when the recorder is closed or its writer failed (``on_error="raise"``).
        """
        self._check_alive()
        step, update = int(step), int(update)
        self._finalize_pending()
        self._validate_update(
            step,
            update,
            mask,
            advantages,
            logprobs,
            old_logprobs,
            entropy,
            old_entropy,
            tokens,
            seq_ids,
            group_ids,
            entropy_sensitivity,
            temperature,
        )
        if self._disabled:
            return
        self._advance_to(step)
        m = mask.bool()
        b, _ = m.shape
        dev = m.device
        # (had seq_ids, its mask): whether the mask selects a token is asked only where a step's updates
        # come without seq_ids (_validate_update), so the hot path runs no extra op for it
        self._steps.updates[update] = (seq_ids is not None, m)
        settings = getattr(loss, "config", {}) or {}  # the loss output's attributes: loss_output.LossOutput
        if settings and self._info.loss is None:
            self._note_loss_settings(settings)
        per_update = update_settings(settings)  # beta1 etc.: they may change over a run -> steps rows
        if per_update:
            self._writer.scalars(step, update, per_update)
        columns = token_columns.derive_columns(
            mask=m,
            advantages=advantages,
            logprobs=logprobs,
            old_logprobs=old_logprobs,
            entropy=entropy,
            old_entropy=old_entropy,
            loss_columns=getattr(loss, "columns", None),
            eps_low=settings.get("eps_low", self.eps_low),
            eps_high=settings.get("eps_high", self.eps_high),
            tau=settings.get("tau", self.tau),
        )  # the attribution columns (entropy_sensitivity) are added with the aggregates (blocks.update_block)
        token_columns.add_mismatch(columns, m.shape, sampler_logprobs, is_masked)
        if entropy_sensitivity is not None:  # an entropy bonus whose own term the loss did not measure: null effect
            token_columns.entropy_bonus_rule(columns, settings)
        seq = seq_ids.to(dev).long() if seq_ids is not None else torch.arange(b, device=dev)  # [B]
        group = group_ids.to(dev).long() if group_ids is not None else torch.full((b,), -1, device=dev)  # [B]
        inputs = {
            "logprobs": logprobs,
            "old_logprobs": old_logprobs,
            "advantages": advantages,
            "entropy": entropy,
            "old_entropy": old_entropy,
        }
        # a policy_loss given these very tensors (and mask) found them finite already: not checked again
        pre = getattr(loss, "checked", None) or {}
        same_mask = pre.get("mask") is mask
        checked = {
            name: (columns["advantage"] if name == "advantages" else x)
            for name, x in inputs.items()
            if x is not None and not (same_mask and pre.get(name) is x)
        }
        if dev.type == "cpu" or not checked:
            # checked on the snapshot's own copies of these columns (blocks.snapshot, when the update is
            # finalised; the error is raised there): the same test in 3 ops instead of ~15
            finite = None
        else:
            stacked = torch.stack(
                [_checked_values(name, x).reshape(m.shape) for name, x in checked.items()]
            )  # [k, B, T]
            finite = ((stacked * 0 == 0) | ~m).flatten(1).all(dim=1)  # [k]: x * 0 is NaN iff x is NaN or +-inf
        watch = (
            self._watch if self._watch is not None and (self._watch.active or self._watch.norms is not None) else None
        )
        self._pending = _Pending(
            step=step,
            update=update,
            columns=columns,
            mask=m,
            finite=packed_block.FiniteFlags(tuple(checked), finite),
            seq=seq,
            group=group,
            tokens=tokens.to(dev) if tokens is not None else None,
            loss_value=getattr(loss, "loss", None),
            watch=watch,
            sensitivity=entropy_sensitivity,
            temperature=float(temperature),
        )
        if watch is None or not watch.active:
            self._finalize_pending()  # nothing to wait for

    def _note_loss_settings(self, settings: dict) -> None:
        """The run-level settings of the first loss given (method, eps, ...), once, into run.json; a loss
        whose method is not the one config names warns."""
        self._info.loss = {k: settings[k] for k in RUN_SETTINGS if k in settings}
        self._writer.heartbeat(force=True)
        cfg = self._info.config or {}
        named = cfg.get("loss_method", cfg.get("method"))  # loss_method: a run named apart from its loss
        if named is not None and settings.get("method") not in (None, named):
            warnings.warn(
                f"entropylens: Recorder(config={{'method': {named!r}}}) but the loss is "
                f"{settings['method']!r}: the runs table and the report name the run {named!r}; "
                f"run.json's loss block says {settings['method']!r}. Pass the loss's method in "
                "config",
                stacklevel=caller_stacklevel(),
            )

    def _remove_hook(self) -> None:
        if self._watch is not None:
            self._watch.remove()
            self._watch = None

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
        copy: DeferredBlock | HostCopy
        if pending.mask.device.type == "cpu":
            # the host is the device: the writer thread does the sample, the aggregates and the packing
            # (off the training thread) on a private copy of the update (three stacked copies)
            copy = DeferredBlock(
                blocks.snapshot(
                    columns,
                    pending.mask,
                    pending.loss_value,
                    pending.finite,
                    pending.seq,
                    pending.group,
                    pending.tokens,
                    pending.sensitivity,
                    pending.temperature,
                ),
                self._salt,
                self.sample,
            )
        else:
            packed, layout = blocks.update_block(
                columns,
                pending.mask,
                pending.loss_value,
                pending.finite,
                pending.seq,
                pending.group,
                pending.tokens,
                self._salt,
                self.sample,
                pending.sensitivity,
                pending.temperature,
            )
            copy = HostCopy(packed, layout)
        if copy.on_host:  # the flags can be read now without a sync: bad input fails this call
            bad = [name for name, ok in copy.finite().items() if not ok]
            if bad:
                if pending.step == self._steps.last:
                    self._steps.updates.pop(pending.update, None)
                raise NonFiniteInput(bad[0], pending.step, pending.update)
        self._writer.update(pending.step, pending.update, copy)
