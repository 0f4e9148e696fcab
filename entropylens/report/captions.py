"""What THESE runs show, measured from the analysis a figure is drawn from, for the report's captions.

Each function takes the figure's DataFrame and the report's :class:`~entropylens.report.runset.RunSet` (the
runs' own settings, their series, whether they form a controlled comparison) and returns sentences
with numbers, one entry per series (a run, or a group of runs with ``--group-by``; at most
``runset.MAX_LISTED`` listed, then how many more). Thresholds (tau, eps, the ERC band, beta) are each
run's own. A claim that holds within one run ("the clipped tokens are mostly low-probability") is
checked per series; a verdict that compares methods ("CE-GPPO keeps entropy higher") is given only
when the runs differ in the method and nothing else the configs record; otherwise the caption names
what differs. Where a measurement goes against the paper it says so ("Here this differs from the
paper: ...").

Every function has the one signature ``fn(df, rs) -> str`` (``rs`` None: a RunSet made from the
frame's own run / method columns, for a frame outside a report); entropylens/report/figures.py names each
figure's function (its ``observe``). A function that raises is a bug: the report shows a row count
in its place and warns (figures.CaptionWarning), and the test suite fails on that warning.
"""

from __future__ import annotations

import math

from . import runset as rsmod
from .runset import MAX_LISTED, RunSet

LP = ("PA&LP", "NA&LP")
HP = ("PA&HP", "NA&HP")
_LAW = {"PA&HP": -1, "PA&LP": 1, "NA&HP": 1, "NA&LP": -1}  # covariance-law sign of each quadrant's effect


def _f(v, digits=3) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "n/a"
    return f"{v:.{digits}g}"


def _pct(v) -> str:
    return "n/a" if v is None or v != v else f"{100 * v:.1f}%"


def context(df, rs: RunSet | None) -> RunSet:
    """``rs``, or one made from the frame's own run / method columns (no settings known)."""
    if rs is not None:
        return rs
    import pandas as pd

    if "run" in df:
        runs = df[["run"] + (["method"] if "method" in df else [])].drop_duplicates("run")
    else:
        runs = pd.DataFrame({"run": ["all"], "method": ["?"]})
    return rsmod.build(runs.assign(config=None))


def series(df, rs: RunSet):
    """The frame's series column (the run's label; 'all' for a frame without runs)."""
    if "series" in df:
        return df["series"]
    if "run" in df:
        return df["run"].astype(str).map(lambda r: rs.series.get(r, r))
    return df.index.map(lambda _: "all")


def _by_series(df, rs: RunSet, fn) -> dict:
    """{series: fn(rows of that series)}, sorted by series."""
    return {s: fn(g) for s, g in df.groupby(series(df, rs), sort=True)}


def _listing(values: dict, show) -> str:
    """'a x; b y; c z' for at most MAX_LISTED series, then '; and N more'."""
    items = list(values.items())
    text = "; ".join(f"{s} {show(v)}" for s, v in items[:MAX_LISTED])
    return text + (f"; and {len(items) - MAX_LISTED} more series" if len(items) > MAX_LISTED else "")


def tau_text(rs_or_taus) -> str:
    """The HP / LP threshold as a caption says it: 'tau = 0.5', or per series where runs differ."""
    if isinstance(rs_or_taus, RunSet):
        return rs_or_taus.setting_text("tau") or "tau"
    vals = {r: float(v) for r, v in (rs_or_taus or {}).items() if v is not None and v == v}
    if not vals:
        return "tau"
    if len(set(vals.values())) == 1:
        return f"tau = {next(iter(vals.values())):g}"
    return "tau = " + ", ".join(f"{v:g} ({r})" for r, v in sorted(vals.items()))


def _lp_note(rs) -> str:
    t = tau_text(rs)
    return f" (LP: p < {t}, HP: p >= tau)" if "=" in t else f" (LP / HP split at {t})"


def _window(df, rs: RunSet) -> int:
    """The figure's smoothing window (plots.smooth_window of the most steps a series holds)."""
    from .plots import smooth_window

    if df.empty or "step" not in df:
        return 1
    return smooth_window(int(df.groupby(series(df, rs))["step"].nunique().max()))


def _smooth_note(df, rs: RunSet) -> str:
    """'Line: rolling mean of W steps over the faint per-step values.' when the figure smooths."""
    w = _window(df, rs)
    return f" Lines: centred rolling mean of {w} steps over the faint per-step values." if w > 1 else ""


def _steps_mean(g, col: str):
    """Per step, the mean over the series' runs of ``col`` (one run: its own values)."""
    return g.dropna(subset=[col]).groupby("step")[col].mean().sort_index()


def _tail(values, frac: float = 0.1) -> float:
    """Mean over the last ``frac`` of the steps (at least one step)."""
    if len(values) == 0:
        return float("nan")
    k = max(1, round(frac * len(values)))
    return float(values.iloc[-k:].mean())


LEVEL = 0.05  # a tail-entropy gap under 5% of the baseline's reads as level, not as "above"


def _verdict_ok(rs: RunSet) -> bool:
    return rs.controlled_in() == "method"


def _group_note(rs: RunSet) -> str:
    text = rs.band_text()
    return f" {text}" if text else ""


# ---------------------------------------------------------------------------------- step figures
def entropy(df, rs: RunSet | None = None) -> str:
    if df.empty or df["old_entropy"].isna().all():
        return "No steps recorded."
    rs = context(df, rs)
    per = _by_series(df, rs, lambda g: _steps_mean(g, "old_entropy"))
    per = {s: v for s, v in per.items() if len(v)}
    w = _window(df, rs)
    if w > 1:  # a long run: its ends as means over a window, not one noisy step each
        text = (
            f"Here, entropy, mean of the first -> last {w} steps (nats): "
            + _listing(per, lambda v: f"{_f(v.iloc[:w].mean())} -> {_f(v.iloc[-w:].mean())}")
            + "."
        )
    else:
        text = (
            "Here, entropy first -> last step (nats): "
            + _listing(per, lambda v: f"{_f(v.iloc[0])} -> {_f(v.iloc[-1])}")
            + "."
        )
    if len(per) < 2:
        return text + _smooth_note(df, rs) + _group_note(rs)
    tail = {s: _tail(v) for s, v in per.items()}
    text += " Mean over the last 10% of steps: " + _listing(tail, _f) + "."
    if _verdict_ok(rs):
        kinds = {s: {rs.method[r] for r in rs.runs_of(s)} for s in per}
        ce = [tail[s] for s, ms in kinds.items() if ms and all(m.startswith("ce_gppo") for m in ms)]
        base_of = {s: tail[s] for s, ms in kinds.items() if ms and ms <= {"grpo", "dapo"}}
        base = list(base_of.values())
        top = (
            max(base_of, key=lambda s: base_of[s]) if base_of else None
        )  # the higher of GRPO / DAPO: what CE-GPPO is compared with
        runs_per_method = min(list(rs.method.values()).count(m) for m in set(rs.method.values()))
        power = (
            " From one run per method: not a significance test."
            if runs_per_method < 2
            else f" ({runs_per_method}+ runs per method; no significance test here, see reports/paper-claims.md.)"
        )
        if ce and base:
            gap = min(ce) - max(base)
            if gap > LEVEL * max(base):
                text += (
                    f" The runs differ only in the method: CE-GPPO is above GRPO / DAPO, the paper's direction.{power}"
                )
            elif gap > 0:
                text += (
                    f" The runs differ only in the method. CE-GPPO's lowest is above the higher of GRPO / DAPO "
                    f"({top} {_f(base_of[top])}) by only {_f(gap)} nats (under {LEVEL:.0%}): level, not the "
                    f"paper's clear gap.{power}"
                )
            else:
                text += (
                    " The runs differ only in the method. Here this differs from the paper: CE-GPPO is not above "
                    f"the higher of GRPO / DAPO ({top} {_f(base_of[top])}).{power}"
                )
    elif rs.factors(replicates=False):
        text += " " + rs.differs_text()
    return text + _smooth_note(df, rs) + _group_note(rs)


def reward(df, rs: RunSet | None = None) -> str:
    if df.empty or df["reward"].isna().all():
        return "No rewards recorded."
    rs = context(df, rs)
    per = {s: v for s, v in _by_series(df, rs, lambda g: _steps_mean(g, "reward")).items() if len(v)}
    long = max(len(v) for v in per.values()) >= 20
    if long:
        return (
            "Here, mean reward over the last 10% of steps: "
            + _listing({s: _tail(v) for s, v in per.items()}, _f)
            + "."
            + _smooth_note(df, rs)
            + _group_note(rs)
        )
    return "Here, final-step reward: " + _listing({s: v.iloc[-1] for s, v in per.items()}, _f) + "." + _group_note(rs)


def _median_per_series(df, rs, col):
    return _by_series(df, rs, lambda g: _steps_mean(g, col).median() if g[col].notna().any() else float("nan"))


def grad_norm(df, rs: RunSet | None = None) -> str:
    bad = df["nonfinite"].fillna(0) > 0 if "nonfinite" in df else None  # steps with a NaN / inf update
    if df.empty or (df["grad_norm"].isna().all() and not (bad is not None and bad.any())):
        return "No gradient norms recorded."
    rs = context(df, rs)
    text = (
        "Here, median gradient norm per step: "
        + _listing(_median_per_series(df, rs, "grad_norm"), _f)
        + " (the paper's 0.05-0.10 is for a 1.5B model; the scale differs with the model)."
    )
    if bad is not None and bad.any():
        bad = df[bad].sort_values("step")
        first = bad.groupby(series(bad, rs), sort=True).agg(step=("step", "first"), n=("step", "size"))
        text += (
            " Updates with a NaN / inf norm (x in the figure; left out of the step mean): "
            + "; ".join(
                f"{s} at {int(r.n)} step{'s' if r.n != 1 else ''} from step {int(r.step)}" for s, r in first.iterrows()
            )
            + "."
        )
    return text + _smooth_note(df, rs) + _group_note(rs)


def kl(df, rs: RunSet | None = None) -> str:
    if df.empty or df["kl"].isnull().all():
        return "No KL recorded."
    rs = context(df, rs)
    return (
        "Here, median KL per step: "
        + _listing(_median_per_series(df, rs, "kl"), _f)
        + " (the paper reports ~1e-5 for its LLM)."
        + _smooth_note(df, rs)
        + _group_note(rs)
    )


def quadrant_share(df, rs: RunSet | None = None) -> str:
    if df.empty:
        return "No steps recorded."
    rs = context(df, rs)

    def shares(g):
        tot = g.groupby("quadrant")["tokens"].sum()
        return tot / tot.sum()

    per = _by_series(df, rs, shares)
    text = "Here, share of tokens over all steps: " + _listing(
        per,
        lambda sh: ", ".join(f"{q} {_pct(sh.get(q))}" for q in ("PA&HP", "PA&LP", "NA&HP", "NA&LP", "ZA") if q in sh),
    )
    return text + f"{_lp_note(rs)}." + _smooth_note(df, rs) + _group_note(rs)


def entropy_ratio(df, rs: RunSet | None = None) -> str:
    if df.empty:
        return "No entropy ratios recorded."
    rs = context(df, rs)
    lo_hi = "band_low" in df and "band_high" in df

    def one(g):
        out = (g["outside_band"] * g["tokens"]).sum() / g["tokens"].sum()
        band = (float(g["band_low"].iloc[0]), float(g["band_high"].iloc[0])) if lo_hi else rsmod.PAPER_ERC_BAND
        erc = None
        if "erc" in g:
            runs = g.drop_duplicates("run")
            k = int(runs["erc"].fillna(False).astype(bool).sum())
            erc = True if k == len(runs) else (False if k == 0 else f"ERC in {k} of {len(runs)} runs")
        return out, g["p50"].median(), band, erc

    per = _by_series(df, rs, one)

    def show(v):
        out, med, band, erc = v
        whose = "its ERC band" if erc is True else "no ERC; band" if erc is False else f"{erc}; band" if erc else "band"
        return f"{_pct(out)} outside ({whose} {rsmod.fmt(band)}; median rho {_f(med, 4)})"

    text = "Here, share of tokens outside the band: " + _listing(per, show) + "."
    if any(v[3] is False for v in per.values()):
        ref, whose = rs.reference_band()
        text += f" Runs without ERC are measured against {whose} {rsmod.fmt(ref)}."
    erc = [v[0] for v in per.values() if v[3] is True]
    plain = [v[0] for v in per.values() if v[3] is False]
    if erc and plain:
        if max(erc + plain) == 0:
            text += " No token left the band in any run: nothing to compare with the paper's claim."
        elif not _verdict_ok(rs):
            text += " " + rs.differs_text()
        elif max(erc) < min(plain):
            text += (
                " The runs differ only in the method: ERC runs keep more tokens inside the band, as the paper reports."
            )
        else:
            text += (
                " The runs differ only in the method. Here this differs from the paper: ERC runs do not keep "
                "more tokens inside the band."
            )
    return text + _smooth_note(df, rs) + _group_note(rs)


# ---------------------------------------------------------------------------------- token figures
def clip_by_quadrant(df, rs: RunSet | None = None) -> str:
    if df.empty:
        return "No token rows recorded."
    rs = context(df, rs)
    d = df[df["step"].isna()] if "step" in df else df

    def one(g):
        w = g.assign(c=g["clipped_frac"] * g["tokens"]).groupby("quadrant")[["c", "tokens"]].sum()

        def frac(qs):
            qs = [q for q in qs if q in w.index]
            n = sum(w.loc[q, "tokens"] for q in qs)
            return sum(w.loc[q, "c"] for q in qs) / n if n else float("nan")

        return frac(LP), frac(HP), float(w["c"].sum())

    per = _by_series(d, rs, one)
    text = (
        f"Here, share of tokens whose gradient PPO-clip removes, low-probability (p < {tau_text(rs)}) vs high: "
        + _listing(
            per,
            lambda v: (
                f"{_pct(v[0]) if v[0] == v[0] else 'no LP tokens'} vs {_pct(v[1]) if v[1] == v[1] else 'no HP tokens'}"
            ),
        )
        + f" ({_eps_text(rs)})."
    )
    if all(v[2] == 0 for v in per.values()):
        return text + " No token was clipped in these runs: nothing to compare with the paper's claim."
    against = [s for s, v in per.items() if v[2] > 0 and v[0] == v[0] and v[1] == v[1] and not v[0] > v[1]]
    if against:
        text += (
            " Here this differs from the paper ("
            + ", ".join(against[:MAX_LISTED])
            + "): low-probability tokens are not clipped more often."
        )
    return text + _group_note(rs)


def _eps_text(rs: RunSet) -> str:
    return "; ".join(t for t in (rs.setting_text("eps_low"), rs.setting_text("eps_high")) if t) or "eps as recorded"


def ratio_vs_prob(df, rs: RunSet | None = None) -> str:
    if df.empty:
        return "No token rows recorded."
    rs = context(df, rs)
    out = (df["ratio"] < 1 - df["eps_low"]) | (df["ratio"] > 1 + df["eps_high"])
    tau = df["run"].astype(str).map(lambda r: rs.setting(r, "tau")[0]).fillna(0.5) if "run" in df else 0.5
    d = df.assign(out=out, lp=df["prob"] < tau)

    def one(g):
        lp, hp = g[g["lp"]], g[~g["lp"]]
        return (lp["out"].mean() if len(lp) else float("nan"), hp["out"].mean() if len(hp) else float("nan"), len(g))

    per = _by_series(d, rs, one)
    text = (
        f"Here, tokens outside the clip interval ({_eps_text(rs)}), p < {tau_text(rs)} vs p >= tau: "
        + _listing(per, lambda v: f"{_pct(v[0])} vs {_pct(v[1])} ({v[2]} sampled tokens)")
        + "."
    )
    none = [s for s, v in per.items() if not (v[0] > 0 or v[1] > 0)]  # nothing left it: no claim to test
    against = [s for s, v in per.items() if s not in none and v[0] == v[0] and v[1] == v[1] and v[0] <= v[1]]
    if none:
        text += " No token left the interval in " + ", ".join(none[:MAX_LISTED]) + ": nothing to compare there."
    if against:
        text += (
            " Here this differs from the paper ("
            + ", ".join(against[:MAX_LISTED])
            + "): high-probability tokens leave the interval as often."
        )
    return text


def clipped_prob(df, rs: RunSet | None = None) -> str:
    if df.empty:
        return "No token was clipped."
    rs = context(df, rs)

    def one(g):
        res = {}
        for side in ("low", "high"):
            s = g[g["side"] == side]
            if s.empty:
                continue
            per_run = s.groupby("run").agg(n=("tokens", "sum"), lp=("lp_share", "first"))
            n = int(per_run["n"].sum())
            res[side] = (float((per_run["n"] * per_run["lp"]).sum() / n), n)
        return res

    per = _by_series(df, rs, one)
    text = (
        f"Here, share of the clipped tokens with p < {tau_text(rs)}: "
        + _listing(per, lambda v: ", ".join(f"{_pct(lp)} of {n} {side}-side" for side, (lp, n) in v.items()))
        + "."
    )
    against = [s for s, v in per.items() if v and max(lp for lp, _ in v.values()) <= 0.5]
    if against:
        text += (
            " Here this differs from the paper ("
            + ", ".join(against[:MAX_LISTED])
            + "): the clipped tokens are not mostly low-probability."
        )
    return text


def grad_share(df, rs: RunSet | None = None) -> str:
    if df.empty:
        return "No logit-gradient norms recorded."
    rs = context(df, rs)

    def one(g):
        q = g.groupby("quadrant")["grad_sq"].sum()
        lp = sum(q.get(x, 0.0) for x in LP) / max(1e-30, q.sum())
        dropped = (g["grad_sq"] * g["clipped_share"].fillna(0)).sum() / max(1e-30, g["grad_sq"].sum())
        return lp, dropped

    per = _by_series(df, rs, one)
    return (
        f"Here, share of the squared logit-gradient norm carried by low-probability quadrants (p < {tau_text(rs)}) "
        "and by tokens outside the clip interval on the gated side: "
        + _listing(per, lambda v: f"{_pct(v[0])}, {_pct(v[1])}")
        + "."
        + _smooth_note(df, rs)
        + _group_note(rs)
    )


def drift_by_prob(df, rs: RunSet | None = None) -> str:
    if df.empty:
        return "No entropy ratios recorded."
    rs = context(df, rs)

    def one(g):
        d = g.assign(w=g["mean_abs_log_ratio"] * g["tokens"]).groupby(["prob_lo", "prob_hi"])[["w", "tokens"]].sum()
        drift = d["w"] / d["tokens"]
        return drift.idxmax(), drift.max()

    per = _by_series(df, rs, one)
    text = (
        "Here, the bin of largest drift: "
        + _listing(
            per,
            lambda v: (
                f"p in [{v[0][0]:.2g}, {v[0][1]:.2g}) (mean |log rho| {_f(v[1])})" if v[1] > 0 else "none (rho = 1)"
            ),
        )
        + "."
    )
    against = [s for s, ((lo, hi), top) in per.items() if top > 0 and not (hi <= 0.2 + 1e-9 or lo >= 0.6 - 1e-9)]
    if against:
        text += (
            " Here this differs from the paper ("
            + ", ".join(against[:MAX_LISTED])
            + "): the largest drift is not below 0.2 or above 0.6."
        )
    return text


def entropy_change(df, rs: RunSet | None = None) -> str:
    if df.empty or "agrees" not in df:
        return "No token was seen at two updates."
    rs = context(df, rs)

    def one(g):
        d = g.groupby("quadrant")["relative_dh"].mean()
        return [q for q in _LAW if q in d and (d[q] > 0) == (_LAW[q] > 0)], sum(q in d for q in _LAW)

    per = _by_series(df, rs, one)
    return (
        "Here, quadrants whose measured sign agrees with the law: "
        + _listing(per, lambda v: f"{len(v[0])} of {v[1]}")
        + f"{_lp_note(rs)}."
    )


NO_ATTRIBUTION = (
    "No entropy attribution recorded: policy_update records it with a recorder; TRL: "
    "EntropyLensGRPOTrainer(..., attribution=True); by hand: record_update(..., "
    "entropy_sensitivity=...); verl does not record it."
)


def entropy_budget(df, rs: RunSet | None = None) -> str:
    if df.empty or df["effect"].isna().all():
        return NO_ATTRIBUTION
    rs = context(df, rs)

    def one(g):
        tot = g.groupby("quadrant")["effect"].sum()
        agree = [q for q in _LAW if q in tot and (tot[q] > 0) == (_LAW[q] > 0) and tot[q] != 0]
        steps = g.drop_duplicates(["run", "step"])
        neg = float((steps["step_effect"] < 0).mean()) if len(steps) else float("nan")
        return tot, len(agree), sum(q in tot and tot[q] != 0 for q in _LAW), neg  # quadrants with tokens

    per = _by_series(df, rs, one)
    text = (
        "Here, summed over the steps: "
        + _listing(
            per,
            lambda v: (
                "("
                + ", ".join(f"{q} {v[0][q]:+.3g}" for q in _LAW if q in v[0])
                + f"; law's sign in {v[1]} of {v[2]}; total < 0 in "
                f"{_pct(v[3])} of steps)"
            ),
        )
        + f"{_lp_note(rs)}."
    )
    return text + _sign_note(df, rs, per) + _smooth_note(df, rs) + _group_note(rs)


def _sign_note(df, rs: RunSet, per: dict) -> str:
    """Where a series' quadrant signs differ from the law's: why. A logit step delta on token a changes
    H by -delta p_a (log p_a + H), so the sign turns at p_a = exp(-H), not at tau; with the series' mean
    sampling entropy H, exp(-H) against its tau says which tokens are 'LP' by tau yet above exp(-H)."""
    off = [s for s, v in per.items() if v[1] < v[2]]
    if not off or "entropy" not in df or df["entropy"].isna().all():
        return ""
    parts = []
    for s in off[:MAX_LISTED]:
        g = df[df["run"].astype(str).isin(rs.runs_of(s) or [s])]
        h = g.drop_duplicates(["run", "step"])["entropy"].mean()
        if h != h:
            continue
        taus = {rs.setting(r, "tau")[0] for r in g["run"].astype(str).unique()} - {None}
        tau = next(iter(taus)) if len(taus) == 1 else None
        e = math.exp(-h)
        where = (
            ""
            if tau is None
            else (
                f", {'below' if e < tau else 'above'} tau = {tau:g}: tokens with p between "
                f"{min(e, tau):.3g} and {max(e, tau):.3g} are {'LP' if e < tau else 'HP'} "
                f"by tau but on the other side of exp(-H)"
            )
        )
        parts.append(f"{s}: mean H {h:.3g} nats, exp(-H) = {e:.3g}{where}")
    if not parts:
        return ""
    return (
        " Why the signs differ from the paper's: a logit step delta on token a changes the entropy by "
        "-delta p_a (log p_a + H), so a rewarded token lowers entropy when p_a > exp(-H) and raises it "
        "below, whatever tau (the paper's LP means below exp(-H)). "
        + "; ".join(parts)
        + ". Re-split at tau near exp(-H) with --tau."
    )


def clipping_removed(df, rs: RunSet | None = None) -> str:
    if df.empty or df["dropped"].isna().all():
        return NO_ATTRIBUTION
    rs = context(df, rs)

    def one(g):
        d = g.groupby("quadrant")["dropped"].sum()
        total = sum(abs(d.get(q, 0.0)) for q in _LAW)
        return d, total

    per = _by_series(df, rs, one)
    if all(total == 0 for _, total in per.values()):
        return "Here nothing was taken away: no token's gradient was changed."

    def show(v):
        d, total = v
        if total == 0:
            return "nothing taken away"
        lp = abs(d.get("PA&LP", 0.0)) + abs(d.get("NA&LP", 0.0))
        return f"PA&LP + NA&LP {_pct(lp / total)} (PA&LP {d.get('PA&LP', 0.0):+.3g}, NA&LP {d.get('NA&LP', 0.0):+.3g})"

    text = "Here, of the entropy effect taken away: " + _listing(per, show) + f"{_lp_note(rs)}."
    text += _cause_note(df, rs)
    beta = "; ".join(
        t
        for t in (rs.setting_text("beta1", _ce(rs)), rs.setting_text("beta2", _ce(rs)), rs.setting_text("dual_clip"))
        if t
    )
    if beta:
        text += f" Settings: {beta}."
    against = [
        s
        for s, (d, total) in per.items()
        if total > 0
        and not (
            (abs(d.get("PA&LP", 0.0)) + abs(d.get("NA&LP", 0.0))) / total > 0.5
            and d.get("PA&LP", 0.0) > 0 > d.get("NA&LP", 0.0)
        )
    ]
    if against:
        text += (
            " Here this differs from the paper's argument (PA&LP raising and NA&LP lowering entropy dominate what "
            "clipping drops) in: " + ", ".join(against[:MAX_LISTED]) + "."
        )
    else:
        text += " As CE-GPPO argues: dominated by PA&LP (raising) and NA&LP (lowering), opposite signs."
    return text


_CAUSES = (
    ("dropped_clip_low", "clip low side"),
    ("dropped_clip_high", "clip high side"),
    ("dropped_dual_clip", "dual-clip"),
    ("dropped_clip_cov", "Clip-Cov"),
    ("dropped_kl_cov", "KL-Cov"),
    ("dropped_erc", "ERC"),
)


def _cause_note(df, rs: RunSet) -> str:
    """' By cause (adding up to the total taken away): a clip low side -1.6, ...; b ...' from the
    analysis's by-cause step columns (summed over each series' steps); '' where no run has them
    (recorded before the split)."""
    have = [(c, name) for c, name in _CAUSES if c in df and df[c].notna().any()]
    if not have or "step_dropped" not in df:
        return ""

    def one(g):
        steps = g.drop_duplicates(["run", "step"])
        return [(name, steps[c].sum()) for c, name in have if steps[c].notna().any()], steps["step_dropped"].sum()

    per = {s: v for s, v in _by_series(df, rs, one).items() if v[0]}
    if not per:
        return ""
    return (
        " By cause (the parts add up to the total taken away): "
        + _listing(per, lambda v: ", ".join(f"{name} {x:+.3g}" for name, x in v[0]) + f" (total {v[1]:+.3g})")
        + "."
    )


def _ce(rs: RunSet) -> list[str]:
    return [r for r, m in rs.method.items() if str(m).startswith("ce_gppo")]


def probe_vs_measured(df, rs: RunSet | None = None) -> str:
    if df.empty:
        return "No probes recorded (Recorder.probe, or entropylens demo --probe-every K)."
    rs = context(df, rs)
    st = df[df["part"] == "step"].dropna(subset=["measured_dh", "predicted_dh"])
    text = f"Here, {len(st)} probed updates"
    if len(st) >= 2:
        r = st["predicted_dh"].corr(st["measured_dh"])
        same = float(((st["predicted_dh"] > 0) == (st["measured_dh"] > 0)).mean())
        text += f": predicted vs measured correlation {_f(r)}, same sign in {_pct(same)}"
    q = df[df["part"].isin(list(_LAW))].groupby("part")["predicted_dh"].mean()
    agree = [k for k in _LAW if k in q and (q[k] > 0) == (_LAW[k] > 0)]
    text += (
        "; mean predicted dH per quadrant: "
        + ", ".join(f"{k} {q[k]:+.3g}" for k in _LAW if k in q)
        + f" (law's sign in {len(agree)} of {len(q)}){_lp_note(rs)}."
    )
    return text


# ---------------------------------------------------------------------------------- Cui et al. (covlaw.py)
def _run_label(rs: RunSet, run: str) -> str:
    """A run as a per-run caption names it: its series label, or the run id where runs are grouped."""
    return str(run) if rs.grouped else rs.series.get(str(run), str(run))


def _runs_listing(rows, rs: RunSet, show) -> str:
    """'x ...; y ...' over per-run rows (at most MAX_LISTED, then how many more)."""
    items = [f"{_run_label(rs, r.run)} {show(r)}" for r in rows]
    return "; ".join(items[:MAX_LISTED]) + (
        f"; and {len(items) - MAX_LISTED} more runs" if len(items) > MAX_LISTED else ""
    )


def covariance_by_quadrant(df, rs: RunSet | None = None) -> str:
    if df.empty:
        return "No token rows with an advantage and a log-probability recorded."
    rs = context(df, rs)
    d = df[df["quadrant"].isin(list(_LAW))]

    def one(g):
        # the quadrant's mean contribution per step to the step's covariance (the contributions add up to
        # it): a covariance, comparable across runs, not a sum over every token of the run
        tot = g.groupby("quadrant")["contribution"].sum() / max(g[["run", "step"]].drop_duplicates().shape[0], 1)
        size = sum(abs(v) for v in tot)
        agree = [q for q in _LAW if q in tot and tot[q] != 0 and (tot[q] < 0) == (_LAW[q] > 0)]
        steps = g.drop_duplicates(["run", "step"])
        pos = float((steps["step_cov"] > 0).mean()) if len(steps) else float("nan")
        return tot, size, len(agree), sum(q in tot and tot[q] != 0 for q in _LAW), pos

    per = _by_series(d, rs, one)

    def show(v):
        tot, size, agree, n, pos = v
        parts = ", ".join(
            f"{q} {tot[q]:+.3g}" + (f" ({_pct(abs(tot[q]) / size)})" if size else "") for q in _LAW if q in tot
        )
        return f"({parts}; the law's sign in {agree} of {n}; step covariance > 0 in {_pct(pos)} of steps)"

    text = (
        "Here, each quadrant's mean part of the step's Cov(log pi, A) (its share of the four parts' |sum|): "
        + _listing(per, show)
        + f"{_lp_note(rs)}."
    )
    against = [s for s, v in per.items() if v[4] == v[4] and v[4] < 0.5]
    if against:
        text += (
            " Here the step's covariance is mostly negative ("
            + ", ".join(against[:MAX_LISTED])
            + "): by the law these steps push the entropy up, not towards collapse."
        )
    return text + _smooth_note(df, rs) + _group_note(rs)


def covariance_law(df, rs: RunSet | None = None) -> str:
    from .covlaw import MIN_STEPS, law_summary

    if df.empty:
        return "No token rows with an advantage and a log-probability recorded."
    rs = context(df, rs)
    summ = law_summary(df)
    good = summ[summ["meaningful"]]
    few = summ[~summ["meaningful"]]
    text = ""
    if len(good):
        text = (
            "Here, Pearson r of the predicted (-Cov(log pi, A)) and the measured entropy change per step: "
            + _runs_listing(
                good.itertuples(),
                rs,
                lambda r: (
                    f"r = {_f(r.corr, 2)} over {r.steps} steps (same sign in {_pct(r.same_sign)}; fitted scale "
                    f"{_f(r.scale)}; with Cov(log pi, pi A): r = {_f(r.corr_prob, 2)})"
                ),
            )
            + "."
        )
        against = [_run_label(rs, r.run) for r in good.itertuples() if not r.corr > 0]
        if against:
            text += (
                " Here this differs from the law ("
                + ", ".join(against[:MAX_LISTED])
                + "): the entropy does not fall where the covariance is positive."
            )
        else:
            text += " As the law predicts, the entropy falls more where the covariance is larger."
    if len(few):
        text += (
            (" " if text else "Here, ")
            + _runs_listing(
                few.itertuples(), rs, lambda r: f"has {r.steps} step{'s' if r.steps != 1 else ''} with a next step"
            )
            + (f": the fit (its scale and r) is not meaningful below {MIN_STEPS} steps, so none is claimed.")
        )
    return (
        text
        + " The scale is fitted per run: it stands for eta, which Adam and shared parameters blur."
        + _group_note(rs)
    )


def entropy_performance(df, rs: RunSet | None = None) -> str:
    from .covlaw import MIN_STEPS, fit_summary

    if df.empty or df["reward"].isna().all():
        return "No steps with both a reward and a mean entropy recorded."
    rs = context(df, rs)
    summ = fit_summary(df)
    good = summ[summ["meaningful"]]
    few = summ[~summ["meaningful"]]
    text = ""
    if len(good):
        text = (
            "Here, R = -a exp(H) + b fitted per run: "
            + _runs_listing(
                good.itertuples(),
                rs,
                lambda r: (
                    f"a = {_f(r.a)}, b = {_f(r.b)}, RMSE {_f(r.rmse, 2)}, R^2 {_f(r.r2, 3)} over {r.steps} steps (H {_f(r.entropy_lo)}..{_f(r.entropy_hi)} nats; at H = 0: b - a = {_f(r.b - r.a)})"
                ),
            )
            + "."
        )
        against = [_run_label(rs, r.run) for r in good.itertuples() if not r.a > 0]
        if against:
            text += (
                " Here this differs from the paper ("
                + ", ".join(against[:MAX_LISTED])
                + "): the reward does not rise as the entropy falls (a is not positive)."
            )
    flat = few[few["reward_varies"] == False]  # noqa: E712 (a column of bools)
    few = few[few["reward_varies"] == True]  # noqa: E712
    if len(few):
        text += (
            (" " if text else "Here, ")
            + _runs_listing(
                few.itertuples(),
                rs,
                lambda r: f"has {r.steps} step{'s' if r.steps != 1 else ''} with a reward and an entropy",
            )
            + (f": a fit of a and b is not meaningful below {MIN_STEPS} steps, so no curve is drawn.")
        )
    if len(flat):
        text += (
            (" The" if text else "Here, the")
            + " reward does not vary over the steps of "
            + ", ".join(_run_label(rs, r.run) for r in flat.itertuples())
            + ": nothing to fit, no curve is drawn."
        )
    return text + _group_note(rs)


def mismatch(df, rs: RunSet | None = None) -> str:
    """Per series: mean |delta log p| over the run, its largest step mean, the share of mismatched tokens
    among the clipped ones beside the others', and the mismatched tokens' share of the entropy effect;
    a series without sampler log-probs is named as such (NULL, not zero)."""
    from .plots import mismatch_pooled

    if df.empty:
        return "No tokens recorded."
    rs = context(df, rs)
    parts, missing = {}, []
    for s, g in df.groupby(series(df, rs), sort=True):
        if not (g["sampled"].fillna(0) > 0).any():
            missing.append(str(s))
            continue
        p = mismatch_pooled(g)
        tot = p["sampled"].sum()
        mean_abs = float((p["mean_abs"] * p["sampled"]).sum() / tot)
        peak = p.loc[p["mean_abs"].idxmax()]
        parts[s] = (
            f"mean |delta log p| {_f(mean_abs)} nats (highest at step {int(peak['step'])}: "
            f"{_f(peak['mean_abs'])}), {_pct(_wmean(g, 'mismatched_frac', 'sampled'))} of tokens mismatched; "
            f"{_pct(_wmean(g, 'clipped_mismatched_frac', 'clipped'))} of the clipped tokens vs "
            f"{_pct(_wmean_other(g))} of the others; "
            f"{_pct(_wmean(g, 'abs_effect_mismatched_share', 'abs_effect'))} of sum |entropy effect|"
        )
    text = ""
    if parts:
        text = (
            "Here (mismatched: |delta log p| > ln 2, a factor 2 between the probabilities, or masked by the IS "
            "correction): " + _listing(parts, str) + ". "
            "A clipped share above the others' says the clipped tokens are the mismatched ones (TIS / MIS "
            "report the mismatch drives the off-policy gap that clipping and IS correction act on)."
        )
    if missing:
        text += (" " if text else "") + (
            f"No sampler log-probs recorded in {', '.join(missing)} (tokens.sampler_logprob is NULL): the mismatch "
            "is unknown there, not zero; record it with record_update(..., sampler_logprobs=...), TRL with vLLM, "
            "or verl's rollout_log_probs."
        )
    return text + _group_note(rs)


def _wmean(g, col: str, w: str) -> float:
    ok = g[col].notna() & (g[w].fillna(0) > 0)
    return float((g[col][ok] * g[w][ok]).sum() / g[w][ok].sum()) if ok.any() else math.nan


def _wmean_other(g) -> float:
    w = g["sampled"].fillna(0) - g["clipped"].fillna(0)
    ok = g["unclipped_mismatched_frac"].notna() & (w > 0)
    return float((g["unclipped_mismatched_frac"][ok] * w[ok]).sum() / w[ok].sum()) if ok.any() else math.nan
