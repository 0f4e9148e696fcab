"""The exact step aggregates of one update (or a stack of updates), as pure tensor functions on the
tensor's device: counts and fractions by quadrant and clip region, means, the entropy-ratio quantiles, the
loss modifiers' fractions and the entropy budget. Named as the schema's steps columns (schema.STEP_METRICS,
then BUDGET_NAMES): :func:`step_aggregates` builds each by name and stacks them in that order.

Below both the losses (``policy_loss(...).metrics``) and the recorder's device work (record/device/blocks.py):
neither reaches into the other for them.
"""

from __future__ import annotations

import numpy as np
import torch

from ..schema import CLIP_NONE, MISMATCH_LOG_RATIO, QUADRANT_NAMES, QUADRANTS, STEP_METRICS, quadrant_slug

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
CAUSES: tuple[str, ...] = ("clip_low", "clip_high", "dual_clip", "erc", "clip_cov", "kl_cov")
COV_CAUSES = {"clip_cov": "cov_clipped", "kl_cov": "kl_cov_penalised"}  # cause -> the column naming its tokens
BUDGET_NAMES = BUDGET_NAMES + tuple(f"entropy_effect_dropped_{c}" for c in CAUSES)
AGG_NAMES = AGG_NAMES + BUDGET_NAMES
# the columns the optional step fractions count (present in cols, or the fraction is NaN / absent)
FRACTION_COLUMNS = {
    "dual_clip_frac": "dual_clipped",
    "token_masked_frac": "token_kept",
    "seq_masked_frac": "seq_kept",
    "is_weight_mean": "is_weight",
    "sapo_weight_mean": "sapo_weight",
    "cov_clipped_frac": "cov_clipped",
    "kl_cov_frac": "kl_cov_penalised",
    "is_masked_frac": "is_masked",
}
MEAN_COLUMNS = ("is_weight", "sapo_weight")  # FRACTION_COLUMNS averaged as values (the rest count False / True)
# fractions of true (the others: of false)
_COUNTED_TRUE = ("dual_clipped", "cov_clipped", "kl_cov_penalised", "is_masked")
# the steps columns of the training-inference mismatch (:func:`mismatch_aggregates`): null without sampler_logprob
SAMPLER_METRICS: tuple[str, ...] = (
    "sampler_abs_log_ratio_mean",
    "sampler_abs_log_ratio_max",
    "sampler_kl_k1",
    "sampler_kl_k3",
    "clipped_mismatched_frac",
    *(f"sampler_abs_log_ratio_mean_{quadrant_slug(q)}" for q in QUADRANTS),
)
# their counts (also null without sampler_logprob): the tokens with a sampler log-prob, and the clipped ones
# among them, the weights that pool the means and clipped_mismatched_frac over a step's updates. Counts add
# up over micro-batches (trainer logs carry them; the SAMPLER_METRICS themselves do not add up)
SAMPLER_COUNTS: tuple[str, ...] = ("n_sampled", "n_sampled_clipped")


def entropy_budget(cols: dict[str, torch.Tensor], mask: torch.Tensor) -> torch.Tensor:
    """float64 [len(BUDGET_NAMES)] on the device: sums of entropy_effect and entropy_effect_dropped
    over masked-in tokens, in total, per quadrant and per clip region, and the dropped effect by cause
    (one [4, N] x [N, 10] matmul); NaN where the column is absent. cols and mask [B, T]; or a stack of
    updates [U, B, T] -> [U, len(BUDGET_NAMES)], each row its update's own sums.

    By cause (a partition: the six parts add up to entropy_effect_dropped): ERC's share is the
    ``_dropped_by_erc`` column (:func:`add_attribution`, (g_e - g) s / T^2); the rest of each changed
    token's dropped effect, (g_u - g_e) s / T^2, goes to Clip-Cov / KL-Cov on the tokens they selected
    (cov_clipped / kl_cov_penalised; Clip-Cov never selects a clipped or dual-clipped token), else to
    dual-clip where the token is not clipped and either dual_clipped or inside the band (clip 0), else
    to its clip side (clip -1 / +1). Before ERC
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
        if have_erc:
            by_erc = flat("_dropped_by_erc").double()
            by_erc = torch.where(m & ~torch.isnan(by_erc), by_erc, 0.0)
        else:
            by_erc = torch.zeros_like(eff)
        rows += [drop - by_erc, by_erc]  # before ERC (by the classes below) | ERC's own share
        no = torch.zeros_like(clip, dtype=torch.bool)  # [U, N, 1]
        by_cov = [flat(col).bool().unsqueeze(2) if col in cols else no for col in COV_CAUSES.values()]
        rest = ~(by_cov[0] | by_cov[1])  # [U, N, 1]: tokens no covariance control selected
        if "dual_clipped" in cols:  # not clipped, and dual-clipped or inside the band (see the docstring)
            dual = (~flat("clipped") & (flat("dual_clipped") | (flat("clip") == CLIP_NONE))).unsqueeze(2) & rest
            parts += [dual, ~dual & rest & (clip < CLIP_NONE), ~dual & rest & (clip > CLIP_NONE)]
        else:
            parts += [no, rest & (clip < CLIP_NONE), rest & (clip > CLIP_NONE)]
        parts += by_cov
    groups = torch.cat(parts, 2).double()  # [U, N, 7] (with the split: 12)
    groups[:, :, 0] = 1.0  # the all-tokens column (code 0's place)
    sums = _bmm(torch.stack(rows, 1), groups)  # [U, 2 or 4, N] x [U, N, 7 or 12] -> [U, 2 or 4, 7 or 12]
    out[:, :k] = sums[:, 0, :k]
    if have_drop:
        out[:, k : 2 * k] = sums[:, 1, :k]
    if split:
        c = 2 * k  # entropy_effect_dropped_<cause>, in CAUSES' order
        dual_part, low_part, high_part, clip_cov_part, kl_cov_part = sums[:, 2, k:].unbind(1)
        out[:, c] = low_part
        out[:, c + 1] = high_part
        if "dual_clipped" in cols:
            out[:, c + 2] = dual_part
        if have_erc:
            out[:, c + 3] = sums[:, 3, 0]
        for i, (part, col) in enumerate(zip((clip_cov_part, kl_cov_part), COV_CAUSES.values())):
            if col in cols:
                out[:, c + 4 + i] = part
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
    if m.shape[1] == 0:  # an empty batch (B = 0 or T = 0): nothing to sort or gather, known from the shape
        out = torch.full((u, len(qs)), float("nan"), dtype=torch.float32, device=mask.device)
        return out if batched else out[0]
    flat = torch.where(m, x.reshape(u, -1).float(), torch.full_like(m, float("inf"), dtype=torch.float32))
    if flat.device.type == "cpu":  # the same sorted values; numpy's sort is cheaper than torch's on small rows
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


# the count map's columns, by name: n per quadrant code and clipped per quadrant code (0 = ZA, 1..4)
_COUNT_NAMES: tuple[str, ...] = (
    "n",
    "clip_low",
    "clip_high",
    "clipped",
    "region_low",
    "region_high",
    "erc_drop",
    *(f"n_q{q}" for q in QUADRANT_NAMES),
    *(f"clipped_q{q}" for q in QUADRANT_NAMES),
)
_COUNT_INDEX: dict[str, int] = {name: i for i, name in enumerate(_COUNT_NAMES)}


def _count_map(device: torch.device) -> torch.Tensor:
    """[60, 17] float64 0/1: group -> (n, clip_low, clip_high, clipped, region_low, region_high,
    erc_drop, n per quadrant code 0..4, clipped per quadrant code 0..4). Built from arange on the
    device (no host-made tensor, so no synchronising copy), once per device."""
    if device not in _COUNT_MAP:
        g = torch.arange(_N_GROUPS, device=device)
        quad, side, clipped, dropped = g // 12, (g % 12) // 4, (g % 4) // 2, g % 2
        low, high = side == 0, side == 2
        cols = [
            torch.ones_like(g, dtype=torch.bool),
            low & (clipped == 1),
            high & (clipped == 1),
            clipped == 1,
            low,
            high,
            dropped == 1,
        ]
        cols += [quad == q for q in range(len(QUADRANT_NAMES))]
        cols += [(quad == q) & (clipped == 1) for q in range(len(QUADRANT_NAMES))]
        _COUNT_MAP[device] = torch.stack(cols, 1).double()
    return _COUNT_MAP[device]


def _over(count: torch.Tensor) -> torch.Tensor:
    """A mean's or a fraction's denominator: the count, NaN where it is 0, so that a mean or a fraction over
    no tokens is NaN (stored as null: not measured), never 0. Elementwise on the device: no sync."""
    return torch.where(count > 0, count, float("nan"))


def step_aggregates(
    cols: dict[str, torch.Tensor], mask: torch.Tensor, lgn: torch.Tensor | None, loss_value: torch.Tensor | None
) -> torch.Tensor:
    """Exact aggregates over all masked-in tokens, float64 [len(AGG_NAMES)], on the device, in the
    order of schema.STEP_METRICS (then the entropy budget). Fractions are of all tokens of the update;
    clip_frac_<q> is of the tokens of quadrant q; lgn_mean_<q> the mean logit-gradient norm of
    quadrant q (NaN without watch_logits). A mean, fraction or quantile over no tokens (an empty batch, a
    mask that selects nothing, a quadrant without tokens) is NaN, stored as null; counts are 0 and the
    entropy budget's sums over no tokens 0. A ratio or k3 that is not finite (exp overflow) or a
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
    c = counts[:, :_N_GROUPS] @ _count_map(dev)  # [U, 17]: columns named by _COUNT_NAMES

    def count(name: str) -> torch.Tensor:
        return c[:, _COUNT_INDEX[name] : _COUNT_INDEX[name] + 1]  # [U, 1]

    n, denom = count("n"), _over(count("n"))

    log_r = flat(cols["logprob"]).float() - flat(cols["old_logprob"]).float()
    zeros = torch.zeros_like(log_r)
    rows = torch.stack(
        [
            flat(cols["entropy"]).float() if have_h else zeros,
            flat(cols["old_entropy"]).float() if have_oh else zeros,
            flat(cols["ratio"]).float(),
            torch.expm1(log_r) - log_r,  # k3 (stats.kl_k3)
            flat(lgn).float() if lgn is not None else zeros,
        ],
        1,
    ).double()  # [U, 5, N]
    finite = torch.isfinite(rows)  # [U, 5, N]
    ratio_ok = finite[:, 2] & finite[:, 3]  # [U, N]: ratio and k3 both finite
    keep = torch.stack([finite[:, 0], finite[:, 1], ratio_ok, ratio_ok, finite[:, 4]], 1)
    parts = [torch.where(keep, rows, 0.0), torch.stack([ratio_ok, finite[:, 4]], 1).double()]  # [U, 5 + 2, N]
    # the loss's modifiers (the columns present): dual-clipped, outside the token mask, sequence dropped, IS weight
    extra = [c for c in FRACTION_COLUMNS.values() if c in cols]
    if extra:
        x = [flat(cols[c]) for c in extra]
        x = [
            torch.where(m, v.float(), 0.0) if c in MEAN_COLUMNS else (v.bool() if c in _COUNTED_TRUE else ~v.bool())
            for c, v in zip(extra, x)
        ]
        parts.append(torch.stack(x, 1).double())  # [U, len(extra), N]
    vals = torch.cat(parts, 1)  # [U, 7 + len(extra), N]
    onehot = ((quad.unsqueeze(2) == _codes(dev)) & m.unsqueeze(2)).double()  # [U, N, 5]: masked one-hot quadrant
    per_q = _bmm(vals, onehot)  # [U, 7 + len(extra), 5]: value sums per quadrant code (0 = ZA, 1..4 = the quadrants)
    tot = per_q[0].sum(dim=1).unsqueeze(0) if u == 1 else per_q.sum(dim=2)  # [U, 7 + len(extra)]
    ratio_n = _over(tot[:, 5:6])

    def nan(k: int) -> torch.Tensor:
        return torch.full((u, k), float("nan"), dtype=torch.float64, device=dev)

    agg: dict[str, torch.Tensor] = {  # each steps column by name, [U, 1]
        "n_tokens": n,
        "entropy_mean": tot[:, 0:1] / denom if have_h else nan(1),
        "old_entropy_mean": tot[:, 1:2] / denom if have_oh else nan(1),
        "ratio_mean": tot[:, 2:3] / ratio_n,
        **{
            f"{name}_frac": count(name) / denom
            for name in ("clip_low", "clip_high", "clipped", "region_low", "region_high")
        },
        "erc_drop_frac": count("erc_drop") / denom if have_erc else nan(1),
        "kl_k3": tot[:, 3:4] / ratio_n,
        "n_nonfinite_ratio": n - tot[:, 5:6],
        "n_nonfinite_lgn": n - tot[:, 6:7] if lgn is not None else nan(1),
        "loss": loss_value.detach().double().reshape(u, 1) if loss_value is not None else nan(1),
    }
    for code, q in QUADRANT_NAMES.items():  # code 0 = ZA, 1..4 = the quadrants
        slug = quadrant_slug(q)
        agg[f"n_{slug}"] = count(f"n_q{code}")
        if q in QUADRANTS:
            agg[f"clip_frac_{slug}"] = count(f"clipped_q{code}") / _over(count(f"n_q{code}"))
            agg[f"lgn_mean_{slug}"] = (
                per_q[:, 4, code : code + 1] / _over(per_q[:, 6, code : code + 1]) if lgn is not None else nan(1)
            )
    quantiles = (
        masked_quantiles(cols["entropy_ratio"], mask, (0.05, 0.5, 0.95)).double().reshape(u, 3)
        if "entropy_ratio" in cols
        else nan(3)
    )
    for k, name in enumerate(("entropy_ratio_p05", "entropy_ratio_p50", "entropy_ratio_p95")):
        agg[name] = quantiles[:, k : k + 1]
    for name, col in FRACTION_COLUMNS.items():  # dual_clip_frac, ..., is_weight_mean, sapo_weight_mean
        agg[name] = tot[:, 7 + extra.index(col) : 8 + extra.index(col)] / denom if col in extra else nan(1)
    agg.update(
        mismatch_aggregates(cols, m, quad)
        if "sampler_logprob" in cols
        else {name: nan(1) for name in SAMPLER_METRICS + SAMPLER_COUNTS}
    )
    out = torch.cat([agg[name] for name in STEP_METRICS] + [entropy_budget(cols, mask).reshape(u, -1)], 1)
    return out if batched else out[0]


def mismatch_aggregates(cols: dict[str, torch.Tensor], m: torch.Tensor, quad: torch.Tensor) -> dict[str, torch.Tensor]:
    """The training-inference mismatch of U updates, each [U, 1] float64 (SAMPLER_METRICS), from
    d = old_logprob - sampler_logprob over the masked-in tokens whose d is not NaN (a token the sampler did
    not score: TRL's NaN, left out as TRL does):
      sampler_abs_log_ratio_mean = mean |d|, _max = max |d| (TRL's sampling/sampling_logp_difference/*),
      sampler_kl_k1 = mean(-d) (verl's rollout_corr/kl), sampler_kl_k3 = mean(exp(d) - d - 1) (verl's k3_kl),
      sampler_abs_log_ratio_mean_<q> = mean |d| over quadrant q's tokens,
      clipped_mismatched_frac = #(clipped & mismatched) / #clipped, mismatched = |d| > ln 2 or is_masked,
    and their counts (SAMPLER_COUNTS): n_sampled = the tokens counted, n_sampled_clipped = the clipped ones.
    NaN where no token counts (stored as null). m, quad [U, N] (bool, quadrant codes); cols [U, ...]."""
    u = m.shape[0]
    d = cols["old_logprob"].reshape(u, -1).double() - cols["sampler_logprob"].reshape(u, -1).double()  # [U, N]
    ok = m & ~torch.isnan(d)  # [U, N]
    d0 = torch.where(ok, d, 0.0)
    a = d0.abs()
    n = ok.sum(1, keepdim=True).double()  # [U, 1]
    over = _over(n)
    big = (
        torch.where(ok, d.abs(), float("-inf")).amax(1, keepdim=True)
        if d.shape[1]
        else torch.full_like(n, float("nan"))
    )
    out = {
        "sampler_abs_log_ratio_mean": a.sum(1, keepdim=True) / over,
        "sampler_abs_log_ratio_max": torch.where(n > 0, big, float("nan")),
        "sampler_kl_k1": -d0.sum(1, keepdim=True) / over,
        "sampler_kl_k3": (torch.expm1(d0) - d0).sum(1, keepdim=True) / over,
    }
    mism = ok & (a > MISMATCH_LOG_RATIO)
    if "is_masked" in cols:
        mism = mism | (cols["is_masked"].reshape(u, -1).bool() & m)
    clipped = cols["clipped"].reshape(u, -1).bool() & ok
    n_clipped = clipped.sum(1, keepdim=True).double()  # [U, 1]
    out["clipped_mismatched_frac"] = (clipped & mism).sum(1, keepdim=True).double() / _over(n_clipped)
    out["n_sampled"], out["n_sampled_clipped"] = n, n_clipped
    in_q = (quad.unsqueeze(2) == _codes(m.device)) & ok.unsqueeze(2)  # [U, N, 5]
    q_sum = torch.where(in_q, a.unsqueeze(2), 0.0).sum(1)  # [U, 5]
    q_n = in_q.sum(1).double()  # [U, 5]
    for code, q in QUADRANT_NAMES.items():
        if q in QUADRANTS:
            out[f"sampler_abs_log_ratio_mean_{quadrant_slug(q)}"] = q_sum[:, code : code + 1] / _over(
                q_n[:, code : code + 1]
            )
    return out


def step_metrics(
    cols: dict[str, torch.Tensor],
    mask: torch.Tensor,
    loss_value: torch.Tensor | None = None,
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
    if "sampler_logprob" not in cols:
        absent.update(SAMPLER_METRICS + SAMPLER_COUNTS)
    if "entropy_effect" not in cols:
        absent.update(BUDGET_NAMES)
    elif "entropy_effect_dropped" not in cols:
        absent.update(n for n in BUDGET_NAMES if n.startswith("entropy_effect_dropped"))
    elif "erc_kept" in cols and "_dropped_by_erc" not in cols:  # the by-cause split is unknown
        absent.update(f"entropy_effect_dropped_{c}" for c in CAUSES)
    for cause, col in (("erc", "erc_kept"), ("dual_clip", "dual_clipped"), *COV_CAUSES.items()):
        if col not in cols:
            absent.add(f"entropy_effect_dropped_{cause}")
    return {name: v for name, v in zip(AGG_NAMES, aggregates.unbind(0)) if name not in absent}
