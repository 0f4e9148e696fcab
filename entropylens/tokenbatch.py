"""Per-update device work of the recorder, as pure tensor functions (no I/O):

- :func:`derive_columns`: the token columns (ratio, quadrant, clip, ...) from the raw tensors, or
  taken as they are from a ``policy_loss`` output;
- :func:`step_aggregates`: exact aggregates over ALL masked-in tokens of the update;
- :func:`sample_keep`: the deterministic sequence sample, a hash of (run, step, seq id);
- :func:`pack` / :func:`unpack`: every selected row and every aggregate in ONE int32 tensor, so the
  device -> host transfer is a single copy per update.
"""

from __future__ import annotations

import zlib

import numpy as np
import torch

from . import stats
from .schema import CLIP_NONE, QUADRANT_NAMES, QUADRANTS, ZA, quadrant_slug

# Float token columns shipped to the host, in pack order (float32).
# (prob, ratio and entropy_ratio are derived from these by the views and never leave the device)
FLOAT_COLS = ("logprob", "old_logprob", "advantage", "entropy", "old_entropy", "grad_coef", "logit_grad_norm")
INT_COLS = ("seq", "group", "pos", "token_id")  # int32
# quadrant (3 bits) | clip + 1 (2 bits) << 3 | clipped << 5 | erc_kept << 6
_Q_BITS, _CLIP_SHIFT, _CLIPPED_SHIFT, _ERC_SHIFT = 0b111, 3, 5, 6

AGG_NAMES: tuple[str, ...] = (
    "n_tokens", "entropy_mean", "old_entropy_mean", "ratio_mean",
    "clip_low_frac", "clip_high_frac", "clipped_frac", "region_low_frac", "region_high_frac",
    *(f"n_{quadrant_slug(q)}" for q in (*QUADRANTS, "ZA")),
    *(f"clip_frac_{quadrant_slug(q)}" for q in QUADRANTS),
    *(f"lgn_mean_{quadrant_slug(q)}" for q in QUADRANTS),
    "entropy_ratio_p05", "entropy_ratio_p50", "entropy_ratio_p95",
    "erc_drop_frac", "kl_k3", "loss",
)


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
) -> dict[str, torch.Tensor]:
    """All token columns as [B, T] detached tensors. Columns the loss computed are used as they are
    (the recorder never re-derives what the loss decided); the rest follow DESIGN.md's definitions."""
    cols: dict[str, torch.Tensor] = dict(loss_columns or {})
    shape = logprobs.shape
    adv = advantages.detach().float()
    if adv.dim() == 1:
        adv = adv.unsqueeze(1).expand(shape)
    if "advantage" not in cols:
        cols["advantage"] = adv
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
    return cols


def masked_quantiles(x: torch.Tensor, mask: torch.Tensor, qs: tuple[float, ...]) -> torch.Tensor:
    """Linear-interpolated quantiles (as torch.quantile) of x[mask], without a host sync.
    NaN when the mask is empty. Returns [len(qs)] float32."""
    flat = torch.where(mask, x.float(), torch.full_like(x, float("inf"), dtype=torch.float32)).reshape(-1)
    srt, _ = torch.sort(flat)  # masked-out values sort to the end
    n = mask.sum()
    q = torch.tensor(qs, dtype=torch.float64, device=x.device)
    pos = q * (n - 1).clamp(min=0).double()  # [Q]
    lo = pos.floor().long()
    hi = pos.ceil().long()
    frac = (pos - lo.double()).float()
    lo_v, hi_v = srt[lo], srt[hi]
    out = lo_v + (hi_v - lo_v) * frac
    out = torch.where(frac == 0, lo_v, out)  # inf - inf guard when lo == hi
    return torch.where(n > 0, out, torch.full_like(out, float("nan")))


def step_aggregates(
    cols: dict[str, torch.Tensor], mask: torch.Tensor, lgn: torch.Tensor | None, loss_value: torch.Tensor | None
) -> torch.Tensor:
    """Exact aggregates over all masked-in tokens, float64 [len(AGG_NAMES)], on the device.
    Fractions are of all tokens of the update; clip_frac_<q> is of the tokens of quadrant q;
    lgn_mean_<q> the mean logit-gradient norm of quadrant q (NaN without watch_logits).

    One matmul does the sums: rows of per-token values [K, N] times the masked one-hot quadrant
    matrix [N, 5] gives every value summed per quadrant; row totals give the overall sums."""
    dev = mask.device
    m = mask.reshape(-1)
    clip, clipped = cols["clip"].reshape(-1), cols["clipped"].reshape(-1)
    nan = torch.tensor(float("nan"), dtype=torch.float64, device=dev)
    have_h, have_oh = "entropy" in cols, "old_entropy" in cols
    zeros = torch.zeros_like(m, dtype=torch.float32)
    rows = [
        torch.ones_like(m, dtype=torch.float32),
        cols["entropy"].reshape(-1).float() if have_h else zeros,
        cols["old_entropy"].reshape(-1).float() if have_oh else zeros,
        cols["ratio"].reshape(-1).float(),
        (clipped & (clip < CLIP_NONE)).float(),
        (clipped & (clip > CLIP_NONE)).float(),
        clipped.float(),
        (clip < CLIP_NONE).float(),
        (clip > CLIP_NONE).float(),
        (~cols["erc_kept"].reshape(-1)).float() if "erc_kept" in cols else zeros,
        stats.kl_k3(cols["logprob"], cols["old_logprob"]).reshape(-1),
        lgn.reshape(-1).float() if lgn is not None else zeros,
    ]
    vals = torch.nan_to_num(torch.stack(rows).double(), nan=0.0, posinf=0.0, neginf=0.0)  # [12, N]
    onehot = torch.nn.functional.one_hot(cols["quadrant"].reshape(-1).long(), len(QUADRANT_NAMES))
    onehot = onehot.double() * m.double().unsqueeze(1)  # [N, 5], masked
    per_q = vals @ onehot  # [12, 5]: sums per quadrant code
    tot = per_q.sum(dim=1)  # [12]
    n = tot[0]
    denom = n.clamp(min=1.0)
    codes = [k for k, v in QUADRANT_NAMES.items() if v in QUADRANTS]
    qn = per_q[0, codes].clamp(min=1.0)
    out = [
        n.unsqueeze(0),
        (tot[1:4] / denom) * torch.tensor([1.0 if have_h else float("nan"), 1.0 if have_oh else float("nan"), 1.0],
                                          dtype=torch.float64, device=dev),
        tot[4:9] / denom,
        per_q[0, [*codes, ZA]],
        per_q[6, codes] / qn,
        per_q[11, codes] / qn if lgn is not None else nan.repeat(len(codes)),
        masked_quantiles(cols["entropy_ratio"], mask, (0.05, 0.5, 0.95)).double()
        if "entropy_ratio" in cols else nan.repeat(3),
        (tot[9] / denom).unsqueeze(0) if "erc_kept" in cols else nan.unsqueeze(0),
        (tot[10] / denom).unsqueeze(0),
        loss_value.detach().double().reshape(1) if loss_value is not None else nan.unsqueeze(0),
    ]
    return torch.cat([o.to(dev) for o in out])


def step_metrics(
    cols: dict[str, torch.Tensor], mask: torch.Tensor, loss_value: torch.Tensor | None = None,
    lgn: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """:func:`step_aggregates` as a dict of 0-dim device tensors keyed by the steps column names,
    leaving out the ones whose inputs are absent (entropy, ERC, logit-gradient norms, loss)."""
    aggs = step_aggregates(cols, mask, lgn, loss_value)
    absent: set[str] = set()
    if "entropy" not in cols:
        absent.add("entropy_mean")
    if "old_entropy" not in cols:
        absent.add("old_entropy_mean")
    if "entropy_ratio" not in cols:
        absent.update(("entropy_ratio_p05", "entropy_ratio_p50", "entropy_ratio_p95"))
    if "erc_kept" not in cols:
        absent.add("erc_drop_frac")
    if lgn is None:
        absent.update(n for n in AGG_NAMES if n.startswith("lgn_mean_"))
    if loss_value is None:
        absent.add("loss")
    return {name: v for name, v in zip(AGG_NAMES, aggs.unbind(0)) if name not in absent}


def run_hash(run: str) -> int:
    """A stable 31-bit integer for the run id (the salt of the sequence sample)."""
    return zlib.crc32(run.encode()) & 0x7FFFFFFF


def sample_keep(seq_ids: torch.Tensor, step: int, salt: int, sample: float) -> torch.Tensor:
    """Keep a sequence iff hash(salt, step, seq) < sample. Deterministic, on the device, [B] bool.
    The hash is a splitmix64-style integer mix (wrapping int64 arithmetic)."""
    if sample >= 1.0:
        return torch.ones(seq_ids.shape, dtype=torch.bool, device=seq_ids.device)
    x = seq_ids.long() * 0x9E3779B1 + ((step * 0x85EBCA77 + salt * 0xC2B2AE3D) % 2**62)
    for mul, shift in ((0xBF58476D1CE4E5B9 - 2**64, 30), (0x94D049BB133111EB - 2**64, 27)):
        x = (x ^ ((x >> shift) & ((1 << (64 - shift)) - 1))) * mul
    u = ((x >> 40) & 0xFFFFFF).double() / float(1 << 24)  # 24 uniform bits in [0, 1)
    return u < sample


def pack(
    cols: dict[str, torch.Tensor],
    sel: torch.Tensor,
    aggs: torch.Tensor,
    extra_int: dict[str, torch.Tensor],
) -> tuple[torch.Tensor, list[str], int]:
    """Select rows (sel [B, T] bool) and pack everything into one flat int32 tensor:
    [aggs as float64 (2 int32 each) | float columns as float32 | int columns | flags].
    Returns (packed, names of the float columns present, number of rows)."""
    idx = sel.reshape(-1).nonzero().squeeze(1)  # the one data-dependent size (a sync)
    k = idx.numel()
    fnames = [c for c in FLOAT_COLS if c in cols]
    f = torch.stack([cols[c].reshape(-1).float().index_select(0, idx) for c in fnames]) if fnames else None
    ints = torch.stack([extra_int[c].reshape(-1).to(torch.int32).index_select(0, idx) for c in INT_COLS])
    flags = cols["quadrant"].to(torch.int32) & _Q_BITS
    flags = flags | ((cols["clip"].to(torch.int32) + 1) << _CLIP_SHIFT)
    flags = flags | (cols["clipped"].to(torch.int32) << _CLIPPED_SHIFT)
    if "erc_kept" in cols:
        flags = flags | (cols["erc_kept"].to(torch.int32) << _ERC_SHIFT)
    flags = flags.reshape(-1).index_select(0, idx).unsqueeze(0)
    parts = [aggs.double().contiguous().view(torch.int32)]
    if f is not None:
        parts.append(f.contiguous().view(torch.int32).reshape(-1))
    parts += [ints.reshape(-1), flags.reshape(-1)]
    return torch.cat(parts), fnames, k


def unpack(host: np.ndarray, fnames: list[str], k: int, has_erc: bool) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Inverse of :func:`pack` on the host (numpy views, no copies). Returns (aggs float64, columns)."""
    na = len(AGG_NAMES)
    aggs = host[: 2 * na].view(np.float64)
    off = 2 * na
    cols: dict[str, np.ndarray] = {}
    nf = len(fnames)
    fl = host[off : off + nf * k].view(np.float32).reshape(nf, k)
    for i, c in enumerate(fnames):
        cols[c] = fl[i]
    off += nf * k
    it = host[off : off + len(INT_COLS) * k].reshape(len(INT_COLS), k)
    for i, c in enumerate(INT_COLS):
        cols[c] = it[i]
    off += len(INT_COLS) * k
    flags = host[off : off + k]
    cols["quadrant"] = (flags & _Q_BITS).astype(np.int8)
    cols["clip"] = (((flags >> _CLIP_SHIFT) & 0b11) - 1).astype(np.int8)
    cols["clipped"] = ((flags >> _CLIPPED_SHIFT) & 1).astype(bool)
    if has_erc:
        cols["erc_kept"] = ((flags >> _ERC_SHIFT) & 1).astype(bool)
    return aggs, cols
