"""The steps table in the making: one row per (step, update) until the step is closed.

A row gathers the update's exact aggregates (aggregates.step_aggregates), the scalars recorded for
that update (grad norm, lr, settings) and the step's own scalars (reward mean, ...), which every
update row of the step carries. Pure host bookkeeping: no I/O, no threads (the writer thread owns
one table). With ``histograms`` on, it also counts each step's entropy ratio and importance ratio per
quadrant into fixed bins (:class:`StepHistogram`), and on table steps keeps a small sample of the step's
token rows (:data:`TABLE_COLUMNS`); both are dropped when the step closes. It also keeps the sequences
rows that no update has trained yet (:meth:`StepTable.untrained`: the recorder names them at close).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ...rl.aggregates import AGG_NAMES, SAMPLER_COUNTS
from ...schema import QUADRANT_NAMES, QUADRANTS, quadrant_slug

QUANTILES = {"entropy_ratio_p05": 0.05, "entropy_ratio_p50": 0.5, "entropy_ratio_p95": 0.95}
# summary's weight of a mismatch mean that is not over all the update's tokens: the count it is a mean over
# (n_tokens for the other aggregates). sampler_abs_log_ratio_mean_<q> is over quadrant q's tokens with a sampler
# log-prob, which no column counts: n_<q> equals it where the sampler scored every token; where it left some of
# q's tokens unscored (NaN) the pooled quadrant mean is an approximation
MEAN_WEIGHTS = {
    "sampler_abs_log_ratio_mean": "n_sampled",
    "sampler_kl_k1": "n_sampled",
    "sampler_kl_k3": "n_sampled",
    "clipped_mismatched_frac": "n_sampled_clipped",
    **{f"sampler_abs_log_ratio_mean_{quadrant_slug(q)}": f"n_{quadrant_slug(q)}" for q in QUADRANTS},
}

# Per-step histograms (trackers): 32 log-spaced bins over [0.5, 2] (edges 0.5 * 4**(i/32), i = 0..32: each
# bin 2**(1/16) ~ 1.044 wide, 1.0 an edge), one underflow bin (x < 0.5) and one overflow bin (x >= 2, inf
# included): HIST_BINS = 34 counts, every bin half-open [lo, hi). Exact over every masked-in token.
HIST_EDGES = 0.5 * 4.0 ** (np.arange(33) / 32)
HIST_BINS = len(HIST_EDGES) + 1
HIST_STEP = 4.0 ** (1 / 32)  # one bin's width (a factor): the under- and overflow bins are drawn this wide
# the entropy ratio of all tokens, then the importance ratio of each quadrant's tokens (quadrant codes 1..4)
HISTOGRAMS = ("entropy_ratio", *(f"ratio_{quadrant_slug(q)}" for q in QUADRANTS))
UNTRAINED_CAP = 200_000  # sequences rows awaiting an update that trains them, kept by id (the rest counted)
HISTOGRAMS_KEY, TABLE_KEY = "histograms", "tokens"  # summary(names=...) names that ask for them
TABLE_ROWS = 64
TABLE_COLUMNS = (
    "step",
    "update",
    "seq",
    "pos",
    "token_id",
    "prob",
    "ratio",
    "advantage",
    "quadrant",
    "clip",
    "clipped",
    "entropy",
    "entropy_ratio",
    "erc_kept",
)


_DRAWN_EDGES = np.round(np.concatenate([[HIST_EDGES[0] / HIST_STEP], HIST_EDGES, [HIST_EDGES[-1] * HIST_STEP]]), 6)
_DRAWN_EDGES.flags.writeable = False


def bin_index(x: np.ndarray) -> np.ndarray:
    """Each value's bin: 0 underflow, 1..32 the bins of HIST_EDGES, 33 overflow (NaN too)."""
    return np.searchsorted(HIST_EDGES, x, side="right")


@dataclass
class StepHistogram:
    """One step's counts in the fixed bins (HIST_BINS: underflow, 32 bins over [0.5, 2], overflow), and the
    values' sum and sum of squares (float64; inf where a value overflowed to inf)."""

    counts: np.ndarray  # [HIST_BINS] int64
    total: float
    sum_squares: float

    @property
    def num(self) -> int:
        return int(self.counts.sum())

    @staticmethod
    def edges() -> np.ndarray:
        """The HIST_BINS + 1 edges a chart draws: HIST_EDGES with the underflow bin drawn as [0.5 / HIST_STEP,
        0.5) and the overflow bin as [2, 2 * HIST_STEP) (one bin wide: they count every value below 0.5 /
        from 2 up); rounded to 6 decimals (the JSON trackers store them as text)."""
        return _DRAWN_EDGES

    def np_histogram(self) -> tuple[np.ndarray, np.ndarray]:
        """(counts, edges) as np.histogram returns them (W&B's and Trackio's ``np_histogram=``)."""
        return self.counts, self.edges()

    def buckets(self) -> tuple[float, float, list[float], list[float]]:
        """TensorBoard's HistogramProto buckets: (min, max, bucket_limit, bucket) over the bins from the
        first to the last non-empty one (TensorBoard draws bucket i over [limit[i-1], limit[i]), the first
        from min, the last up to max): min and max are those bins' drawn edges (:meth:`edges`)."""
        nz = np.flatnonzero(self.counts)
        lo, hi = (int(nz[0]), int(nz[-1])) if len(nz) else (0, HIST_BINS - 1)
        edges = self.edges()
        return (
            float(edges[lo]),
            float(edges[hi + 1]),
            edges[lo + 1 : hi + 2].tolist(),
            self.counts[lo : hi + 1].astype(np.float64).tolist(),
        )


@dataclass
class TokenTable:
    """A step's sampled token rows: ``columns`` (TABLE_COLUMNS) and ``rows`` (lists of Python values;
    None where the run has no such column, e.g. erc_kept without ERC)."""

    columns: tuple[str, ...]
    rows: list[list]


class _Sample:
    """The step's token sample so far: the rows with the TABLE_ROWS smallest keys (uniform draws, seeded
    by (step, update)) over the step's rows: a uniform sample, the same for the same run."""

    def __init__(self) -> None:
        self.keys = np.empty(0)
        self.rows: dict[str, np.ndarray] | None = None

    def add(self, step: int, update: int, host, k: int) -> None:
        idx = np.flatnonzero(host.selected)  # the token rows written to the files
        if not len(idx):
            return
        keys = np.random.default_rng((step, update)).random(len(idx))
        if len(idx) > k:
            keep = np.argpartition(keys, k - 1)[:k]
            idx, keys = idx[keep], keys[keep]
        rows = host.rows_at(idx)
        rows["update"] = np.full(len(idx), update, np.int16)
        if self.rows is not None:
            rows = {c: np.concatenate([self.rows[c], rows[c]]) for c in self.rows if c in rows}
            keys = np.concatenate([self.keys, keys])
        if len(keys) > k:
            keep = np.argpartition(keys, k - 1)[:k]
            rows, keys = {c: v[keep] for c, v in rows.items()}, keys[keep]
        self.rows, self.keys = rows, keys

    def table(self, step: int) -> TokenTable | None:
        r = self.rows
        if r is None:
            return None
        order = np.lexsort((r["pos"], r["seq"], r["update"]))
        r = {c: v[order] for c, v in r.items()}
        f32 = np.float32
        with np.errstate(over="ignore"):
            ratio = np.exp(r["logprob"] - r["old_logprob"]).astype(f32).tolist()
        cols: dict[str, list] = {
            "step": [step] * len(order),
            "update": r["update"].tolist(),
            "seq": r["seq"].tolist(),
            "pos": r["pos"].tolist(),
            "token_id": r["token_id"].tolist(),
            "prob": np.exp(r["old_logprob"]).astype(f32).tolist(),
            "ratio": ratio,
            "advantage": r["advantage"].tolist(),
            "quadrant": [QUADRANT_NAMES[int(q)] for q in r["quadrant"]],
            "clip": r["clip"].tolist(),
            "clipped": r["clipped"].tolist(),
        }
        none = [None] * len(order)
        cols["entropy"] = r["entropy"].tolist() if "entropy" in r else none
        cols["entropy_ratio"] = (
            ((r["entropy"] + f32(1e-8)) / (r["old_entropy"] + f32(1e-8))).tolist()
            if "entropy" in r and "old_entropy" in r
            else none
        )
        cols["erc_kept"] = r["erc_kept"].tolist() if "erc_kept" in r else none
        return TokenTable(TABLE_COLUMNS, [list(row) for row in zip(*(cols[c] for c in TABLE_COLUMNS))])


class StepTable:
    def __init__(self) -> None:
        self._rows: dict[tuple[int, int], dict[str, Any]] = {}  # (step, update) -> values
        self._step_scalars: dict[int, dict[str, Any]] = {}  # step -> values shared by its rows
        self._rewards: dict[int, tuple[float, int]] = {}  # step -> (sum of rewards, count)
        self._entropy_ratios: dict[int, list[np.ndarray]] = {}  # step -> every token's rho, per update
        # step -> [counts [5, HIST_BINS] int64 (rho, then r per quadrant), sums [5, 2] float64 (sum, sum of squares)]
        self._histograms: dict[int, list[np.ndarray]] = {}
        self._has_rho: set[int] = set()  # steps whose updates had entropies (an entropy-ratio histogram)
        self._samples: dict[int, _Sample] = {}  # table steps -> their token sample
        # sequences rows no update has trained yet (their tokens would join nothing): a row of step s is
        # trained by an update at step s or later (TRL records a generation's sequences before the steps that
        # train them); seq id -> the steps of its untrained rows, UNTRAINED_CAP rows at most (then counted)
        self._trained: dict[int, set] = {}  # open step -> seq ids of its updates' rows with a token
        self._untrained: dict[int, list[int]] = {}
        self._n_untrained = 0  # rows in _untrained
        self.untrained_over = 0  # untrained rows past the cap, counted only

    def add_aggregates(self, step: int, update: int, aggregates: dict[str, float]) -> None:
        row = self._rows.setdefault((step, update), {})
        for name, value in aggregates.items():
            row.setdefault(name, value)

    def add_trained(self, step: int, seq: np.ndarray) -> None:
        """The seq ids of an update's rows with a masked-in token: they train the sequences rows of ``step``
        and of earlier steps with these ids."""
        ids = set(seq.tolist())
        self._trained.setdefault(step, set()).update(ids)
        for i in ids & self._untrained.keys():
            later = [s for s in self._untrained[i] if s > step]
            self._n_untrained -= len(self._untrained[i]) - len(later)
            if later:
                self._untrained[i] = later
            else:
                del self._untrained[i]

    def add_sequence_rows(self, step: int, seq: np.ndarray) -> None:
        """A record_sequences call's seq ids at ``step``: those no update of this step has trained so far wait
        for one (:meth:`untrained`)."""
        new = set(seq.tolist())
        for s, ids in self._trained.items():
            if s >= step:
                new -= ids
        for i in sorted(new):
            if self._n_untrained >= UNTRAINED_CAP:
                self.untrained_over += 1
                continue
            self._untrained.setdefault(i, []).append(step)
            self._n_untrained += 1

    def untrained(self) -> list[tuple[int, int]]:
        """(step, seq id) of the sequences rows no update at their step or later has trained (so far),
        by step and id; more beyond them where :attr:`untrained_over` > 0."""
        return sorted((s, i) for i, steps in self._untrained.items() for s in steps)

    def add_entropy_ratios(self, step: int, ratios: np.ndarray) -> None:
        self._entropy_ratios.setdefault(step, []).append(ratios)

    def add_histograms(self, step: int, rho: np.ndarray | None, r: np.ndarray, quadrant: np.ndarray) -> None:
        """Count one update's tokens into the step's histograms: rho (None: no entropies), and r by
        quadrant (codes 1..4; ZA tokens are in no ratio histogram). One bincount each: no arrays kept."""
        counts, sums = self._histograms.setdefault(
            step, [np.zeros((len(HISTOGRAMS), HIST_BINS), np.int64), np.zeros((len(HISTOGRAMS), 2))]
        )
        if rho is not None:
            self._has_rho.add(step)
            counts[0] += np.bincount(bin_index(rho), minlength=HIST_BINS)
            x = rho.astype(np.float64)
            sums[0] += (x.sum(), np.dot(x, x))
        q = quadrant.astype(np.intp)  # the histogram row: quadrant code 1..4 (row 0 of the bincount: ZA, dropped)
        by_q = np.bincount(q * HIST_BINS + bin_index(r), minlength=len(HISTOGRAMS) * HIST_BINS)
        counts[1:] += by_q.reshape(len(HISTOGRAMS), HIST_BINS)[1:]
        x = r.astype(np.float64)
        with np.errstate(over="ignore", invalid="ignore"):  # an r that overflowed to inf: its sums are inf
            sums[1:, 0] += np.bincount(q, weights=x, minlength=len(HISTOGRAMS))[1:]
            sums[1:, 1] += np.bincount(q, weights=x * x, minlength=len(HISTOGRAMS))[1:]

    def add_sample(self, step: int, update: int, host, k: int = TABLE_ROWS) -> None:
        """Offer one update's token rows to the step's table sample (k rows at most)."""
        self._samples.setdefault(step, _Sample()).add(step, update, host, k)

    def histograms(self, step: int) -> dict[str, StepHistogram]:
        """The step's histograms so far (a copy), by HISTOGRAMS name; one without tokens is left out."""
        if step not in self._histograms:
            return {}
        counts, sums = self._histograms[step]
        return {
            name: StepHistogram(counts[i].copy(), float(sums[i, 0]), float(sums[i, 1]))
            for i, name in enumerate(HISTOGRAMS)
            if counts[i].any() and (i or step in self._has_rho)
        }

    def add_update_scalars(self, step: int, update: int, values: dict[str, Any]) -> None:
        self._rows.setdefault((step, update), {}).update(values)

    def add_step_scalars(self, step: int, values: dict[str, Any]) -> None:
        self._step_scalars.setdefault(step, {}).update(values)

    def add_rewards(self, step: int, total: float, count: int) -> None:
        old_total, old_count = self._rewards.get(step, (0.0, 0))
        self._rewards[step] = (old_total + total, old_count + count)

    def close(self, upto: int | None) -> list[tuple[int, list[dict[str, Any]]]]:
        """Take the rows of every step <= upto (all steps when None) out of the table, in step
        order: [(step, rows)], one row per update (update 0 alone when only step scalars exist)."""
        steps = sorted({s for s, _ in self._rows} | set(self._step_scalars) | set(self._rewards))
        out = []
        for step in [s for s in self._trained if upto is None or s <= upto]:
            del self._trained[step]  # no sequences row of a closed step can come any more
        for step in steps:
            if upto is not None and step > upto:
                continue
            self._entropy_ratios.pop(step, None)
            self._histograms.pop(step, None)
            self._has_rho.discard(step)
            self._samples.pop(step, None)
            shared = self._step_scalars.pop(step, {})
            reward_sum, reward_count = self._rewards.pop(step, (0.0, 0))
            if reward_count > 0:
                shared.setdefault("reward_mean", reward_sum / reward_count)
            updates = sorted(u for s, u in self._rows if s == step) or [0]
            rows = [{"update": u, **shared, **self._rows.pop((step, u), {})} for u in updates]
            out.append((step, rows))
        return out

    def summary(self, step: int, names: tuple[str, ...] | None = None) -> dict[str, float]:
        """The step's aggregates over the updates of ``step`` so far: n_* counts summed, the entropy-ratio
        quantiles over all the step's tokens (linear interpolation, as torch.quantile), a *_max the maximum, the other
        aggregates token-weighted means of the updates' (NaN, i.e. not measured, left out); the mismatch means
        weighted by the count each is over (:data:`MEAN_WEIGHTS`: the tokens with a sampler log-prob, the clipped
        ones among them for clipped_mismatched_frac), not by n_tokens.
        ``names``: only these aggregates (and n_tokens); with HISTOGRAMS_KEY among them also the step's
        histograms (:meth:`histograms`, under that key), with TABLE_KEY its token table where the step has
        one (a :class:`TokenTable`; never without ``names``). Empty once closed."""
        rows = [r for (s, _), r in self._rows.items() if s == step and "n_tokens" in r]
        n_tokens = sum(r["n_tokens"] for r in rows)
        out: dict[str, float] = {"n_tokens": float(n_tokens)}
        if not rows or n_tokens == 0:
            return out
        if names is not None and HISTOGRAMS_KEY in names and step in self._histograms:
            out[HISTOGRAMS_KEY] = self.histograms(step)  # type: ignore[assignment]
        if names is not None and TABLE_KEY in names and step in self._samples:
            table = self._samples[step].table(step)
            if table is not None:
                out[TABLE_KEY] = table  # type: ignore[assignment]
        for name in AGG_NAMES:
            if name == "n_tokens" or (names is not None and name not in names):
                continue
            if name in SAMPLER_COUNTS:  # null without sampler log-probs: left out, as the means they weigh
                vals = [r[name] for r in rows if r.get(name) is not None and r[name] == r[name]]
                if vals:
                    out[name] = float(sum(vals))
                continue
            if name.startswith("n_"):
                out[name] = float(sum(r[name] for r in rows))
                continue
            if name.endswith("_max"):  # a maximum over the step's updates, not a mean
                vals = [r[name] for r in rows if r.get(name) is not None and r[name] == r[name]]
                if vals:
                    out[name] = max(vals)
                continue
            w = MEAN_WEIGHTS.get(name, "n_tokens")
            pairs = [
                (r[name], r[w])
                for r in rows
                if r.get(name) is not None and r[name] == r[name] and r.get(w) is not None and r[w] == r[w]
            ]
            weight = sum(n for _, n in pairs)
            if weight:
                out[name] = sum(v * n for v, n in pairs) / weight
        ratios = self._entropy_ratios.get(step)
        if ratios and (names is None or any(name in names for name in QUANTILES)):
            every = np.concatenate(ratios)
            if len(every):  # one sort for the three quantiles
                values = np.quantile(every.astype(np.float64), list(QUANTILES.values()))
                out.update((k, v) for k, v in zip(QUANTILES, values.tolist()) if names is None or k in names)
        return out
