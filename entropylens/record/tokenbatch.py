"""Per-update device work of the recorder, as pure tensor functions (no I/O):

- :func:`derive_columns`: the token columns (ratio, quadrant, clip, ...) from the raw tensors, or
  taken as they are from a ``policy_loss`` output;
- :func:`step_aggregates`: exact aggregates over ALL masked-in tokens of the update;
- :func:`sample_keep`: the deterministic sequence sample, a hash of (run, seq id);
- :func:`pack` / :func:`unpack`: every column, the aggregates and the input finite flags in ONE
  int32 tensor of fixed size (no data-dependent shape, so no sync), so the device -> host transfer
  is a single copy per update; rows are selected on the host (:meth:`HostUpdate.rows`).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from functools import cached_property
from typing import NamedTuple

import numpy as np
import torch

from ..rl import stats
from ..rl.aggregates import AGG_NAMES, step_aggregates


# Float token columns shipped to the host, in pack order (float32).
# (prob, ratio and entropy_ratio are derived from these by the views and never leave the device)
FLOAT_COLS = ("logprob", "old_logprob", "advantage", "entropy", "old_entropy", "grad_coef", "logit_grad_norm",
              "entropy_effect", "entropy_effect_dropped", "is_weight")
# flags word per token: quadrant (3 bits) | clip + 1 (2 bits) << 3 | clipped << 5 | erc_kept << 6
# | selected (masked in and sampled) << 7 | masked in << 8 | dual_clipped << 9 | token_kept << 10 | seq_kept << 11
_Q_BITS, _CLIP_SHIFT, _CLIPPED_SHIFT, _ERC_SHIFT, _SELECTED_SHIFT, _MASK_SHIFT = 0b111, 3, 5, 6, 7, 8
# the optional bool token columns (null where the loss has no such modifier) and their bit in the flags word
BOOL_SHIFTS: dict[str, int] = {"erc_kept": _ERC_SHIFT, "dual_clipped": 9, "token_kept": 10, "seq_kept": 11}

def derive_columns(
    *,
    mask: torch.Tensor,
    advantages: torch.Tensor,
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    entropy: torch.Tensor | None,
    old_entropy: torch.Tensor | None,
    loss_columns: dict[str, torch.Tensor] | None,
    eps_low: float,
    eps_high: float,
    tau: float,
    sensitivity: torch.Tensor | None = None,
    temperature: float = 1.0,
) -> dict[str, torch.Tensor]:
    """All token columns as [B, T] detached tensors. Columns the loss computed are used as they are
    (the recorder never re-derives what the loss decided); the rest follow DESIGN.md's definitions.
    With ``sensitivity`` (stats.entropy_sensitivity, [B, T]): entropy_effect = grad_coef s / T^2 and,
    where the loss reports grad_changed, entropy_effect_dropped = (grad_coef_unclipped - grad_coef)
    s / T^2 on changed tokens (NaN, stored as null, elsewhere)."""
    cols: dict[str, torch.Tensor] = dict(loss_columns or {})
    shape = logprobs.shape
    if "advantage" not in cols:
        adv = advantages.detach().float()
        cols["advantage"] = adv.unsqueeze(1).expand(shape) if adv.dim() == 1 else adv
    if "logprob" not in cols:
        cols["logprob"] = logprobs.detach().float()
    if "old_logprob" not in cols:
        cols["old_logprob"] = old_logprobs.detach().float()
    if "prob" not in cols:
        cols["prob"] = torch.exp(cols["old_logprob"])
    if "ratio" not in cols:
        cols["ratio"] = torch.exp(cols["logprob"] - cols["old_logprob"])
    if "clip" not in cols:
        cols["clip"] = stats.clip_region(cols["ratio"], eps_low, eps_high)
    if "clipped" not in cols:
        cols["clipped"] = stats.clipped_mask(cols["clip"], cols["advantage"])
    if "quadrant" not in cols:
        cols["quadrant"] = stats.quadrant(cols["advantage"], cols["prob"], tau=tau)
    if entropy is not None and "entropy" not in cols:
        cols["entropy"] = entropy.detach().float()
    if old_entropy is not None and "old_entropy" not in cols:
        cols["old_entropy"] = old_entropy.detach().float()
    if "entropy" in cols and "old_entropy" in cols and "entropy_ratio" not in cols:
        cols["entropy_ratio"] = stats.entropy_ratio(cols["entropy"], cols["old_entropy"])
    if sensitivity is not None:
        add_attribution(cols, sensitivity.reshape(shape), temperature)
    return cols


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
            by_erc = stats.entropy_effect(cols["grad_coef_before_erc"] - cols["grad_coef"], sens,
                                          temperature=temperature)
            cols["_dropped_by_erc"] = torch.where(changed, by_erc, nan)


def entropy_bonus_rule(cols: dict[str, torch.Tensor], config: dict | None) -> None:
    """The attribution's entropy-bonus rule (schema: tokens.entropy_effect), keyed on the loss config:
    a loss with an entropy bonus (``config['entropy_coef']`` != 0) reaches the logits through H as
    well, so grad_coef s / T^2 leaves out part of the entropy change. Unless ``cols`` carries that
    part (the loss column ``entropy_effect_bonus`` [B, T]: -dLoss/dH_t * sum_j p_j^2 (log p_j + H)^2
    / T^2, as integrations.torch.policy_update measures it), a NaN one is added (one value broadcast,
    no [B, T] allocation): entropy_effect and its budget sums are then null, never the policy term
    alone. entropy_effect_dropped is unaffected (the bonus is in both gradients and cancels)."""
    if (config or {}).get("entropy_coef") and "entropy_effect_bonus" not in cols and "grad_coef" in cols:
        g = cols["grad_coef"]
        cols["entropy_effect_bonus"] = torch.full((), float("nan"), device=g.device).expand(g.shape)


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


@dataclass(frozen=True)
class Layout:
    """Where each part of a packed update block sits (in int32 words, in this order):
    aggregates (float64) | finite flags (float64, one per checked input) | float columns (float32,
    [n_float, B*T]) | token ids (int32 [B*T], if given) | flags (int32 [B*T]) | seq ids | group ids ([B])."""

    batch: int
    length: int
    float_names: tuple[str, ...]
    finite_names: tuple[str, ...]
    bool_names: tuple[str, ...]  # the optional bool columns in the flags word (BOOL_SHIFTS), the rest null
    has_tokens: bool
    has_loss: bool = True  # the update came with a loss value (without: its steps row's loss is null)

    @property
    def has_erc(self) -> bool:
        return "erc_kept" in self.bool_names

    def parts(self) -> list[tuple[str, int]]:
        n = self.batch * self.length
        return [
            ("aggregates", 2 * len(AGG_NAMES)),
            ("finite", 2 * len(self.finite_names)),
            ("floats", len(self.float_names) * n),
            ("token_id", n if self.has_tokens else 0),
            ("flags", n),
            ("seq", self.batch),
            ("group", self.batch),
        ]

    @property
    def size(self) -> int:
        return sum(k for _, k in self.parts())


@dataclass
class HostUpdate:
    """A packed block on the host, split back into its parts (numpy views, no copies). The
    per-token columns are decoded from the flags word when first read (the writer thread selects
    a step's rows for all its updates at once, :func:`rows_of`, and never needs them per update)."""

    aggregates: dict[str, float]
    finite: dict[str, bool]
    floats: np.ndarray  # [n_float, B*T] float32, layout.float_names
    token_id: np.ndarray | None  # [B*T] int32 (None: no token ids)
    flags: np.ndarray  # [B*T] int32: the packed flags word of every position
    seq: np.ndarray  # [B] int32
    group: np.ndarray  # [B] int32
    layout: Layout

    @cached_property
    def columns(self) -> dict[str, np.ndarray]:
        """Every position of [B, T], flattened to [B*T]: the float columns, token ids, the flags' columns."""
        cols: dict[str, np.ndarray] = {c: self.floats[i] for i, c in enumerate(self.layout.float_names)}
        if self.token_id is not None:
            cols["token_id"] = self.token_id
        cols.update(_flag_columns(self.flags, self.layout.bool_names))
        return cols

    @cached_property
    def selected(self) -> np.ndarray:
        """[B*T] bool: masked in and sampled."""
        return ((self.flags >> _SELECTED_SHIFT) & 1).astype(bool)

    @cached_property
    def masked(self) -> np.ndarray:
        """[B*T] bool: masked in (a response token)."""
        return ((self.flags >> _MASK_SHIFT) & 1).astype(bool)

    @property
    def n_selected(self) -> int:
        """How many rows :meth:`rows` gives."""
        return int(np.count_nonzero(self.flags & (1 << _SELECTED_SHIFT)))

    def entropy_ratios(self) -> np.ndarray | None:
        """rho = (H + 1e-8) / (H_old + 1e-8) of every masked-in token (float32, as on the device)."""
        names = self.layout.float_names
        if "entropy" not in names or "old_entropy" not in names:
            return None
        h, h_old = self.floats[names.index("entropy")][self.masked], self.floats[names.index("old_entropy")][self.masked]
        return (h + np.float32(1e-8)) / (h_old + np.float32(1e-8))

    def importance_ratios(self) -> tuple[np.ndarray, np.ndarray]:
        """(r, quadrant) of every masked-in token: r = exp(logprob - old_logprob) (float32, as the tokens
        view derives it) and the quadrant code (int8, schema.QUADRANT_NAMES)."""
        names, m = self.layout.float_names, self.masked
        with np.errstate(over="ignore"):  # a ratio past float32's range is inf (the overflow bin), never a warning
            r = np.exp(self.floats[names.index("logprob")][m] - self.floats[names.index("old_logprob")][m])
        return r, (self.flags[m] & _Q_BITS).astype(np.int8)

    def rows_at(self, idx: np.ndarray) -> dict[str, np.ndarray]:
        """The rows at flat positions ``idx`` of [B*T]: the columns of :meth:`rows`, for those positions only
        (the flags decoded there alone)."""
        b_idx, pos = np.divmod(idx, self.layout.length)
        out = {c: self.floats[i][idx] for i, c in enumerate(self.layout.float_names)}
        out["token_id"] = self.token_id[idx] if self.token_id is not None else np.full(len(idx), -1, np.int32)
        out.update(_flag_columns(self.flags[idx], self.layout.bool_names))
        out["seq"], out["group"], out["pos"] = self.seq[b_idx], self.group[b_idx], pos.astype(np.int32)
        return out

    def rows(self) -> dict[str, np.ndarray]:
        """The selected token rows (the compaction, done on the host: one np.flatnonzero)."""
        idx = np.flatnonzero(self.selected)
        b_idx, pos = np.divmod(idx, self.layout.length)
        out = {name: col[idx] for name, col in self.columns.items()}
        out["seq"] = self.seq[b_idx]
        out["group"] = self.group[b_idx]
        out["pos"] = pos.astype(np.int32)
        if "token_id" not in out:
            out["token_id"] = np.full(len(idx), -1, np.int32)
        return out


def _flag_columns(flags: np.ndarray, bool_names: tuple[str, ...]) -> dict[str, np.ndarray]:
    """quadrant, clip, clipped (and the optional bool columns ``bool_names``: erc_kept, dual_clipped,
    token_kept, seq_kept) from flags words (any shape)."""
    cols = {
        "quadrant": (flags & _Q_BITS).astype(np.int8),
        "clip": (((flags >> _CLIP_SHIFT) & 0b11) - 1).astype(np.int8),
        "clipped": ((flags >> _CLIPPED_SHIFT) & 1).astype(bool),
    }
    for name in bool_names:
        cols[name] = ((flags >> BOOL_SHIFTS[name]) & 1).astype(bool)
    return cols


def rows_of(hosts: "list[HostUpdate]", updates: "list[int]") -> dict[str, np.ndarray]:
    """The selected token rows of several updates, in order, with an int16 ``update`` column: equal,
    column for column, to concatenating each one's :meth:`HostUpdate.rows` (plus its update). Updates of
    one layout (a step's mini-batches) are selected together: one np.flatnonzero and one gather per
    column over the stacked blocks, instead of one set per update; the flag columns are decoded
    for the selected rows only."""
    layout = hosts[0].layout
    if len(hosts) == 1 or any(h.layout != layout for h in hosts[1:]):
        parts = []
        for h, u in zip(hosts, updates):
            r = h.rows()
            r["update"] = np.full(len(r["seq"]), u, np.int16)
            parts.append(r)
        return parts[0] if len(parts) == 1 else {k: np.concatenate([r[k] for r in parts]) for k in parts[0]}
    n = layout.batch * layout.length
    flags = np.stack([h.flags for h in hosts]).reshape(-1)  # [U*n]
    idx = np.flatnonzero(flags & (1 << _SELECTED_SHIFT))  # update-major, then position: the rows' order
    u_idx, at = np.divmod(idx, n)
    b_idx, pos = np.divmod(at, layout.length)
    floats = np.stack([h.floats for h in hosts], axis=1).reshape(len(layout.float_names), len(hosts) * n)
    picked = floats[:, idx]  # [n_float, k]
    out: dict[str, np.ndarray] = {c: picked[i] for i, c in enumerate(layout.float_names)}
    if layout.has_tokens:
        out["token_id"] = np.stack([h.token_id for h in hosts]).reshape(-1)[idx]
    out.update(_flag_columns(flags[idx], layout.bool_names))
    out["seq"] = np.stack([h.seq for h in hosts])[u_idx, b_idx]
    out["group"] = np.stack([h.group for h in hosts])[u_idx, b_idx]
    out["pos"] = pos.astype(np.int32)
    if not layout.has_tokens:
        out["token_id"] = np.full(len(idx), -1, np.int32)
    out["update"] = np.asarray(updates, np.int16)[u_idx]
    return out


class FiniteFlags(NamedTuple):
    """The input NaN/Inf check of an update: one flag per checked input, all masked-in values finite."""

    names: tuple[str, ...]
    flags: torch.Tensor  # [k] bool, on the device


def pack(
    cols: dict[str, torch.Tensor],
    selected: torch.Tensor,
    aggregates: torch.Tensor,
    finite: "dict[str, torch.Tensor] | FiniteFlags",
    seq: torch.Tensor,
    group: torch.Tensor,
    tokens: torch.Tensor | None,
    mask: torch.Tensor | None = None,
    has_loss: bool = True,
) -> tuple[torch.Tensor, Layout]:
    """Everything of one update in ONE flat int32 device tensor (see :class:`Layout`), with no
    data-dependent size: rows are selected on the host (:meth:`HostUpdate.rows`), so packing never
    synchronises. cols [B, T] each; selected [B, T] bool; aggregates [len(AGG_NAMES)]; finite: name -> 0-dim
    bool; seq, group [B]; tokens [B, T] or None; mask [B, T] bool (None: the selected tokens).
    A stack of U updates (every argument with a leading [U] dimension, finite flags [U, k]) gives
    [U, layout.size]: row u is update u's block."""
    if mask is None:
        mask = selected
    lead, (b, t) = tuple(selected.shape[:-2]), tuple(selected.shape[-2:])
    fnames = tuple(c for c in FLOAT_COLS if c in cols)
    if not isinstance(finite, FiniteFlags):  # name -> 0-dim bool
        finite = FiniteFlags(tuple(finite), torch.stack(list(finite.values())) if finite else None)
    bools = tuple(c for c in BOOL_SHIFTS if c in cols)
    layout = Layout(b, t, fnames, finite.names, bools, tokens is not None, has_loss)
    flags = cols["quadrant"].to(torch.int32) & _Q_BITS  # [..., B, T]
    flags = flags | ((cols["clip"].to(torch.int32) + 1) << _CLIP_SHIFT)
    flags = flags | (cols["clipped"].to(torch.int32) << _CLIPPED_SHIFT)
    for name in bools:
        flags = flags | (cols[name].bool().to(torch.int32) << BOOL_SHIFTS[name])
    flags = flags | (selected.to(torch.int32) << _SELECTED_SHIFT)
    if mask is not None:
        flags = flags | (mask.to(torch.int32) << _MASK_SHIFT)
    head = aggregates.double().reshape(*lead, -1)
    if finite.names:
        head = torch.cat([head, finite.flags.double().reshape(*lead, -1)], -1)
    parts = [head.view(torch.int32)]
    if fnames:
        floats = torch.stack([cols[c].float().reshape(*lead, -1) for c in fnames], -2)  # [..., n_float, B*T]
        parts.append(floats.view(torch.int32).reshape(*lead, -1))
    if tokens is not None:
        parts.append(tokens.to(torch.int32).reshape(*lead, -1))
    parts += [flags.reshape(*lead, -1), seq.to(torch.int32).reshape(*lead, -1),
              group.to(torch.int32).reshape(*lead, -1)]
    return torch.cat(parts, -1), layout


def update_block(
    cols: dict[str, torch.Tensor],
    mask: torch.Tensor,
    loss_value: torch.Tensor | None,
    finite: "dict[str, torch.Tensor] | FiniteFlags",
    seq: torch.Tensor,
    group: torch.Tensor,
    tokens: torch.Tensor | None,
    salt: int,
    sample: float,
    sensitivity: torch.Tensor | None = None,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, Layout]:
    """The whole device work of one update: the entropy attribution columns (:func:`add_attribution`,
    with ``sensitivity`` [B, T]), the sequence sample (:func:`sample_keep`), the exact aggregates
    over all masked-in tokens (:func:`step_aggregates`, with cols' logit_grad_norm) and the packed
    block (:func:`pack`). cols [B, T] each (as :func:`derive_columns` returns them; ``cols`` gains
    the attribution columns); mask [B, T] bool; seq, group [B]. A stack of U updates of one shape
    (cols, mask, tokens, sensitivity [U, B, T]; seq, group [U, B]; loss_value [U]; finite flags
    [U, k]) gives [U, layout.size], row u equal to update u's own block."""
    if sensitivity is not None:
        add_attribution(cols, sensitivity, temperature)
    keep = sample_keep(seq, salt, sample)  # [B]
    aggregates = step_aggregates(cols, mask, cols.get("logit_grad_norm"), loss_value)
    return pack(cols, mask & keep.unsqueeze(-1), aggregates, finite, seq, group, tokens, mask,
                has_loss=loss_value is not None)


# The recorder's checked inputs (all masked-in values finite) -> the column that holds each
CHECKED_COLUMNS = {"logprobs": "logprob", "old_logprobs": "old_logprob", "advantages": "advantage",
                   "entropy": "entropy", "old_entropy": "old_entropy"}

# Columns :func:`update_block` reads: the float ones (FLOAT_COLS, ratio and entropy_ratio for the
# aggregates; grad_coef_unclipped, grad_coef_before_erc and entropy_effect_bonus for the attribution) and
# the small integer ones (quadrant, clip and the bool columns).
_SNAPSHOT_FLOATS = FLOAT_COLS + ("ratio", "entropy_ratio", "grad_coef_unclipped", "grad_coef_before_erc",
                                  "entropy_effect_bonus")
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
    finite: "dict[str, torch.Tensor] | FiniteFlags"  # flags [k] ([U, k] stacked)
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
        return update_block(cols, ints["mask"].bool(), self.loss_value, self.finite, seq, group, ints.get("tokens"),
                            salt, sample, sensitivity, self.temperature)

    def signature(self) -> tuple:
        """Snapshots with equal signatures can be stacked (:func:`stack_snapshots`)."""
        finite = self.finite.names if isinstance(self.finite, FiniteFlags) else tuple(self.finite)
        return (self.float_names, tuple(self.floats.shape), self.floats.dtype, self.int_names,
                tuple(self.ints.shape), self.ints.dtype, self.loss_value is None, finite, self.temperature)


def stack_snapshots(snaps: "list[Snapshot]") -> Snapshot:
    """One snapshot of U same-shaped updates (equal :meth:`Snapshot.signature`): every tensor
    gains a leading [U] dimension. Its block's row u equals ``snaps[u].block()`` word for word
    (every op of :func:`update_block` treats the updates apart)."""
    first = snaps[0]
    finites = [s.finite if isinstance(s.finite, FiniteFlags) else
               FiniteFlags(tuple(s.finite), torch.stack(list(s.finite.values())) if s.finite else None)
               for s in snaps]
    names = finites[0].names
    flags = torch.stack([f.flags for f in finites]) if names else None  # [U, k]
    loss = torch.stack([s.loss_value for s in snaps]) if first.loss_value is not None else None  # [U]
    return Snapshot(torch.stack([s.floats for s in snaps]), first.float_names, torch.stack([s.ints for s in snaps]),
                    first.int_names, torch.stack([s.ids for s in snaps]), loss, FiniteFlags(names, flags),
                    first.temperature)


def snapshot(
    cols: dict[str, torch.Tensor],
    mask: torch.Tensor,
    loss_value: torch.Tensor | None,
    finite: "dict[str, torch.Tensor] | FiniteFlags",
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
        rows = floats[idx[0]: idx[-1] + 1] if consecutive else floats[idx]  # [k, B, T]
        # a float64 sum of float32 values never overflows: it is NaN or +-inf iff a masked-in value is
        sums = torch.where(mask, rows, 0.0).sum(dim=(1, 2), dtype=torch.float64)  # [k]
        finite = FiniteFlags(finite.names, (sums - sums) == 0)  # [k]: x - x is 0 iff x is finite
    inames = tuple(c for c in _SNAPSHOT_INTS if c in cols) + ("mask",) + (("tokens",) if tokens is not None else ())
    parts = [_plain(cols[c], b, t) for c in inames[:-2 if tokens is not None else -1]]
    parts += [mask] + ([_plain(tokens, b, t)] if tokens is not None else [])
    ints = torch.stack(parts)  # [n_int, B, T], promoted to the widest integer type
    loss = loss_value.detach() if loss_value is not None else None
    ids = torch.stack([seq if seq.dtype == torch.int64 else seq.long(),
                       group if group.dtype == torch.int64 else group.long()])  # [2, B]
    return Snapshot(floats, fnames, ints, inames, ids, loss, finite, float(temperature))


def _plain(x: torch.Tensor, b: int, t: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x`` as [b, t] (and ``dtype``), without a call where it already is (the snapshot is per-op bound)."""
    if x.shape != (b, t):
        x = x.reshape(b, t)
    return x if dtype is None or x.dtype == dtype else x.to(dtype)


def read_finite(host: np.ndarray, layout: Layout) -> dict[str, bool]:
    """Only the input finite flags of a packed block (a few words at its front)."""
    off = 2 * len(AGG_NAMES)
    flags = host[off: off + 2 * len(layout.finite_names)].view(np.float64)
    return {name: bool(v) for name, v in zip(layout.finite_names, flags)}


def unpack(host: np.ndarray, layout: Layout) -> HostUpdate:
    """Inverse of :func:`pack` on the host (numpy views of ``host``, int32 [layout.size])."""
    if host.shape != (layout.size,):
        raise ValueError(f"packed block has {host.shape} words, its layout says {layout.size}")
    views: dict[str, np.ndarray] = {}
    off = 0
    for name, k in layout.parts():
        views[name] = host[off: off + k]
        off += k
    n = layout.batch * layout.length
    aggregates = dict(zip(AGG_NAMES, views["aggregates"].view(np.float64).tolist()))
    if not layout.has_loss:  # not given: null in the steps row; a given loss keeps its NaN / inf
        del aggregates["loss"]
    finite = read_finite(host, layout)
    floats = views["floats"].view(np.float32).reshape(len(layout.float_names), n)
    token_id = views["token_id"] if layout.has_tokens else None
    return HostUpdate(aggregates, finite, floats, token_id, views["flags"], views["seq"], views["group"], layout)
