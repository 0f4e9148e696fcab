"""The steps table in the making: one row per (step, update) until the step is closed.

A row gathers the update's exact aggregates (tokenbatch.step_aggregates), the scalars recorded for
that update (grad norm, lr, settings) and the step's own scalars (reward mean, ...), which every
update row of the step carries. Pure host bookkeeping: no I/O, no threads (the writer thread owns
one table).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .tokenbatch import AGG_NAMES

QUANTILES = {"entropy_ratio_p05": 0.05, "entropy_ratio_p50": 0.5, "entropy_ratio_p95": 0.95}


class StepTable:
    def __init__(self) -> None:
        self._rows: dict[tuple[int, int], dict[str, Any]] = {}  # (step, update) -> values
        self._step_scalars: dict[int, dict[str, Any]] = {}  # step -> values shared by its rows
        self._rewards: dict[int, tuple[float, int]] = {}  # step -> (sum of rewards, count)
        self._entropy_ratios: dict[int, list[np.ndarray]] = {}  # step -> every token's rho, per update

    def add_aggregates(self, step: int, update: int, aggregates: dict[str, float]) -> None:
        row = self._rows.setdefault((step, update), {})
        for name, value in aggregates.items():
            row.setdefault(name, value)

    def add_entropy_ratios(self, step: int, ratios: np.ndarray) -> None:
        self._entropy_ratios.setdefault(step, []).append(ratios)

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
        for step in steps:
            if upto is not None and step > upto:
                continue
            self._entropy_ratios.pop(step, None)
            shared = self._step_scalars.pop(step, {})
            reward_sum, reward_count = self._rewards.pop(step, (0.0, 0))
            if reward_count > 0:
                shared.setdefault("reward_mean", reward_sum / reward_count)
            updates = sorted(u for s, u in self._rows if s == step) or [0]
            rows = [{"update": u, **shared, **self._rows.pop((step, u), {})} for u in updates]
            out.append((step, rows))
        return out

    def summary(self, step: int, names: "tuple[str, ...] | None" = None) -> dict[str, float]:
        """The step's aggregates over the updates of ``step`` so far: n_* counts summed, the entropy-ratio
        quantiles over all the step's tokens (linear interpolation, as torch.quantile), the other
        aggregates token-weighted means of the updates' (NaN, i.e. not measured, left out).
        ``names``: only these aggregates (and n_tokens). Empty once closed."""
        rows = [r for (s, _), r in self._rows.items() if s == step and "n_tokens" in r]
        n_tokens = sum(r["n_tokens"] for r in rows)
        out: dict[str, float] = {"n_tokens": float(n_tokens)}
        if not rows or n_tokens == 0:
            return out
        for name in AGG_NAMES:
            if name == "n_tokens" or (names is not None and name not in names):
                continue
            if name.startswith("n_"):
                out[name] = float(sum(r[name] for r in rows))
                continue
            pairs = [(r[name], r["n_tokens"]) for r in rows if r.get(name) is not None and r[name] == r[name]]
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
