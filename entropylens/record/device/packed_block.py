"""The packed block: every column of one update, its exact aggregates and its input finite flags in ONE
int32 tensor of fixed size (no data-dependent shape, so no sync), so the device -> host transfer is a
single copy per update. :class:`Layout` says where each part sits; :func:`pack` builds it on the
device, :func:`unpack` splits it back on the host (:class:`HostUpdate`), where the rows are selected
(:meth:`HostUpdate.rows`, :func:`rows_of`)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import NamedTuple, cast

import numpy as np
import torch

from ...rl.aggregates import AGG_NAMES

# Float token columns shipped to the host, in pack order (float32).
# (prob, ratio and entropy_ratio are derived from these by the views and never leave the device)
FLOAT_COLS = (
    "logprob",
    "old_logprob",
    "advantage",
    "entropy",
    "old_entropy",
    "grad_coef",
    "logit_grad_norm",
    "entropy_effect",
    "entropy_effect_dropped",
    "is_weight",
    "sapo_weight",
    "cov",
    "sampler_logprob",
)


# flags word per token: quadrant (3 bits) | clip + 1 (2 bits) << 3 | clipped << 5 | erc_kept << 6
# | selected (masked in and sampled) << 7 | masked in << 8 | dual_clipped << 9 | token_kept << 10 | seq_kept << 11
# | cov_clipped << 12 | kl_cov_penalised << 13 | is_masked << 14
_Q_BITS, _CLIP_SHIFT, _CLIPPED_SHIFT, _ERC_SHIFT, _SELECTED_SHIFT, _MASK_SHIFT = 0b111, 3, 5, 6, 7, 8


# the optional bool token columns (null where the loss has no such modifier) and their bit in the flags word
BOOL_SHIFTS: dict[str, int] = {
    "erc_kept": _ERC_SHIFT,
    "dual_clipped": 9,
    "token_kept": 10,
    "seq_kept": 11,
    "cov_clipped": 12,
    "kl_cov_penalised": 13,
    "is_masked": 14,
}


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
        h, h_old = (
            self.floats[names.index("entropy")][self.masked],
            self.floats[names.index("old_entropy")][self.masked],
        )
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


def rows_of(hosts: list[HostUpdate], updates: list[int]) -> dict[str, np.ndarray]:
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
        token_ids = cast("list[np.ndarray]", [h.token_id for h in hosts])  # unpack: set where layout.has_tokens
        out["token_id"] = np.stack(token_ids).reshape(-1)[idx]
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
    flags: torch.Tensor | None  # [k] bool, on the device; None: none checked, or a CPU update's (blocks.snapshot)


def pack(
    cols: dict[str, torch.Tensor],
    selected: torch.Tensor,
    aggregates: torch.Tensor,
    finite: dict[str, torch.Tensor] | FiniteFlags,
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
        assert finite.flags is not None  # computed by the time a block is packed (record_update, blocks.snapshot)
        head = torch.cat([head, finite.flags.double().reshape(*lead, -1)], -1)
    parts = [head.view(torch.int32)]
    if fnames:
        floats = torch.stack([cols[c].float().reshape(*lead, -1) for c in fnames], -2)  # [..., n_float, B*T]
        parts.append(floats.view(torch.int32).reshape(*lead, -1))
    if tokens is not None:
        parts.append(tokens.to(torch.int32).reshape(*lead, -1))
    parts += [
        flags.reshape(*lead, -1),
        seq.to(torch.int32).reshape(*lead, -1),
        group.to(torch.int32).reshape(*lead, -1),
    ]
    return torch.cat(parts, -1), layout


def read_finite(host: np.ndarray, layout: Layout) -> dict[str, bool]:
    """Only the input finite flags of a packed block (a few words at its front)."""
    off = 2 * len(AGG_NAMES)
    flags = host[off : off + 2 * len(layout.finite_names)].view(np.float64)
    return {name: bool(v) for name, v in zip(layout.finite_names, flags)}


def unpack(host: np.ndarray, layout: Layout) -> HostUpdate:
    """Inverse of :func:`pack` on the host (numpy views of ``host``, int32 [layout.size])."""
    if host.shape != (layout.size,):
        raise ValueError(f"packed block has {host.shape} words, its layout says {layout.size}")
    views: dict[str, np.ndarray] = {}
    off = 0
    for name, k in layout.parts():
        views[name] = host[off : off + k]
        off += k
    n = layout.batch * layout.length
    aggregates = dict(zip(AGG_NAMES, views["aggregates"].view(np.float64).tolist()))
    if not layout.has_loss:  # not given: null in the steps row; a given loss keeps its NaN / inf
        del aggregates["loss"]
    finite = read_finite(host, layout)
    floats = views["floats"].view(np.float32).reshape(len(layout.float_names), n)
    token_id = views["token_id"] if layout.has_tokens else None
    return HostUpdate(aggregates, finite, floats, token_id, views["flags"], views["seq"], views["group"], layout)
