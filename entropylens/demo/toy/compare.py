"""Every method a claims regime ran, against a baseline: the table a reader can trust.

One line a method: what it does and its paper (toy/methods.py), the loss settings its runs used (read
from each run's recorded config, the method's defaults resolved), what differs from the baseline's
settings (loss and training), final entropy over the stable seeds (a destabilised seed never counts as
entropy kept), final / initial entropy, final reward over all seeds (a blow-up's reward counts against
its method), the destabilised seeds, and Welch tests against the baseline on final entropy and final
reward.

The tests are two-sided (a control may move entropy or reward either way, and the direction is not
fixed before the runs): t = (mean_m - mean_base) / sqrt(v_m / n_m + v_base / n_base), Welch-Satterthwaite
df, p = 2 P(T_df > |t|) (rules.welch_two_sided), at 5%. A table of M methods holds 2 (M - 1) tests, so
about 0.1 (M - 1) would pass at 5% by chance alone: each cell also says whether it holds after Holm's
correction over the whole table (rules.holm: family-wise error at most 5%).
"""

from __future__ import annotations

import math
import statistics
from typing import Any

from . import methods, rules

BASELINE = "grpo"


def _ms(xs) -> tuple[float, float]:
    xs = [float(x) for x in xs if x is not None and not math.isnan(float(x))]
    if not xs:
        return math.nan, math.nan
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def _fmt(xs, digits: int = 3) -> str:
    m, s = _ms(xs)
    return "not measured" if math.isnan(m) else f"{m:.{digits}f} ± {s:.{digits}f}"


def _stable(d: dict, key: str) -> list[float]:
    return [v for v, bad in zip(d.get(key, []), d.get("destabilised", [])) if not bad and v is not None]


def _ratios(d: dict) -> list[float]:
    return [
        hf / h0
        for hf, h0, bad in zip(d.get("h_final", []), d.get("h0", []), d.get("destabilised", []))
        if not bad and h0
    ]


def _settings_of(d: dict) -> tuple[dict, bool]:
    """The method's settings (its first seed's) and whether every seed used the same ones."""
    seen = [s for s in d.get("settings", []) if s is not None]
    if not seen:
        return {}, True
    return seen[0], all(s == seen[0] for s in seen)


def _verdict(w: rules.Welch, holm_ok: bool) -> str:
    if w.n_a < 2 or w.n_b < 2:
        return "too few seeds"
    if not w.holds:
        return "no difference at 5%"
    return ("higher" if w.diff > 0 else "lower") + (" (holds after Holm)" if holm_ok else " (not after Holm)")


def method_rows(agg: dict[str, dict[str, list]], baseline: str = BASELINE, order=None) -> list[dict]:
    """One row a method of ``agg`` (claims.by_config: per method, per measure, the per-seed values;
    "settings" per seed from methods.settings of its run.json config). ``order``: the methods' order
    (default: agg's, baseline first). Each row: method, description, paper, toy, settings (the loss
    settings, text), training (the training settings), differs (text; the baseline's: "baseline"),
    same_settings (every seed used the same), seeds, stable, h_final, h_ratio, r_final, destabilised,
    and for every row but the baseline's: entropy_test / reward_test (rules.Welch, two-sided: method
    minus baseline), entropy_verdict / reward_verdict (with Holm over all the table's tests)."""
    names = [n for n in (order or agg) if n in agg]
    if baseline in names:
        names = [baseline] + [n for n in names if n != baseline]
    base = agg.get(baseline, {})
    base_settings, _ = _settings_of(base)
    rows = []
    for name in names:
        d = agg[name]
        try:
            entry = methods.lookup(name)
            desc, paper, toy = entry.description, entry.paper, entry.toy
        except ValueError:  # a run recorded under a name the registry no longer has
            desc, paper, toy = "not in the registry", "", ""
        mine, same = _settings_of(d)
        loss = methods.loss_part(mine)
        flags = d.get("destabilised", [])
        row: dict[str, Any] = dict(
            method=name,
            description=desc,
            paper=paper,
            toy=toy,
            settings=", ".join(f"{k} {v}" for k, v in loss.items()),
            training=", ".join(f"{k} {v}" for k, v in mine.items() if k not in loss),
            differs=(
                "baseline"
                if name == baseline
                else methods.differs_text(mine, base_settings, baseline)
                if base_settings
                else f"no {baseline} runs to compare with"
            ),
            same_settings=same,
            seeds=len(flags),
            stable=len(flags) - sum(bool(x) for x in flags),
            h_final=_fmt(_stable(d, "h_final")),
            h_ratio=_fmt(_ratios(d), 2),
            r_final=_fmt(d.get("r_final", [])),
            destabilised=f"{sum(bool(x) for x in flags)}/{len(flags)}",
        )
        if name != baseline:
            row["entropy_test"] = rules.welch_two_sided(_stable(d, "h_final"), _stable(base, "h_final"))
            row["reward_test"] = rules.welch_two_sided(d.get("r_final", []), base.get("r_final", []))
        rows.append(row)
    tests = [(r, k) for r in rows for k in ("entropy_test", "reward_test") if k in r]
    testable = [(r, k) for r, k in tests if r[k].n_a >= 2 and r[k].n_b >= 2]
    held = dict(zip([(id(r), k) for r, k in testable], rules.holm([r[k].p for r, k in testable])))
    for r, k in tests:
        r[k.replace("_test", "_verdict")] = _verdict(r[k], held.get((id(r), k), False))
    return rows


def n_tests(rows: list[dict]) -> int:
    """The table's tests that had two seeds or more on each side (the m of Holm's correction)."""
    return sum(1 for r in rows for k in ("entropy_test", "reward_test") if k in r and r[k].n_a >= 2 and r[k].n_b >= 2)


def as_json(rows: list[dict]) -> list[dict]:
    """Rows with each test as its numbers (diff, t, df, p, n_a, n_b, sides) and its text."""
    out = []
    for r in rows:
        r = dict(r)
        for k in ("entropy_test", "reward_test"):
            if k in r:
                w = r[k]
                r[k] = dict(diff=w.diff, t=w.t, df=w.df, p=w.p, n_a=w.n_a, n_b=w.n_b, sides=w.sides, text=w.text())
        out.append(r)
    return out


def _cell(r: dict, k: str) -> str:
    if k not in r:
        return "(baseline)"
    w = r[k]
    verdict = r[k.replace("_test", "_verdict")]
    if w.get("n_a", 0) < 2 or w.get("n_b", 0) < 2:
        return verdict
    return f"{verdict}: {w['diff']:+.3f}, p = {w['p']:.3f}"


def markdown(rows: list[dict], baseline: str = BASELINE) -> list[str]:
    """The table's lines (rows as :func:`as_json` gives them)."""
    lines = [
        f"| method | loss settings | what differs from {baseline} | final entropy (stable seeds) | "
        f"final / initial entropy | final reward (all seeds) | destabilised | final entropy vs {baseline} | "
        f"final reward vs {baseline} |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        warn = "" if r["same_settings"] else " **(seeds used different settings)**"
        lines.append(
            f"| {r['method']} | {r['settings']}{warn} | {r['differs']} | {r['h_final']} (n = {r['stable']}) | "
            f"{r['h_ratio']} | {r['r_final']} (n = {r['seeds']}) | {r['destabilised']} | "
            f"{_cell(r, 'entropy_test')} | {_cell(r, 'reward_test')} |"
        )
    return lines


def legend(rows: list[dict]) -> list[str]:
    """'- **name**: what it does. Paper. Toy: where it differs.' per method."""
    return [
        f"- **{r['method']}**: {r['description']}."
        + (f" {r['paper']}." if r["paper"] else "")
        + (f" Toy: {r['toy']}." if r["toy"] else "")
        for r in rows
    ]


__all__ = ["BASELINE", "method_rows", "n_tests", "as_json", "markdown", "legend"]
