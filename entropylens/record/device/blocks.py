"""Building an update's block: the entropy attribution columns, the deterministic sequence sample, the
exact aggregates over all masked-in tokens and the packed block (:func:`update_block`), on the
update's device; or later, on the writer thread, from a private :class:`Snapshot` of a CPU update."""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import cast

import torch

from ...rl import stats
from ...rl.aggregates import step_aggregates
from .packed_block import BOOL_SHIFTS, FLOAT_COLS, FiniteFlags, Layout, pack
from .token_columns import log_zero_as_inf


def run_hash(run: str) -> int:
    """A stable 31-bit integer for the run id (the salt of the sequence sample)."""
    return zlib.crc32(run.encode()) & 0x7FFFFFFF


def sample_keep(seq_ids: torch.Tensor, salt: int, sample: float) -> torch.Tensor:
    """Keep a sequence iff hash(salt, seq) < sample. Deterministic, on the device, [B] bool. Keyed on the
    run-unique seq id alone: a sequence trained at several steps (num_iterations > 1) is kept or
    dropped as a whole. The hash is a splitmix64-style integer mix (wrapping int64 arithmetic)."""
    if sample >= 1.0:
        return torch.ones(seq_ids.shape, dtype=torch.bool, device=seq_ids.device)
    x = seq_ids.long() * 0x9E3779B1 + ((salt * 0xC2B2AE3D) % 2**62)
    for mul, shift in ((0xBF58476D1CE4E5B9 - 2**64, 30), (0x94D049BB133111EB - 2**64, 27)):
        x = (x ^ ((x >> shift) & ((1 << (64 - shift)) - 1))) * mul
    u = ((x >> 40) & 0xFFFFFF).double() / float(1 << 24)  # 24 uniform bits in [0, 1)
    return u < sample


def add_attribution(cols: dict[str, torch.Tensor], sensitivity: torch.Tensor, temperature: float) -> None:
    """Adds entropy_effect = grad_coef s / T^2 (+ the loss column entropy_effect_bonus, an entropy
    bonus's own term, where given: :func:`entropy_bonus_rule`) and, where the loss reports grad_changed,
    entropy_effect_dropped = (grad_coef_unclipped - grad_coef) s / T^2 on changed tokens (NaN, stored as
    null, elsewhere) to ``cols`` (nothing without a grad_coef column). With ERC (erc_kept) and the
    loss's grad_coef_before_erc (g_e) also ERC's own share of it, (g_e - grad_coef) s / T^2 on the
    changed tokens (NaN where unchanged; nonzero where ERC dropped the token, or, at sequence level,
    a token of its sequence: the gradient runs through the sequence mean), as the internal
    column ``_dropped_by_erc`` (the budget splits by it; never stored). sensitivity [B, T]."""
    if "grad_coef" not in cols:
        return
    sens = sensitivity.detach().float()
    effect = stats.entropy_effect(cols["grad_coef"], sens, temperature=temperature)
    if "entropy_effect_bonus" in cols:
        effect = effect + cols["entropy_effect_bonus"].float()
    cols["entropy_effect"] = effect
    if "grad_coef_unclipped" in cols and "grad_changed" in cols:
        changed = cols["grad_changed"]
        lost = stats.entropy_effect(cols["grad_coef_unclipped"] - cols["grad_coef"], sens, temperature=temperature)
        nan = torch.full_like(lost, float("nan"))
        cols["entropy_effect_dropped"] = torch.where(changed, lost, nan)
        if "erc_kept" in cols and "grad_coef_before_erc" in cols:
            by_erc = stats.entropy_effect(
                cols["grad_coef_before_erc"] - cols["grad_coef"], sens, temperature=temperature
            )
            cols["_dropped_by_erc"] = torch.where(changed, by_erc, nan)


def update_block(
    cols: dict[str, torch.Tensor],
    mask: torch.Tensor,
    loss_value: torch.Tensor | None,
    finite: dict[str, torch.Tensor] | FiniteFlags,
    seq: torch.Tensor,
    group: torch.Tensor,
    tokens: torch.Tensor | None,
    salt: int,
    sample: float,
    sensitivity: torch.Tensor | None = None,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, Layout]:
    """The whole device work of one update: the logprob / old_logprob columns with -inf for a token of
    probability 0 (token_columns.log_zero_as_inf), the entropy attribution columns (:func:`add_attribution`,
    with ``sensitivity`` [B, T]), the sequence sample (:func:`sample_keep`), the exact aggregates
    over all masked-in tokens (:func:`step_aggregates`, with cols' logit_grad_norm) and the packed
    block (:func:`pack`). cols [B, T] each (as :func:`derive_columns` returns them; ``cols`` gains
    the attribution columns); mask [B, T] bool; seq, group [B]. A stack of U updates of one shape
    (cols, mask, tokens, sensitivity [U, B, T]; seq, group [U, B]; loss_value [U]; finite flags
    [U, k]) gives [U, layout.size], row u equal to update u's own block."""
    for name in ("logprob", "old_logprob"):  # stats' floor of a -inf logit is -inf (a probability 0), never stored
        cols[name] = log_zero_as_inf(cols[name])
    if sensitivity is not None:
        add_attribution(cols, sensitivity, temperature)
    keep = sample_keep(seq, salt, sample)  # [B]
    aggregates = step_aggregates(cols, mask, cols.get("logit_grad_norm"), loss_value)
    return pack(
        cols, mask & keep.unsqueeze(-1), aggregates, finite, seq, group, tokens, mask, has_loss=loss_value is not None
    )


# The recorder's checked inputs (all masked-in values finite) -> the column that holds each
CHECKED_COLUMNS = {
    "logprobs": "logprob",
    "old_logprobs": "old_logprob",
    "advantages": "advantage",
    "entropy": "entropy",
    "old_entropy": "old_entropy",
}
# checked inputs where -inf is a value, not an error: the log-prob of a token of probability 0 (counted in
# n_nonfinite_ratio, token_columns.log_zero_as_inf); NaN and +inf there are refused as in the others
LOG_PROB_INPUTS = ("logprobs", "old_logprobs")


# Columns :func:`update_block` reads: the float ones (FLOAT_COLS, ratio and entropy_ratio for the
# aggregates; grad_coef_unclipped, grad_coef_before_erc and entropy_effect_bonus for the attribution) and
# the small integer ones (quadrant, clip and the bool columns).
_SNAPSHOT_FLOATS = FLOAT_COLS + (
    "ratio",
    "entropy_ratio",
    "grad_coef_unclipped",
    "grad_coef_before_erc",
    "entropy_effect_bonus",
)


_SNAPSHOT_BOOLS = ("clipped", *BOOL_SHIFTS, "grad_changed")


_SNAPSHOT_INTS = ("quadrant", "clip", *_SNAPSHOT_BOOLS)


@dataclass
class Snapshot:
    """Private copies of everything :func:`update_block` reads, in three stacked tensors, so that the
    work can run later on another thread (CPU tensors: the host is the device) whatever the caller
    does to its tensors afterwards. :meth:`block` runs the work; its values equal
    ``update_block`` on the original tensors (the same ops on equal values). :func:`stack_snapshots`
    joins the snapshots of several same-shaped updates into one (a leading [U] dimension on every
    tensor), whose :meth:`block` does all of them with one set of ops."""

    floats: torch.Tensor  # [n_float, B, T] float32 ([U, n_float, B, T] stacked)
    float_names: tuple[str, ...]
    ints: torch.Tensor  # [n_int, B, T]: quadrant, clip, clipped, (erc_kept), mask, (tokens) ([U, ...] stacked)
    int_names: tuple[str, ...]
    ids: torch.Tensor  # [2, B] int64: seq, group ([U, 2, B] stacked)
    loss_value: torch.Tensor | None  # 0-dim ([U] stacked)
    finite: dict[str, torch.Tensor] | FiniteFlags  # flags [k] ([U, k] stacked)
    temperature: float = 1.0

    def block(self, salt: int, sample: float) -> tuple[torch.Tensor, Layout]:
        """The packed block [layout.size] (a stacked snapshot: [U, layout.size], row u update u's)."""
        cols: dict[str, torch.Tensor] = dict(zip(self.float_names, self.floats.unbind(-3)))
        sensitivity = cols.pop("sensitivity", None)
        ints = dict(zip(self.int_names, self.ints.unbind(-3)))
        for name in ("quadrant", "clip"):
            cols[name] = ints[name]
        for name in _SNAPSHOT_BOOLS:
            if name in ints:
                cols[name] = ints[name].bool()
        seq, group = self.ids.unbind(-2)
        return update_block(
            cols,
            ints["mask"].bool(),
            self.loss_value,
            self.finite,
            seq,
            group,
            ints.get("tokens"),
            salt,
            sample,
            sensitivity,
            self.temperature,
        )

    def signature(self) -> tuple:
        """Snapshots with equal signatures can be stacked (:func:`stack_snapshots`)."""
        finite = self.finite.names if isinstance(self.finite, FiniteFlags) else tuple(self.finite)
        return (
            self.float_names,
            tuple(self.floats.shape),
            self.floats.dtype,
            self.int_names,
            tuple(self.ints.shape),
            self.ints.dtype,
            self.loss_value is None,
            finite,
            self.temperature,
        )


def stack_snapshots(snaps: list[Snapshot]) -> Snapshot:
    """One snapshot of U same-shaped updates (equal :meth:`Snapshot.signature`): every tensor
    gains a leading [U] dimension. Its block's row u equals ``snaps[u].block()`` word for word
    (every op of :func:`update_block` treats the updates apart)."""
    first = snaps[0]
    finites = [
        s.finite
        if isinstance(s.finite, FiniteFlags)
        else FiniteFlags(tuple(s.finite), torch.stack(list(s.finite.values())) if s.finite else None)
        for s in snaps
    ]
    names = finites[0].names
    # equal signatures: every snapshot has flags where the first names checked inputs (snapshot() computes
    # them), and a loss where the first has one
    all_flags, all_losses = [f.flags for f in finites], [s.loss_value for s in snaps]
    flags = torch.stack(cast("list[torch.Tensor]", all_flags)) if names else None  # [U, k]
    loss = torch.stack(cast("list[torch.Tensor]", all_losses)) if first.loss_value is not None else None  # [U]
    return Snapshot(
        torch.stack([s.floats for s in snaps]),
        first.float_names,
        torch.stack([s.ints for s in snaps]),
        first.int_names,
        torch.stack([s.ids for s in snaps]),
        loss,
        FiniteFlags(names, flags),
        first.temperature,
    )


def snapshot(
    cols: dict[str, torch.Tensor],
    mask: torch.Tensor,
    loss_value: torch.Tensor | None,
    finite: dict[str, torch.Tensor] | FiniteFlags,
    seq: torch.Tensor,
    group: torch.Tensor,
    tokens: torch.Tensor | None,
    sensitivity: torch.Tensor | None = None,
    temperature: float = 1.0,
) -> Snapshot:
    """Three copies (one stack each) of what :func:`update_block` reads. Arguments as there; finite
    flags of None (``FiniteFlags(names, None)``) are computed here from the copies of the checked
    inputs' columns (CHECKED_COLUMNS): all masked-in values finite, as the recorder's check."""
    b, t = mask.shape
    fnames = tuple(c for c in _SNAPSHOT_FLOATS if c in cols)
    parts = [_plain(cols[c], b, t, torch.float32) for c in fnames]
    if sensitivity is not None:
        fnames += ("sensitivity",)
        parts.append(_plain(sensitivity.detach(), b, t, torch.float32))
    floats = torch.stack(parts)  # [n_float, B, T]
    if isinstance(finite, FiniteFlags) and finite.flags is None and finite.names:
        idx = [fnames.index(CHECKED_COLUMNS[name]) for name in finite.names]
        consecutive = idx == list(range(idx[0], idx[0] + len(idx)))
        rows = floats[idx[0] : idx[-1] + 1] if consecutive else floats[idx]  # [k, B, T]
        # a float64 sum of float32 values never overflows: it is NaN or +-inf iff a masked-in value is, and
        # -inf iff one is -inf and none NaN or +inf (a log-prob's -inf is accepted: LOG_PROB_INPUTS)
        sums = torch.where(mask, rows, 0.0).sum(dim=(1, 2), dtype=torch.float64)  # [k]
        log_zero = torch.tensor([name in LOG_PROB_INPUTS for name in finite.names]) & (sums == float("-inf"))
        finite = FiniteFlags(finite.names, ((sums - sums) == 0) | log_zero)  # [k]: x - x is 0 iff x is finite
    inames = tuple(c for c in _SNAPSHOT_INTS if c in cols) + ("mask",) + (("tokens",) if tokens is not None else ())
    parts = [_plain(cols[c], b, t) for c in inames[: -2 if tokens is not None else -1]]
    parts += [mask] + ([_plain(tokens, b, t)] if tokens is not None else [])
    ints = torch.stack(parts)  # [n_int, B, T], promoted to the widest integer type
    loss = loss_value.detach() if loss_value is not None else None
    ids = torch.stack(
        [seq if seq.dtype == torch.int64 else seq.long(), group if group.dtype == torch.int64 else group.long()]
    )  # [2, B]
    return Snapshot(floats, fnames, ints, inames, ids, loss, finite, float(temperature))


def _plain(x: torch.Tensor, b: int, t: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x`` as [b, t] (and ``dtype``), without a call where it already is (the snapshot is per-op bound)."""
    if x.shape != (b, t):
        x = x.reshape(b, t)
    return x if dtype is None or x.dtype == dtype else x.to(dtype)
