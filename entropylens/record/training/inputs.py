"""The Recorder's checks of what it is given: an update's tensors, a step's scalars, a step's sequences.

Part of :class:`entropylens.record.recorder.Recorder`. :class:`InputChecks` (a mixin) holds
``_validate_update``: shapes, the order of steps and updates, seq_ids where a step has several updates
with tokens; it reads the step state (``_steps``) and the logit hook (``_watch``) and owns no state.
:func:`step_values` and :func:`sequence_arrays` check ``record_step``'s metrics and
``record_sequences``'s arrays (seq ids once per call, texts str or None: :func:`checked_texts`), and
:func:`duplicate_rows` (an update's rows with tokens share no seq id: checked at the call for a CPU update,
on the writer thread from the host copy for a device one, raised at the next call). Every check runs
before anything of the call is recorded, and none synchronises with a device except where its message
says so.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeAlias

import numpy as np
import torch

from ...rl.aggregates import AGG_NAMES
from .base import RecorderBase

Scalar: TypeAlias = float | np.number | np.ndarray | torch.Tensor  # record_step's: one number (an array: one element)
Vector: TypeAlias = torch.Tensor | np.ndarray | Sequence[float]  # record_sequences's: [B] numbers


class NonFiniteInput(ValueError):
    """An update's masked-in input holds NaN or Inf: that update is dropped, the recorder stays usable.
    ``step`` and ``update`` name the dropped update (on a device, or a CPU update packed on the writer
    thread, it is raised at the next call, so they may be the previous update's)."""

    def __init__(self, name: str, step: int, update: int):
        super().__init__(f"{name} contains NaN or Inf at masked-in positions (step {step}, update {update})")
        self.name, self.step, self.update = name, int(step), int(update)


_PLAIN_NAMES = frozenset(("grad_norm", "lr"))
# steps columns the recorder fills from the updates (or keys rows by): a metric of that name would
# overwrite or be dropped, so record_step refuses it (grad_norm, lr, reward_mean and the loss
# settings are the caller's to give)
_RECORDER_COLUMNS = frozenset(AGG_NAMES) | {"step", "update", "rank", "run", "loss"}


class InputChecks(RecorderBase):
    """record_update's checks (module docstring)."""

    def _validate_update(
        self,
        step: int,
        update: int,
        mask: torch.Tensor,
        advantages: torch.Tensor,
        logprobs: torch.Tensor,
        old_logprobs: torch.Tensor,
        entropy: torch.Tensor | None,
        old_entropy: torch.Tensor | None,
        tokens: torch.Tensor | None,
        seq_ids: torch.Tensor | None,
        group_ids: torch.Tensor | None,
        entropy_sensitivity: torch.Tensor | None,
        temperature: float,
    ) -> None:
        steps = self._steps
        if step < 0 or update < 0:
            raise ValueError(f"step and update must be >= 0, got step={step} update={update}")
        if step < steps.last:
            raise ValueError(
                f"step {step} recorded after step {steps.last}: steps must not go back"
                + (
                    f" (the run resumed after step {steps.resumed_after})"
                    if steps.resumed_after is not None and step <= steps.resumed_after
                    else ""
                )
            )
        if step <= steps.closed_upto:
            raise ValueError(
                f"step {step} was already written (steps <= {steps.closed_upto} are closed: by a later "
                "step, by end_step(), commit() or resume=); record into later steps"
            )
        same_step = steps.updates if step == steps.last else {}
        if update in same_step:
            raise ValueError(f"step {step} update {update} was already recorded")
        if mask.dim() != 2:
            raise ValueError(f"mask must be [B, T], got shape {tuple(mask.shape)}")
        shape = tuple(mask.shape)
        for name, x in (
            ("logprobs", logprobs),
            ("old_logprobs", old_logprobs),
            ("entropy", entropy),
            ("old_entropy", old_entropy),
            ("tokens", tokens),
        ):
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
            with_rows = [u for u in sorted(same_step) if steps.selects_a_token(u)]
            if bool(mask.bool().any()):  # host syncs, only on this path
                with_rows.append(update)
            unnamed = [u for u in with_rows if not (same_step[u][0] if u in same_step else seq_ids is not None)]
            if unnamed and len(with_rows) > 1:
                raise ValueError(
                    f"seq_ids: step {step} has more than one update with tokens and update{'s' * (len(unnamed) > 1)} "
                    f"{', '.join(map(str, unnamed))} came without seq_ids; pass seq_ids [B] to every update of such "
                    "a step (unique within the step, the same id for the same sequence), or rows of different "
                    "mini-batches would share ids 0..B-1"
                )
        watch = self._watch
        if watch is not None and (watch.active or watch.norms is not None) and watch.shape != shape:
            raise ValueError(f"watch_logits was given [B, T] = {watch.shape}, the update has {shape}")
        if seq_ids is not None and mask.device.type == "cpu":  # a device update: on the writer thread (its host copy)
            _refuse_duplicates(f"step {step} update {update}", seq_ids, mask)
        if entropy_sensitivity is not None and tuple(entropy_sensitivity.shape) != shape:
            raise ValueError(
                f"entropy_sensitivity shape {tuple(entropy_sensitivity.shape)} does not match mask shape {shape}"
            )
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")


def step_values(grad_norm: Scalar | None, lr: Scalar | None, metrics: dict[str, Scalar | None]) -> dict[str, Scalar]:
    """record_step's values by steps column (None left out): each a name of letters, digits and '_', '/',
    '.', '-' ('/', '.' and '-' become '_'), none a column of the recorder's own, each one number."""
    given = {"grad_norm": grad_norm, "lr": lr, **metrics}
    values = {k: v for k, v in given.items() if v is not None}
    columns: dict[str, str] = {}  # column -> the name it came from
    for k in values:
        if (
            k not in _PLAIN_NAMES
            and not k.replace("_", "").replace("/", "").replace(".", "").replace("-", "").isalnum()
        ):
            raise ValueError(f"metric name {k!r}: use letters, digits, '_', '/', '.', '-'")
        col = k.replace("/", "_").replace(".", "_").replace("-", "_")
        if col in _RECORDER_COLUMNS:
            raise ValueError(
                f"metric name {k!r}: the steps column {col!r} is the recorder's own (from the "
                "recorded updates); record it under another name"
            )
        if col in columns:
            raise ValueError(f"metric names {columns[col]!r} and {k!r} are both the steps column {col!r}")
        columns[col] = k
    values = {col: values[k] for col, k in columns.items()}
    for k, v in values.items():
        if not isinstance(v, (int, float, np.number, np.ndarray, torch.Tensor)):
            raise ValueError(f"metric {columns[k]!r}: expected a number, got {type(v).__name__}")
        if isinstance(v, (np.ndarray, torch.Tensor)) and (v.size if isinstance(v, np.ndarray) else v.numel()) != 1:
            raise ValueError(f"metric {columns[k]!r}: expected one number, got a tensor of shape {tuple(v.shape)}")
    return values


def sequence_arrays(
    seq_ids: Vector,
    rewards: Vector,
    advantages: Vector,
    lengths: Vector,
    group_ids: Vector | None,
    texts: Sequence[str | None] | None,
) -> dict[str, Any]:
    """record_sequences's columns on the host: seq, reward, advantage, length, group (-1 without
    group_ids), all 1-D of one length B, rewards finite; text (B strings) where texts are given."""
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
    ids, counts = np.unique(arrays["seq"], return_counts=True)
    if (counts > 1).any():
        raise ValueError(
            f"record_sequences: seq_ids {_few(ids[counts > 1])} occur more than once; one row per "
            "sequence: pass each sequence's id once"
        )
    return arrays if texts is None else {**arrays, "text": list(texts)}


def checked_texts(texts: list[str | None]) -> tuple[list[str | None], int]:
    """record_sequences's texts as they are written, and how many had invalid code points: each a str or None
    (else a TypeError naming its index and type); a str with lone surrogates (which UTF-8 cannot hold, e.g.
    from a byte-level decode split mid-character) gets U+FFFD in their place (a surrogate pair that stands
    for one character is joined)."""
    out, replaced = list(texts), 0
    for i, t in enumerate(out):
        if t is None:
            continue
        if not isinstance(t, str):
            raise TypeError(f"record_sequences: texts[{i}] is {type(t).__name__}, expected a str or None")
        try:
            t.encode("utf-8")
        except UnicodeEncodeError:
            out[i] = t.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
            replaced += 1
    return out, replaced


def duplicate_rows(seq: np.ndarray, has_tokens: np.ndarray) -> np.ndarray:
    """The seq ids that more than one row with a masked-in token carries (rows without one make no token
    rows: their ids may repeat)."""
    ids, counts = np.unique(seq[has_tokens], return_counts=True)
    return ids[counts > 1]


def duplicates_error(where: str, dup: np.ndarray) -> ValueError:
    """The one-line error of an update whose rows share seq ids (``where``: 'step S update U')."""
    return ValueError(
        f"seq_ids: {where} gives seq id{'s' * (len(dup) > 1)} {_few(dup)} to more than one row; "
        "each row of an update is one sequence: pass ids unique within the update (its tokens "
        "would join twice, and another sequence's none)"
    )


def _refuse_duplicates(where: str, seq_ids: torch.Tensor, mask: torch.Tensor) -> None:
    """A CPU update's check (:func:`duplicate_rows`); distinct ids, the common case, cost one set of B ints."""
    ids = seq_ids.tolist()
    if len(set(ids)) == len(ids):
        return
    dup = duplicate_rows(np.asarray(ids), mask.bool().any(dim=1).numpy())
    if len(dup):
        raise duplicates_error(where, dup)


def _few(ids: Sequence[int] | np.ndarray, k: int = 5) -> str:
    """'3, 7, 9' or '3, 7, 9, 12, 15, ... (8 in all)'."""
    ids = [int(i) for i in ids]
    return ", ".join(map(str, ids[:k])) + (f", ... ({len(ids)} in all)" if len(ids) > k else "")


def _host_arg(name: str, x: Vector, dtype: type[np.generic]) -> np.ndarray:
    """:func:`_host`, with a one-line error naming the argument when ``x`` is not numbers."""
    try:
        return _host(x, dtype)
    except (TypeError, ValueError) as e:
        raise ValueError(
            f"record_sequences: {name} must be [B] numbers (a tensor, array or list), got {type(x).__name__}: {e}"
        ) from None


def _host(x: Vector, dtype: type[np.generic]) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().numpy()
    return np.asarray(x).astype(dtype, copy=False)
