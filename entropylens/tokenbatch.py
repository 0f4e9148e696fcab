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

from . import stats
from .schema import CLIP_NONE, QUADRANT_NAMES, QUADRANTS, STEP_METRICS, quadrant_slug

# Float token columns shipped to the host, in pack order (float32).
# (prob, ratio and entropy_ratio are derived from these by the views and never leave the device)
FLOAT_COLS = ("logprob", "old_logprob", "advantage", "entropy", "old_entropy", "grad_coef", "logit_grad_norm",
              "entropy_effect", "entropy_effect_dropped", "is_weight")
# flags word per token: quadrant (3 bits) | clip + 1 (2 bits) << 3 | clipped << 5 | erc_kept << 6
# | selected (masked in and sampled) << 7 | masked in << 8 | dual_clipped << 9 | token_kept << 10 | seq_kept << 11
_Q_BITS, _CLIP_SHIFT, _CLIPPED_SHIFT, _ERC_SHIFT, _SELECTED_SHIFT, _MASK_SHIFT = 0b111, 3, 5, 6, 7, 8
# the optional bool token columns (null where the loss has no such modifier) and their bit in the flags word
BOOL_SHIFTS: dict[str, int] = {"erc_kept": _ERC_SHIFT, "dual_clipped": 9, "token_kept": 10, "seq_kept": 11}

AGG_NAMES: tuple[str, ...] = STEP_METRICS  # defined once, in schema.py
# Entropy budget (first-order attribution, DESIGN.md): sums over the update's tokens of
# entropy_effect = g s / T^2 and entropy_effect_dropped = (g_unclipped - g) s / T^2, per quadrant and
# per clip region (low: r < 1-eps_low, high: r > 1+eps_high: where); then the dropped effect by cause
# (why), a partition of entropy_effect_dropped (schema.STEPS: _clip_low .. _erc; :func:`entropy_budget`).
BUDGET_NAMES: tuple[str, ...] = tuple(
    f"{kind}{suffix}"
    for kind in ("entropy_effect", "entropy_effect_dropped")
    for suffix in ("", *(f"_{quadrant_slug(q)}" for q in QUADRANTS), "_low", "_high")
)
CAUSES: tuple[str, ...] = ("clip_low", "clip_high", "dual_clip", "erc")
BUDGET_NAMES = BUDGET_NAMES + tuple(f"entropy_effect_dropped_{c}" for c in CAUSES)
AGG_NAMES = AGG_NAMES + BUDGET_NAMES
# the columns the optional step fractions count (present in cols, or the fraction is NaN / absent)
FRACTION_COLUMNS = {"dual_clip_frac": "dual_clipped", "token_masked_frac": "token_kept",
                    "seq_masked_frac": "seq_kept", "is_weight_mean": "is_weight"}


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


def entropy_budget(cols: dict[str, torch.Tensor], mask: torch.Tensor) -> torch.Tensor:
    """float64 [len(BUDGET_NAMES)] on the device: sums of entropy_effect and entropy_effect_dropped
    over masked-in tokens, in total, per quadrant and per clip region, and the dropped effect by cause
    (one [4, N] x [N, 10] matmul); NaN where the column is absent. cols and mask [B, T]; or a stack of
    updates [U, B, T] -> [U, len(BUDGET_NAMES)], each row its update's own sums.

    By cause (a partition: the four parts add up to entropy_effect_dropped): ERC's share is the
    ``_dropped_by_erc`` column (:func:`add_attribution`, (g_e - g) s / T^2); the rest of each changed
    token's dropped effect, (g_u - g_e) s / T^2, goes to dual-clip where the token is not clipped and
    either dual_clipped or inside the band (clip 0), else to its clip side (clip -1 / +1). Before ERC
    the losses change a token's gradient only there: clipping needs the token's (or, at ratio_level
    'sequence', its sequence's) ratio outside the band; inside it only dual-clip / delta acts (delta
    < 1+eps_high caps A > 0 tokens inside the band, and at sequence level with per-token advantages
    that changes the gradient of their sequence's other tokens too), and a token ERC alone changed
    has g_u == g_e. A part is NaN where its column is absent (with ERC but no ``_dropped_by_erc``:
    every part, the split unknown)."""
    batched = mask.dim() == 3
    out = _budget(cols, mask.reshape(mask.shape[0] if batched else 1, -1))
    return out if batched else out[0]


def _budget(cols: dict[str, torch.Tensor], m: torch.Tensor) -> torch.Tensor:
    """:func:`entropy_budget` of U updates: m [U, N] bool, cols [U, ...] -> [U, len(BUDGET_NAMES)]."""
    u = m.shape[0]
    k = 7  # entries per kind (total, 4 quadrants, low, high)
    out = torch.full((u, len(BUDGET_NAMES)), float("nan"), dtype=torch.float64, device=m.device)
    if "entropy_effect" not in cols:
        return out

    def flat(name: str) -> torch.Tensor:
        return cols[name].reshape(u, -1)  # [U, N]

    eff = torch.where(m, flat("entropy_effect").double(), 0.0)  # [U, N]
    have_drop = "entropy_effect_dropped" in cols
    have_erc = "erc_kept" in cols
    split = have_drop and (not have_erc or "_dropped_by_erc" in cols)  # the by-cause split is known
    drop = flat("entropy_effect_dropped").double() if have_drop else torch.zeros_like(eff)
    drop = torch.where(m & ~torch.isnan(drop), drop, 0.0)  # null (unchanged) tokens add nothing
    rows = [eff, drop]
    clip = cols["clip"].reshape(u, -1, 1)  # [U, N, 1]
    # 0/1 columns [U, N, 7]: every token, quadrant codes 1..4 (one comparison against 0..4), clip low, high
    parts = [cols["quadrant"].reshape(u, -1, 1) == _codes(m.device), clip < CLIP_NONE, clip > CLIP_NONE]
    if split:
        by_erc = flat("_dropped_by_erc").double() if have_erc else None
        by_erc = torch.where(m & ~torch.isnan(by_erc), by_erc, 0.0) if have_erc else torch.zeros_like(eff)
        rows += [drop - by_erc, by_erc]  # before ERC (by the classes below) | ERC's own share
        if "dual_clipped" in cols:  # not clipped, and dual-clipped or inside the band (see the docstring)
            dual = (~flat("clipped") & (flat("dual_clipped") | (flat("clip") == CLIP_NONE))).unsqueeze(2)  # [U, N, 1]
            parts += [dual, ~dual & (clip < CLIP_NONE), ~dual & (clip > CLIP_NONE)]
        else:
            parts += [torch.zeros_like(clip, dtype=torch.bool), clip < CLIP_NONE, clip > CLIP_NONE]
    groups = torch.cat(parts, 2).double()  # [U, N, 7] (with the split: 10)
    groups[:, :, 0] = 1.0  # the all-tokens column (code 0's place)
    sums = _bmm(torch.stack(rows, 1), groups)  # [U, 2 or 4, N] x [U, N, 7 or 10] -> [U, 2 or 4, 7 or 10]
    out[:, :k] = sums[:, 0, :k]
    if have_drop:
        out[:, k:2 * k] = sums[:, 1, :k]
    if split:
        c = 2 * k  # entropy_effect_dropped_<cause>, in CAUSES' order
        dual_part, low_part, high_part = sums[:, 2, k:].unbind(1)
        out[:, c] = low_part
        out[:, c + 1] = high_part
        if "dual_clipped" in cols:
            out[:, c + 2] = dual_part
        if have_erc:
            out[:, c + 3] = sums[:, 3, 0]
    return out


def _bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [U, I, N] @ b [U, N, J] -> [U, I, J]; one update (U = 1) by the plain 2-D matmul, the
    very op (and so the very sums) of the per-update code on every device."""
    return (a[0] @ b[0]).unsqueeze(0) if a.shape[0] == 1 else a @ b


def masked_quantiles(x: torch.Tensor, mask: torch.Tensor, qs: tuple[float, ...]) -> torch.Tensor:
    """Linear-interpolated quantiles (as torch.quantile) of x[mask], without a host sync.
    NaN when the mask is empty. x, mask [B, T] -> [len(qs)] float32; or a stack of updates
    [U, B, T] -> [U, len(qs)], each row over its own update's tokens."""
    batched = mask.dim() == 3
    u = mask.shape[0] if batched else 1
    m = mask.reshape(u, -1)  # [U, N]
    flat = torch.where(m, x.reshape(u, -1).float(), torch.full_like(m, float("inf"), dtype=torch.float32))
    if flat.device.type == "cpu":  # the same sorted values; numpy's sort is ~3x cheaper on small rows
        srt = torch.from_numpy(np.sort(flat.numpy(), axis=1))
    else:
        srt, _ = torch.sort(flat, dim=1)  # masked-out values sort to the end
    n = m.sum(dim=1, keepdim=True)  # [U, 1]
    last = (n - 1).clamp(min=0).double()
    pos = torch.cat([last * q for q in qs], 1)  # [U, Q] (no host-made tensor: that would be a sync on CUDA)
    lo = pos.floor().long()
    hi = pos.ceil().long()
    frac = (pos - lo.double()).float()
    lo_v, hi_v = srt.gather(1, lo), srt.gather(1, hi)
    out = lo_v + (hi_v - lo_v) * frac
    out = torch.where(frac == 0, lo_v, out)  # inf - inf guard when lo == hi
    out = torch.where(n > 0, out, torch.full_like(out, float("nan")))
    return out if batched else out[0]


# Every masked-in token falls in one of 60 groups: quadrant code (5) x clip region (3) x clipped (2)
# x ERC dropped (2); masked-out tokens in group 60. The counts of the groups give every count and
# fraction of the steps row through one constant [60, 17] matrix (_COUNT_MAP, built on the device).
_N_GROUPS = len(QUADRANT_NAMES) * 3 * 2 * 2
_COUNT_MAP: dict[torch.device, torch.Tensor] = {}
_CODES: dict[torch.device, torch.Tensor] = {}


def _codes(device: torch.device) -> torch.Tensor:
    """The quadrant codes 0..4 as int64 [5] on the device (x[..., None] == codes: the one-hot matrix in one
    comparison, with no range check that reads the values), once per device."""
    if device not in _CODES:
        _CODES[device] = torch.arange(len(QUADRANT_NAMES), device=device)
    return _CODES[device]


def _count_map(device: torch.device) -> torch.Tensor:
    """[60, 17] float64 0/1: group -> (n, clip_low, clip_high, clipped, region_low, region_high,
    erc_drop, n per quadrant code 0..4, clipped per quadrant code 0..4). Built from arange on the
    device (no host-made tensor, so no synchronising copy), once per device."""
    if device not in _COUNT_MAP:
        g = torch.arange(_N_GROUPS, device=device)
        quad, side, clipped, dropped = g // 12, (g % 12) // 4, (g % 4) // 2, g % 2
        low, high = side == 0, side == 2
        cols = [torch.ones_like(g, dtype=torch.bool), low & (clipped == 1), high & (clipped == 1), clipped == 1,
                low, high, dropped == 1]
        cols += [quad == q for q in range(len(QUADRANT_NAMES))]
        cols += [(quad == q) & (clipped == 1) for q in range(len(QUADRANT_NAMES))]
        _COUNT_MAP[device] = torch.stack(cols, 1).double()
    return _COUNT_MAP[device]


def step_aggregates(
    cols: dict[str, torch.Tensor], mask: torch.Tensor, lgn: torch.Tensor | None, loss_value: torch.Tensor | None
) -> torch.Tensor:
    """Exact aggregates over all masked-in tokens, float64 [len(AGG_NAMES)], on the device, in the
    order of schema.STEP_METRICS (then the entropy budget). Fractions are of all tokens of the update;
    clip_frac_<q> is of the tokens of quadrant q; lgn_mean_<q> the mean logit-gradient norm of
    quadrant q (NaN without watch_logits). A ratio or k3 that is not finite (exp overflow) or a
    non-finite logit-gradient norm is counted (n_nonfinite_ratio, n_nonfinite_lgn) and left out of
    its mean, never summed as 0 or inf.

    cols, mask, lgn [B, T] (loss_value 0-dim) -> [len(AGG_NAMES)]; or a stack of U updates of one
    shape, cols, mask, lgn [U, B, T] (loss_value [U]) -> [U, len(AGG_NAMES)]: one set of ops for
    all of them (the writer thread batches a step's updates so), each row its own update's
    aggregates, equal to what the update alone gives.

    Counts: one scatter_add of ones into the 60 groups per update (see _count_map; exact in
    float64), one [U, 60] x [60, 17] matmul. Value sums: rows of per-token values [U, K, N] times
    the masked one-hot quadrant matrix [U, N, 5] (deterministic, float64)."""
    batched = mask.dim() == 3
    u = mask.shape[0] if batched else 1
    dev = mask.device

    def flat(x: torch.Tensor) -> torch.Tensor:
        return x.reshape(u, -1)  # [U, N]

    m = flat(mask)
    have_h, have_oh, have_erc = "entropy" in cols, "old_entropy" in cols, "erc_kept" in cols
    quad = flat(cols["quadrant"]).long()  # [U, N]
    group = quad * 12 + (flat(cols["clip"]).long() + 1) * 4 + flat(cols["clipped"]).long() * 2
    if have_erc:
        group = group + (~flat(cols["erc_kept"])).long()
    group = torch.where(m, group, _N_GROUPS)  # [U, N]
    counts = torch.zeros(u, _N_GROUPS + 1, dtype=torch.float64, device=dev)
    counts.scatter_add_(1, group, torch.ones_like(group, dtype=torch.float64))
    c = counts[:, :_N_GROUPS] @ _count_map(dev)  # [U, 17]
    n, denom = c[:, 0:1], c[:, 0:1].clamp(min=1.0)
    n_quad = torch.cat([c[:, 8:12], c[:, 7:8]], 1)  # n_pa_hp .. n_na_lp, n_za

    log_r = flat(cols["logprob"]).float() - flat(cols["old_logprob"]).float()
    zeros = torch.zeros_like(log_r)
    rows = torch.stack([
        flat(cols["entropy"]).float() if have_h else zeros,
        flat(cols["old_entropy"]).float() if have_oh else zeros,
        flat(cols["ratio"]).float(),
        torch.expm1(log_r) - log_r,  # k3 (stats.kl_k3)
        flat(lgn).float() if lgn is not None else zeros,
    ], 1).double()  # [U, 5, N]
    finite = torch.isfinite(rows)  # [U, 5, N]
    ratio_ok = finite[:, 2] & finite[:, 3]  # [U, N]: ratio and k3 both finite
    keep = torch.stack([finite[:, 0], finite[:, 1], ratio_ok, ratio_ok, finite[:, 4]], 1)
    vals = [torch.where(keep, rows, 0.0), torch.stack([ratio_ok, finite[:, 4]], 1).double()]  # [U, 5 + 2, N]
    # the loss's modifiers (the columns present): dual-clipped, outside the token mask, sequence dropped, IS weight
    extra = [c for c in FRACTION_COLUMNS.values() if c in cols]
    if extra:
        x = [flat(cols[c]) for c in extra]
        x = [torch.where(m, v.float(), 0.0) if c == "is_weight" else (v.bool() if c == "dual_clipped" else ~v.bool())
             for c, v in zip(extra, x)]
        vals.append(torch.stack(x, 1).double())  # [U, len(extra), N]
    vals = torch.cat(vals, 1)  # [U, 7 + len(extra), N]
    onehot = ((quad.unsqueeze(2) == _codes(dev)) & m.unsqueeze(2)).double()  # [U, N, 5]: masked one-hot quadrant
    per_q = _bmm(vals, onehot)  # [U, 7 + len(extra), 5]: value sums per quadrant code (0 = ZA, 1..4 = the quadrants)
    tot = per_q[0].sum(dim=1).unsqueeze(0) if u == 1 else per_q.sum(dim=2)  # [U, 7 + len(extra)]
    ratio_n = tot[:, 5:6].clamp(min=1.0)

    def nan(k: int) -> torch.Tensor:
        return torch.full((u, k), float("nan"), dtype=torch.float64, device=dev)

    out = [
        n,
        tot[:, 0:1] / denom if have_h else nan(1),
        tot[:, 1:2] / denom if have_oh else nan(1),
        tot[:, 2:3] / ratio_n,
        c[:, 1:6] / denom,  # clip_low, clip_high, clipped, region_low, region_high
        n_quad,
        c[:, 13:17] / c[:, 8:12].clamp(min=1.0),  # clip_frac per quadrant
        per_q[:, 4, 1:5] / per_q[:, 6, 1:5].clamp(min=1.0) if lgn is not None else nan(4),
        masked_quantiles(cols["entropy_ratio"], mask, (0.05, 0.5, 0.95)).double().reshape(u, 3)
        if "entropy_ratio" in cols else nan(3),
        c[:, 6:7] / denom if have_erc else nan(1),
        tot[:, 3:4] / ratio_n,
        n - tot[:, 5:6],
        n - tot[:, 6:7] if lgn is not None else nan(1),
        *(tot[:, 7 + extra.index(c):8 + extra.index(c)] / denom if c in extra else nan(1)
          for c in FRACTION_COLUMNS.values()),  # dual_clip_frac, token_masked_frac, seq_masked_frac, is_weight_mean
        loss_value.detach().double().reshape(u, 1) if loss_value is not None else nan(1),
        entropy_budget(cols, mask).reshape(u, -1),
    ]
    out = torch.cat(out, 1)  # [U, len(AGG_NAMES)]
    return out if batched else out[0]


def step_metrics(
    cols: dict[str, torch.Tensor], mask: torch.Tensor, loss_value: torch.Tensor | None = None,
    lgn: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """:func:`step_aggregates` as a dict of 0-dim device tensors keyed by the steps column names,
    leaving out the ones whose inputs are absent (entropy, ERC, logit-gradient norms, loss)."""
    aggregates = step_aggregates(cols, mask, lgn, loss_value)
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
        absent.add("n_nonfinite_lgn")
    if loss_value is None:
        absent.add("loss")
    absent.update(name for name, col in FRACTION_COLUMNS.items() if col not in cols)
    if "entropy_effect" not in cols:
        absent.update(BUDGET_NAMES)
    elif "entropy_effect_dropped" not in cols:
        absent.update(n for n in BUDGET_NAMES if n.startswith("entropy_effect_dropped"))
    elif "erc_kept" in cols and "_dropped_by_erc" not in cols:  # the by-cause split is unknown
        absent.update(f"entropy_effect_dropped_{c}" for c in CAUSES)
    for cause, col in (("erc", "erc_kept"), ("dual_clip", "dual_clipped")):
        if col not in cols:
            absent.add(f"entropy_effect_dropped_{cause}")
    return {name: v for name, v in zip(AGG_NAMES, aggregates.unbind(0)) if name not in absent}


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
