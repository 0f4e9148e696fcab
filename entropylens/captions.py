"""What THIS run shows, measured from the analysis a figure is drawn from, for the report's captions.

Each function takes the figure's DataFrame and returns one or two sentences with numbers; where
the measurement goes against the paper's claim it says so ("Here this differs from the paper: ...").
A figure without a function gets a plain count of what was measured, never only the claim.
"""

from __future__ import annotations

import math

LP = ("PA&LP", "NA&LP")
HP = ("PA&HP", "NA&HP")


def _f(v, digits=3) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "n/a"
    return f"{v:.{digits}g}"


def _pct(v) -> str:
    return "n/a" if v is None or v != v else f"{100 * v:.1f}%"


def tau_text(taus: dict | None) -> str:
    """The HP / LP threshold of the runs as a caption says it: 'tau = 0.5', or per run where they differ."""
    vals = {r: float(v) for r, v in (taus or {}).items() if v is not None and v == v}
    if not vals:
        return "tau"
    if len(set(vals.values())) == 1:
        return f"tau = {next(iter(vals.values())):g}"
    return "tau = " + ", ".join(f"{v:g} ({r})" for r, v in sorted(vals.items()))


def _lp_note(taus) -> str:
    return f" (LP: p < {tau_text(taus)}, HP: p >= tau)"


def _per_method(df, col: str, fn) -> dict:
    return {m: fn(g) for m, g in df.groupby(df["method"].fillna("?"), sort=True)} if col in df else {}


def _last(df, col):
    return lambda g: g.sort_values("step")[col].dropna().iloc[-1] if g[col].notna().any() else float("nan")


def _first(df, col):
    return lambda g: g.sort_values("step")[col].dropna().iloc[0] if g[col].notna().any() else float("nan")


def entropy(df) -> str:
    if df.empty:
        return "No steps recorded."
    first = _per_method(df, "old_entropy", _first(df, "old_entropy"))
    last = _per_method(df, "old_entropy", _last(df, "old_entropy"))
    parts = [f"{m} {_f(first[m])} -> {_f(last[m])}" for m in last]
    text = "Here, entropy first -> last step (nats): " + "; ".join(parts) + "."
    # the comparison: mean over the last 10% of steps (not one step), with the number of runs behind it
    tail = _per_method(df, "old_entropy", lambda g: g[g["step"] >= g["step"].max() - max(1, round(0.1 * (
        g["step"].max() - g["step"].min()))) + 1]["old_entropy"].mean())
    runs = _per_method(df, "old_entropy", lambda g: g["run"].nunique() if "run" in g else 1)
    ce = {m: tail[m] for m in tail if m.startswith("ce_gppo")}
    base = {m: tail[m] for m in tail if m in ("grpo", "dapo")}
    if len(tail) < 2:
        return text
    nums = "; ".join(f"{m} {_f(v)}" for m, v in tail.items())  # every method of the run set
    power = (" From one run per method: not a significant difference." if min(runs.values()) < 2 else
             f" ({min(runs.values())}+ runs per method; no significance test here, see reports/paper-claims.md.)")
    if ce and base and min(ce.values()) > max(base.values()):
        text += (f" Mean entropy over the last 10% of steps: {nums}; CE-GPPO is above GRPO / DAPO, the paper's "
                 f"direction.{power}")
    elif ce and base:
        text += (f" Here this differs from the paper: mean entropy over the last 10% of steps: {nums}; CE-GPPO is "
                 f"not above GRPO / DAPO.{power}")
    else:
        text += f" Mean entropy over the last 10% of steps: {nums}.{power}"
    return text


def reward(df) -> str:
    if df.empty:
        return "No rewards recorded."
    last = _per_method(df, "reward", _last(df, "reward"))
    return "Here, final-step reward: " + "; ".join(f"{m} {_f(v)}" for m, v in last.items()) + "."


def quadrant_share(df, taus=None) -> str:
    if df.empty:
        return "No steps recorded."
    tot = df.groupby("quadrant")["tokens"].sum()
    share = tot / tot.sum()
    return "Here, all runs and steps together: " + ", ".join(
        f"{q} {_pct(share.get(q, float('nan')))}" for q in ("PA&HP", "PA&LP", "NA&HP", "NA&LP", "ZA") if q in share
    ) + f"{_lp_note(taus)}."


def clip_by_quadrant(df, taus=None) -> str:
    if df.empty:
        return "No token rows recorded."
    d = df[df["step"].isna()] if "step" in df else df
    w = d.assign(c=d["clipped_frac"] * d["tokens"]).groupby("quadrant")[["c", "tokens"]].sum()
    frac = (w["c"] / w["tokens"]).to_dict()
    lp = sum(w.loc[q, "c"] for q in LP if q in w.index) / max(1, sum(w.loc[q, "tokens"] for q in LP if q in w.index))
    hp = sum(w.loc[q, "c"] for q in HP if q in w.index) / max(1, sum(w.loc[q, "tokens"] for q in HP if q in w.index))
    text = ("Here, clipped share per quadrant (all runs): " + ", ".join(f"{q} {_pct(frac.get(q))}" for q in
            ("PA&HP", "PA&LP", "NA&HP", "NA&LP") if q in frac)
            + f"; low-probability (p < {tau_text(taus)}) {_pct(lp)} vs high {_pct(hp)}.")
    if w["c"].sum() == 0:
        text += " No token was clipped in these runs: nothing to compare with the paper's claim."
    elif lp <= hp:
        text += " Here this differs from the paper: low-probability tokens are not clipped more often."
    return text


def ratio_vs_prob(df, taus=None) -> str:
    if df.empty:
        return "No token rows recorded."
    out = (df["ratio"] < 1 - df["eps_low"]) | (df["ratio"] > 1 + df["eps_high"])
    known = {r: float(v) for r, v in (taus or {}).items() if v is not None and v == v}
    tau = df["run"].map(known).fillna(0.5) if known and "run" in df else 0.5  # each run's own threshold
    t = tau_text(taus) if known else "0.5"
    lp, hp = df["prob"] < tau, df["prob"] >= tau
    a, b = out[lp].mean() if lp.any() else float("nan"), out[hp].mean() if hp.any() else float("nan")
    text = (f"Here ({len(df)} sampled tokens), outside the clip interval: {_pct(a)} of those with p < {t}, "
            + (f"{_pct(b)} of those with p >= tau." if b == b else "none has p >= tau."))
    if a == a and b == b and a <= b:
        text += " Here this differs from the paper: high-probability tokens leave the interval as often."
    return text


def grad_share(df, taus=None) -> str:
    if df.empty:
        return "No logit-gradient norms recorded."
    g = df.groupby("quadrant")["grad_sq"].sum()
    lp = sum(g.get(q, 0.0) for q in LP) / max(1e-30, g.sum())
    dropped = (df["grad_sq"] * df["clipped_share"].fillna(0)).sum() / max(1e-30, df["grad_sq"].sum())
    return (f"Here, low-probability quadrants (p < {tau_text(taus)}) carry {_pct(lp)} of the squared logit-gradient "
            f"norm; tokens outside "
            f"the clip interval on the gated side carry {_pct(dropped)}.")


def entropy_ratio(df) -> str:
    if df.empty:
        return "No entropy ratios recorded."
    out = _per_method(df, "outside_band", lambda g: (g["outside_band"] * g["tokens"]).sum() / g["tokens"].sum())
    med = _per_method(df, "p50", lambda g: g["p50"].median())
    text = "Here, share of tokens outside (0.95, 1.05): " + "; ".join(
        f"{m} {_pct(v)} (median rho {_f(med[m], 4)})" for m, v in out.items()) + "."
    erc = [v for m, v in out.items() if m.startswith("erc")]
    plain = [v for m, v in out.items() if not m.startswith("erc")]
    if erc and plain:
        if max(erc) < min(plain):
            text += " ERC runs keep more tokens inside the band, as the paper reports."
        else:
            text += " Here this differs from the paper: ERC runs do not keep more tokens inside the band."
    return text


def drift_by_prob(df) -> str:
    if df.empty:
        return "No entropy ratios recorded."
    d = df.assign(w=df["mean_abs_log_ratio"] * df["tokens"]).groupby(["prob_lo", "prob_hi"])[["w", "tokens"]].sum()
    drift = d["w"] / d["tokens"]
    (lo, hi) = drift.idxmax()
    text = f"Here, largest drift: p in [{lo:.2g}, {hi:.2g}) (mean |log rho| {_f(drift.max())}; all runs)."
    if not (hi <= 0.2 + 1e-9 or lo >= 0.6 - 1e-9):
        text += " Here this differs from the paper: the largest drift is not below 0.2 or above 0.6."
    return text


def grad_norm(df) -> str:
    if df.empty:
        return "No gradient norms recorded."
    med = _per_method(df, "grad_norm", lambda g: g["grad_norm"].median())
    return ("Here, median gradient norm per step: " + "; ".join(f"{m} {_f(v)}" for m, v in med.items())
            + " (the paper's 0.05-0.10 is for a 1.5B model; scale differs with the model).")


def kl(df) -> str:
    if df.empty:
        return "No KL recorded."
    med = _per_method(df, "kl", lambda g: g["kl"].median())
    return ("Here, median KL per step: " + "; ".join(f"{m} {_f(v)}" for m, v in med.items())
            + " (the paper reports ~1e-5 for its LLM).")


def entropy_change(df, taus=None) -> str:
    if df.empty or "agrees" not in df:
        return "No token was seen at two updates."
    d = df.groupby("quadrant")["relative_dh"].mean()
    pred = {"PA&HP": -1, "PA&LP": 1, "NA&HP": 1, "NA&LP": -1}
    agree = [q for q in pred if q in d and (d[q] > 0) == (pred[q] > 0)]
    text = f"Here the measured sign agrees with the law in {len(agree)} of {sum(q in d for q in pred)} quadrants"
    missing = [q for q in pred if q in d and q not in agree]
    return text + (f" (not in {', '.join(missing)})" if missing else "") + f"{_lp_note(taus)}."


def clipped_prob(df, taus=None) -> str:
    if df.empty:
        return "No token was clipped."
    parts, lp_of = [], {}
    for side in ("low", "high"):
        s = df[df["side"] == side]
        if s.empty:
            continue
        per_run = s.groupby("run").agg(n=("tokens", "sum"), lp=("lp_share", "first"))
        n = int(per_run["n"].sum())
        lp_of[side] = float((per_run["n"] * per_run["lp"]).sum() / n)
        parts.append(f"{_pct(lp_of[side])} of {n} {side}-side clipped tokens have p < {tau_text(taus)}")
    text = "Here, " + "; ".join(parts) + "."
    if lp_of and max(lp_of.values()) <= 0.5:
        text += " Here this differs from the paper: the clipped tokens are not mostly low-probability."
    return text


_LAW = {"PA&HP": -1, "PA&LP": 1, "NA&HP": 1, "NA&LP": -1}  # covariance-law sign of each quadrant's effect


NO_ATTRIBUTION = ("No entropy attribution recorded: policy_update records it with a recorder; TRL: "
                  "EntropyLensGRPOTrainer(..., attribution=True); by hand: record_update(..., "
                  "entropy_sensitivity=...); verl does not record it.")


def entropy_budget(df, taus=None) -> str:
    if df.empty or df["effect"].isna().all():
        return NO_ATTRIBUTION
    tot = df.groupby("quadrant")["effect"].sum()
    agree = [q for q in _LAW if q in tot and (tot[q] > 0) == (_LAW[q] > 0) and tot[q] != 0]
    steps = df.drop_duplicates(["run", "step"])
    neg = float((steps["step_effect"] < 0).mean()) if len(steps) else float("nan")
    text = ("Here, summed over all runs and steps: " + ", ".join(
        f"{q} {tot[q]:+.3g} (law {'+' if _LAW[q] > 0 else '-'})" for q in _LAW if q in tot)
        + f"; the sign matches the covariance law in {len(agree)} of {sum(q in tot for q in _LAW)} quadrants;"
        f" the step total is negative in {_pct(neg)} of steps{_lp_note(taus)}.")
    return text


def clipping_removed(df, taus=None) -> str:
    if df.empty or df["dropped"].isna().all():
        return NO_ATTRIBUTION
    d = df.groupby("quadrant")["dropped"].sum()
    total = sum(abs(d.get(q, 0.0)) for q in _LAW)
    if total == 0:
        return "Here nothing was taken away: no token's gradient was changed."
    lp = abs(d.get("PA&LP", 0.0)) + abs(d.get("NA&LP", 0.0))
    pa, na = d.get("PA&LP", 0.0), d.get("NA&LP", 0.0)
    text = (f"Here, of the entropy effect taken away (all runs), PA&LP and NA&LP carry {_pct(lp / total)}: "
            f"PA&LP {pa:+.3g}, NA&LP {na:+.3g}, PA&HP {d.get('PA&HP', 0.0):+.3g}, NA&HP {d.get('NA&HP', 0.0):+.3g}"
            f"{_lp_note(taus)}.")
    if lp / total > 0.5 and pa > 0 > na:
        text += " As CE-GPPO argues: dominated by PA&LP (raising) and NA&LP (lowering), opposite signs."
    else:
        text += (" Here this differs from the paper's argument (PA&LP raising and NA&LP lowering entropy "
                 "dominate what clipping drops).")
    return text


def probe_vs_measured(df, taus=None) -> str:
    if df.empty:
        return "No probes recorded (Recorder.probe, or entropylens demo --probe-every K)."
    st = df[df["part"] == "step"].dropna(subset=["measured_dh", "predicted_dh"])
    text = f"Here, {len(st)} probed updates"
    if len(st) >= 2:
        r = st["predicted_dh"].corr(st["measured_dh"])
        same = float(((st["predicted_dh"] > 0) == (st["measured_dh"] > 0)).mean())
        text += f": predicted vs measured correlation {_f(r)}, same sign in {_pct(same)}"
    q = df[df["part"].isin(list(_LAW))].groupby("part")["predicted_dh"].mean()
    agree = [k for k in _LAW if k in q and (q[k] > 0) == (_LAW[k] > 0)]
    text += (f"; mean predicted dH per quadrant: " + ", ".join(f"{k} {q[k]:+.3g}" for k in _LAW if k in q)
             + f" (law's sign in {len(agree)} of {len(q)}){_lp_note(taus)}.")
    return text


OBSERVERS = {
    "entropy": entropy, "reward": reward, "quadrant_share": quadrant_share, "clip_by_quadrant": clip_by_quadrant,
    "ratio_vs_prob": ratio_vs_prob, "grad_share": grad_share, "entropy_ratio": entropy_ratio,
    "drift_by_prob": drift_by_prob, "grad_norm": grad_norm, "kl": kl, "entropy_change": entropy_change,
    "clipped_prob": clipped_prob, "entropy_budget": entropy_budget, "clipping_removed": clipping_removed,
    "probe": probe_vs_measured,
}


# the figures whose sentence splits tokens by the HP / LP threshold: they state the runs' tau
TAU = ("quadrant_share", "clip_by_quadrant", "ratio_vs_prob", "grad_share", "entropy_change", "clipped_prob",
       "entropy_budget", "clipping_removed", "probe")


def observed(name: str, df, taus: dict | None = None) -> str:
    """The measured sentence for figure ``name`` (a figure without an observer: a row count). ``taus``:
    {run: tau} of the runs shown (runs.tau), stated where the sentence uses the HP / LP split."""
    fn = OBSERVERS.get(name)
    if fn is not None:
        try:
            return fn(df, taus) if name in TAU else fn(df)
        except (KeyError, ValueError, ZeroDivisionError, IndexError, TypeError):
            pass
    return f"Here: {len(df)} rows of this figure's analysis."
