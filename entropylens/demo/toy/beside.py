"""The papers' numbers beside the lab's: measured from the recorded runs, with where the toy differs.

- Token-entropy shares (Wang et al. 2025, "Beyond the 80/20 Rule", arXiv 2506.01939): in Qwen3-8B's
  chain-of-thought tokens the 80th percentile of token entropy is 0.672 nats (20% of tokens lie above
  it) and about half the tokens have entropy below 0.01. The lab measures, per run, over the distinct
  response tokens (each (step, seq, pos) once, H = old_entropy, the sampling policy's, full vocabulary)
  of the first step and of the last 5 steps: the share above 0.672, the share below 0.01 and the 80th
  percentile; then mean and sd over each method's seeds. Where a run recorded the top-entropy mask
  (``token_kept``), also the share of tokens kept.
- Cui et al. 2025 (arXiv 2505.22617), through the report's own per-run tables (entropylens.report.covlaw):
  the covariance law dH ~ -eta Cov(log pi, A) (per run: the Pearson r of -Cov and the measured entropy
  change per step, and the share of steps where their signs agree), the quadrant signs of the law, and the
  entropy-performance fit R = -a exp(H) + b (per run a, b, R^2, RMSE and b - a, the reward the fit
  predicts at H = 0). Mean and sd over each method's seeds whose fit is meaningful (covlaw.MIN_STEPS).
- The training-inference mismatch (the TIS blog, Yao et al. 2025): per run, over its steps, the clipped
  share, the sampler-trainer KL (k3), mean |delta log p|, and the mismatched share of the clipped tokens and
  of the others (analyses mismatch_by_step, mismatch_shares_by_step); per method mean and sd over seeds,
  and Welch tests of the mismatched runs against the baseline and of TIS against no correction.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

FORKING_PAPER = dict(
    p80=0.672,
    above=0.20,
    below=0.5,
    text="Wang et al. 2025 (arXiv 2506.01939), Qwen3-8B chain-of-thought tokens: 80th percentile "
    "of token entropy 0.672 nats (20% of tokens above it), about half the tokens below 0.01; "
    "the 80/20 rule keeps the policy gradient of the top 20% only",
)
HIGH, LOW = FORKING_PAPER["p80"], 0.01

_SHARES = f"""
WITH last AS (SELECT run, max(step) AS s FROM steps GROUP BY run),
tok AS (
    SELECT t.run, t.step, t.seq, t.pos, any_value(t.old_entropy) AS h
    FROM tokens AS t JOIN last USING (run)
    WHERE t.step = 0 OR t.step > last.s - 5
    GROUP BY t.run, t.step, t.seq, t.pos
),
parts AS (
    SELECT run, 'first' AS part, h FROM tok WHERE step = 0
    UNION ALL
    SELECT tok.run, 'last' AS part, h FROM tok JOIN last USING (run) WHERE tok.step > last.s - 5
)
SELECT run, part, count(*) AS tokens, avg(CAST(h > {HIGH} AS DOUBLE)) AS above,
       avg(CAST(h < {LOW} AS DOUBLE)) AS below, quantile_cont(h, 0.8) AS p80
FROM parts WHERE h IS NOT NULL GROUP BY run, part ORDER BY run, part
"""


def _ms(xs) -> list[float]:
    xs = [float(x) for x in xs if x is not None and not math.isnan(float(x))]
    if not xs:
        return [math.nan, math.nan]
    return [statistics.fmean(xs), statistics.stdev(xs) if len(xs) > 1 else 0.0]


def token_entropy_shares(con, config_of: dict[str, str]) -> dict[str, dict]:
    """{method: {"first" / "last": {"above", "below", "p80": [mean, sd] over seeds, "tokens": per run},
    "kept": [mean, sd] or absent}} from the connection's runs; ``config_of``: run -> method."""
    per: dict[str, dict] = {}
    for run, part, tokens, above, below, p80 in con.execute(_SHARES).fetchall():
        if run not in config_of:
            continue
        d = per.setdefault(config_of[run], {}).setdefault(part, {"above": [], "below": [], "p80": [], "tokens": []})
        d["above"].append(above)
        d["below"].append(below)
        d["p80"].append(p80)
        d["tokens"].append(tokens)
    try:  # the top-entropy (80/20) mask, where a run recorded it
        kept = con.execute(
            "SELECT run, avg(CAST(token_kept AS DOUBLE)) FROM tokens WHERE token_kept IS NOT NULL GROUP BY run"
        ).fetchall()
    except Exception:  # noqa: BLE001 - runs recorded without the column
        kept = []
    kept_by: dict[str, list] = {}
    for run, share in kept:
        if run in config_of:
            kept_by.setdefault(config_of[run], []).append(share)
    out: dict[str, dict[str, Any]] = {}
    for name, parts in per.items():
        out[name] = {part: {k: (v if k == "tokens" else _ms(v)) for k, v in d.items()} for part, d in parts.items()}
        if name in kept_by:
            out[name]["kept"] = _ms(kept_by[name])
    return out


def _pct(ms) -> str:
    m, s = ms
    return "-" if m != m else f"{100 * m:.1f}% ± {100 * s:.1f}"


def _num(ms) -> str:
    m, s = ms
    return "-" if m != m else f"{m:.3f} ± {s:.3f}"


def shares_markdown(results: list[dict], label) -> list[str]:
    """The token-entropy shares of every regime's methods beside the 80/20 paper's (``label``: claims._label)."""
    have = [r for r in results if r.get("token_shares")]
    if not have:
        return []
    lines = [
        "## Token-entropy shares beside the 80/20 paper",
        "",
        f"Paper: {FORKING_PAPER['text']}. Ours: per run, the distinct response tokens of the first step and of "
        f"the last 5 steps (H of the sampling policy, full vocabulary), mean ± sd over the method's seeds; the "
        f"baseline and the runs that recorded a top-entropy mask (every method's shares: the regime's JSON).",
        "",
        f"| regime | method | first step: share above {HIGH} | below {LOW} | 80th percentile | last 5 steps: "
        f"share above {HIGH} | below {LOW} | 80th percentile | top-entropy mask: share kept |",
        "|---|---|---|---|---|---|---|---|---|",
        f"| paper (Qwen3-8B CoT) | - | {FORKING_PAPER['above']:.0%} | ~{FORKING_PAPER['below']:.0%} | "
        f"{FORKING_PAPER['p80']} | | | | 20% (the rule) |",
    ]
    for r in have:
        base = r.get("compare", {}).get("baseline")
        for name, d in r["token_shares"].items():
            if name != base and "kept" not in d:  # the baseline and the masked runs (every method: the JSON)
                continue
            f, la = d.get("first", {}), d.get("last", {})
            nan = [math.nan, math.nan]
            lines.append(
                f"| {label(r)} | {name} | {_pct(f.get('above', nan))} | {_pct(f.get('below', nan))} | "
                f"{_num(f.get('p80', nan))} | {_pct(la.get('above', nan))} | {_pct(la.get('below', nan))} | "
                f"{_num(la.get('p80', nan))} | {_pct(d['kept']) if 'kept' in d else '-'} |"
            )
    first = next((d.get("first") for r in have for d in r["token_shares"].values() if d.get("first")), None)
    measured = (
        f" (here, at the first step: {_pct(first['above'])} above 0.672, {_pct(first['below'])} below 0.01, "
        f"80th percentile {_num(first['p80'])})"
        if first
        else ""
    )
    lines += [
        "",
        "Where the toy differs: a 32-token vocabulary, 16-token responses and a noisy supervised warm start "
        "make most of the toy's tokens uncertain at the start" + measured + ", while an LLM's reasoning trace "
        "is mostly near-certain tokens with a few forks. So the toy's shares describe its task, not a test of "
        "the paper; the mask's kept share is set by the rule itself.",
        "",
    ]
    return lines


CUI_PAPER = (
    "Cui et al. 2025 (arXiv 2505.22617): entropy falls where log pi and A covary (dH ~ -eta Cov(log pi, A), "
    "so -Cov and dH agree: r > 0); PA&HP and NA&LP tokens lower entropy, PA&LP and NA&HP raise it; the reward "
    "follows R = -a exp(H) + b with a > 0 (performance bought with entropy, a ceiling b - a at H = 0), fitted "
    "per model"
)


def cui_summary(con, config_of: dict[str, str]) -> dict[str, dict]:
    """{method: {"law_r", "same_sign", "a", "b", "r2", "rmse", "ceiling": [mean, sd] over the seeds whose fit is
    meaningful; "law_runs" / "fit_runs": how many; "runs": seeds; "quadrants": {q: [runs agreeing with the
    law's sign, runs with the quadrant]}}} from covlaw.tables (Cui et al.'s analyses)."""
    from ...report import covlaw

    t = covlaw.tables(con)
    out: dict[str, dict] = {}

    def slot(run):
        name = config_of.get(str(run))
        return None if name is None else out.setdefault(name, {"runs": 0, "law": [], "fit": [], "quadrants": {}})

    for run in config_of:
        if slot(run) is not None:
            out[config_of[run]]["runs"] += 1
    for r in t["law"].itertuples():
        d = slot(r.run)
        if d is not None and r.meaningful:
            d["law"].append((r.corr, r.same_sign))
    for r in t["fit"].itertuples():
        d = slot(r.run)
        if d is not None and r.meaningful:
            d["fit"].append((r.a, r.b, r.r2, r.rmse, r.b - r.a))
    for r in t["quadrants"].itertuples():
        d = slot(r.run)
        if d is not None:
            k = d["quadrants"].setdefault(r.quadrant, [0, 0])
            k[0] += bool(r.agrees)
            k[1] += 1
    res = {}
    for name, d in out.items():
        law, fit = d["law"], d["fit"]
        res[name] = {
            "runs": d["runs"],
            "law_runs": len(law),
            "fit_runs": len(fit),
            "quadrants": d["quadrants"],
            "law_r": _ms([x[0] for x in law]),
            "same_sign": _ms([x[1] for x in law]),
            **{k: _ms([x[i] for x in fit]) for i, k in enumerate(("a", "b", "r2", "rmse", "ceiling"))},
        }
    return res


def cui_markdown(results: list[dict], label) -> list[str]:
    """Cui et al.'s laws on every regime's methods beside the paper's claims (``label``: claims._label)."""
    have = [r for r in results if r.get("cui")]
    if not have:
        return []
    from ...report.covlaw import MIN_STEPS, QUADRANTS

    lines = [
        "## Cui et al.'s covariance law and entropy-performance fit",
        "",
        f"Paper: {CUI_PAPER}.",
        "",
        "Ours: entropylens' analyses `covariance_law_by_step`, `covariance_by_quadrant` and "
        "`entropy_performance_fit` on each run (the report's Cui et al. section), mean ± sd over the seeds "
        f"whose fit is meaningful ({MIN_STEPS}+ steps; n in the table). Quadrants: runs whose summed covariance "
        "has the law's sign, of the runs with that quadrant.",
        "",
        "| regime | method | law: r of -Cov and dH (n) | same sign | "
        + " | ".join(QUADRANTS)
        + " | fit: a | b | R^2 | RMSE | b - a (R at H = 0) | n |",
        "|---|---|---|---|" + "---|" * len(QUADRANTS) + "---|---|---|---|---|---|",
    ]
    below = []
    for r in have:
        lab = [row["method"] for row in r.get("compare", {}).get("rows", [])]  # the methods table's order
        order = [n for n in lab if n in r["cui"]] + [n for n in r["cui"] if n not in lab]
        for name in order:
            d = r["cui"][name]
            q = d.get("quadrants", {})
            lines.append(
                f"| {label(r)} | {name} | {_num(d['law_r'])} ({d['law_runs']}) | {_pct(d['same_sign'])} | "
                + " | ".join(f"{q[x][0]}/{q[x][1]}" if x in q else "-" for x in QUADRANTS)
                + f" | {_num(d['a'])} | {_num(d['b'])} | {_num(d['r2'])} | {_num(d['rmse'])} | "
                f"{_num(d['ceiling'])} | {d['fit_runs']} |"
            )
            if d["law_runs"] and not d["law_r"][0] > 0:
                below.append(f"{name} ({r['regime']})")
    lines.append("")
    if below:
        lines += ["Here this differs from the law: the mean r is not above 0 for " + ", ".join(below) + ".", ""]
    lines += [
        "Where the toy differs: Adam and shared parameters blur the law's step size eta (fitted per run, so "
        "only r and the signs are compared); the toy's reward is the share of a 16-token answer's positions "
        "that are right, not a pass rate, and its runs are short, so a and b describe the toy's own trade, not the paper's "
        "models; the paper fits a and b per model and reports no single pair to set beside these.",
        "",
    ]
    return lines


MISMATCH_MEASURES = ("clipped", "kl_k3", "mean_abs", "clipped_mm", "other_mm")


def mismatch_summary(con, config_of: dict[str, str]) -> dict[str, dict]:
    """{method: {measure: per-seed values}} for every method of ``config_of`` (run -> method), measures per run:
    clipped = the clipped share of its tokens (steps, pooled by n_tokens), and the means over its steps of
    kl_k3 (KL(pi_sampler || pi_old), k3), mean_abs (|old_logprob - sampler_logprob|), clipped_mm and other_mm
    (the mismatched share, |delta| > ln 2 or masked, of the clipped tokens and of the others). The mismatch
    measures are NaN for a run without sampler log-probs."""
    from ...read.query import run_analysis

    clipped = dict(
        con.execute(
            "SELECT run, sum(clipped_frac * n_tokens) / nullif(sum(n_tokens), 0) FROM steps "
            "WHERE n_tokens > 0 GROUP BY run"
        ).fetchall()
    )
    by = (
        run_analysis(con, "mismatch_by_step")
        .groupby("run")[["kl_k3", "mean_abs_log_ratio", "clipped_mismatched_frac"]]
        .mean()
    )
    sh = run_analysis(con, "mismatch_shares_by_step").groupby("run")["unclipped_mismatched_frac"].mean()
    out: dict[str, dict] = {}
    for run, name in config_of.items():
        d = out.setdefault(name, {k: [] for k in MISMATCH_MEASURES})
        row = by.loc[run] if run in by.index else None
        vals = (
            clipped.get(run),
            None if row is None else row["kl_k3"],
            None if row is None else row["mean_abs_log_ratio"],
            None if row is None else row["clipped_mismatched_frac"],
            sh.get(run),
        )
        for k, v in zip(MISMATCH_MEASURES, vals):
            d[k].append(math.nan if v is None or v != v else float(v))
    return out


def mismatch_markdown(results: list[dict], label) -> list[str]:
    """What the toy's mismatched sampler did, with and without TIS, beside the baseline, per regime: the
    mismatch measures (mean ± sd over seeds) and two-sided Welch tests (mismatch against the baseline, TIS
    against no correction) on the clipped share and the final entropy (``label``: claims._label)."""
    from . import rules

    have = [
        r
        for r in results
        if r.get("mismatch") and any(any(x == x for x in d.get("kl_k3", [])) for d in r["mismatch"].values())
    ]
    if not have:
        return []
    lines = [
        "## Training-inference mismatch in the lab",
        "",
        "The TIS blog (Yao et al. 2025) and the trainers that adopted it (verl's rollout correction, TRL's "
        "vllm_importance_sampling_correction): a sampler whose probabilities differ from the trainer's makes "
        "PPO's update off-policy without the ratio seeing it; truncated importance sampling (TIS) reweights each "
        "token by min(pi_old / pi_sampler, C). Ours: the toy's sampler at 1.5x the trainer's temperature "
        "(`grpo_mismatch`), the same with TIS at C = 2 (`grpo_mismatch_tis`), beside the baseline. Per run, "
        "over its steps: the clipped share, KL(pi_sampler || pi_old) by k3, mean |delta log p|, and the "
        "mismatched share (|delta log p| > ln 2) of the clipped tokens and of the others; mean ± sd over seeds.",
        "",
        "| regime | method | final entropy | clipped share | sampler KL (k3) | mean abs d log p "
        "| clipped tokens mismatched | other tokens mismatched |",
        "|---|---|---|---|---|---|---|---|",
    ]
    tests = []
    for r in have:
        base = r.get("compare", {}).get("baseline")
        rows = {row["method"]: row for row in r.get("compare", {}).get("rows", [])}
        mm = r["mismatch"]
        shown = [n for n in mm if n == base or any(x == x for x in mm[n]["kl_k3"])]
        for name in shown:
            d = mm[name]
            lines.append(
                f"| {label(r)} | {name} | {rows.get(name, {}).get('h_final', '-')} | {_num(_ms(d['clipped']))} "
                f"| {_num(_ms(d['kl_k3']))} | {_num(_ms(d['mean_abs']))} | {_pct(_ms(d['clipped_mm']))} "
                f"| {_pct(_ms(d['other_mm']))} |"
            )
        h = r.get("h_final", {})
        pairs = [(n, base) for n in shown if n != base and not n.endswith("_tis")]
        pairs += [(n, n[: -len("_tis")]) for n in shown if n.endswith("_tis") and n[: -len("_tis")] in mm]
        for a, b in pairs:
            for what, xa, xb in (
                ("clipped share", mm[a]["clipped"], mm[b]["clipped"]),
                ("final entropy", h.get(a, []), h.get(b, [])),
            ):
                w = rules.welch_two_sided(xa, xb)
                tests.append(f"- {label(r)}, {what}, {a} against {b}: {w.text()}")
    gaps = [m for r in have for n, d in r["mismatch"].items() for m in [_ms(d["mean_abs"])[0]] if m == m]
    gap = f" (mean |d log p| {min(gaps):.2f} to {max(gaps):.2f} nats here)" if gaps else ""
    lines += [
        "",
        "Welch tests (two-sided, 5%, no correction for the number of tests; final entropy over the stable seeds):",
        "",
        *tests,
        "",
        f"Where the toy differs: its mismatch is a temperature, large and the same at every token{gap}, "
        "while vLLM's bf16 mismatch is small on most tokens with rare large outliers; "
        "the blog's collapse appears over thousands of steps of long responses, the toy's runs are "
        "120-200 steps.",
        "",
    ]
    return lines


__all__ = [
    "FORKING_PAPER",
    "CUI_PAPER",
    "token_entropy_shares",
    "shares_markdown",
    "cui_summary",
    "cui_markdown",
    "mismatch_summary",
    "mismatch_markdown",
]
