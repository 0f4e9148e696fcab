"""Cui et al. 2025's two analyses of a run, as per-run tables: the covariance law and the entropy-performance fit.

"The Entropy Mechanism of Reinforcement Learning for Reasoning Language Models" (Cui et al. 2025):

- the covariance law: under a policy-gradient step of size eta, a softmax policy's entropy changes by about
  dH ~ -eta Cov(log pi(a), A(a)) (natural PG; vanilla PG: -eta Cov(log pi(a), pi(a) A(a))), so tokens
  whose log-probability and advantage covary strongly drive the entropy down;
- the entropy-performance law: performance follows R = -a exp(H) + b as the entropy H is spent.

The numbers come from three analyses (analyses/*.sql), so they work for any recorded run, old ones included
(they need tokens' advantage and logprob, and steps' entropy means; sequences' rewards for the fit):
``covariance_by_quadrant``, ``covariance_law_by_step`` and ``entropy_performance_fit``. This module turns
their per-step frames into one row per run (no I/O but :func:`tables`, which runs the analyses on a
connection). The report's captions (captions.py) and the demo's claims report use the same functions.

A fit over few steps says nothing: below :data:`MIN_STEPS` steps ``meaningful`` is False, and the report says
so instead of drawing a curve.
"""

from __future__ import annotations

from dataclasses import dataclass

MIN_STEPS = 5  # steps a per-run fit (the law's scale and correlation, the a / b fit) needs to mean something
QUADRANTS = ("PA&HP", "PA&LP", "NA&HP", "NA&LP")
LAW_SIGN = {"PA&HP": -1, "PA&LP": 1, "NA&HP": 1, "NA&LP": -1}  # the entropy change a quadrant drives: -sign(cov)


@dataclass(frozen=True)
class Fit:
    """R = -a exp(H) + b fitted by least squares over ``n`` points."""

    a: float
    b: float
    rmse: float
    r2: float  # nan where R does not vary
    n: int

    @property
    def meaningful(self) -> bool:
        return self.n >= MIN_STEPS


def fit_entropy_performance(entropy, reward) -> Fit:
    """Least squares of reward = b - a exp(entropy) over paired 1-d arrays (NaN pairs left out): the same
    fit as analyses/entropy_performance_fit.sql, for arrays that are not in a run (a, b nan where H does
    not vary or fewer than 2 points)."""
    import numpy as np

    h, r = np.asarray(entropy, dtype=np.float64), np.asarray(reward, dtype=np.float64)
    keep = np.isfinite(h) & np.isfinite(r)
    x, r = np.exp(h[keep]), r[keep]  # [n]
    n = int(len(x))
    nan = float("nan")
    if n < 2 or np.var(x) == 0:
        return Fit(nan, nan, nan, nan, n)
    slope = float(np.mean((x - x.mean()) * (r - r.mean())) / np.var(x))
    a, b = -slope, float(r.mean() - slope * x.mean())
    res = r - (b - a * x)
    sst = float(np.sum((r - r.mean()) ** 2))
    return Fit(a, b, float(np.sqrt(np.mean(res**2))), 1 - float(np.sum(res**2)) / sst if sst > 0 else nan, n)


def _first(g, col):
    v = g[col].dropna()
    return float(v.iloc[0]) if len(v) else float("nan")


def law_summary(df):
    """covariance_law_by_step's frame -> one row per run: run, method, steps (in the fit), scale (the fitted
    step size eta of dH = -eta Cov), corr (Pearson of -Cov(log pi, A) and the measured dH), corr_prob (the
    same with Cov(log pi, pi A)), same_sign (share of the fitted steps where -Cov and dH agree in sign),
    meaningful (steps >= MIN_STEPS)."""
    import numpy as np
    import pandas as pd

    rows = []
    for run, g in df.groupby(df["run"].astype(str), sort=True):
        both = g.dropna(subset=["cov", "measured_dh"])
        steps = int(g["steps"].max()) if len(g) else 0
        same = float(np.mean(np.sign(-both["cov"]) == np.sign(both["measured_dh"]))) if len(both) else float("nan")
        rows.append(
            dict(
                run=run,
                method=g["method"].iloc[0] if "method" in g else None,
                steps=steps,
                scale=_first(g, "scale"),
                corr=_first(g, "corr"),
                corr_prob=_first(g, "corr_prob"),
                same_sign=same,
                meaningful=steps >= MIN_STEPS,
            )
        )
    return pd.DataFrame(
        rows, columns=["run", "method", "steps", "scale", "corr", "corr_prob", "same_sign", "meaningful"]
    )


def fit_summary(df):
    """entropy_performance_fit's frame -> one row per run: run, method, steps, a, b, rmse, r2, entropy_lo /
    entropy_hi (the range of H the fit saw), reward_varies, meaningful (steps >= MIN_STEPS, a and b defined and
    the reward varies: a flat reward has nothing to fit)."""
    import pandas as pd

    rows = []
    for run, g in df.groupby(df["run"].astype(str), sort=True):
        steps = int(g["steps"].max()) if len(g) else 0
        a, b = _first(g, "a"), _first(g, "b")
        rows.append(
            dict(
                run=run,
                method=g["method"].iloc[0] if "method" in g else None,
                steps=steps,
                a=a,
                b=b,
                rmse=_first(g, "rmse"),
                r2=_first(g, "r2"),
                entropy_lo=float(g["entropy"].min()),
                entropy_hi=float(g["entropy"].max()),
                reward_varies=bool(g["reward"].nunique() > 1),
                meaningful=steps >= MIN_STEPS and a == a and b == b and g["reward"].nunique() > 1,
            )
        )
    return pd.DataFrame(
        rows,
        columns=[
            "run",
            "method",
            "steps",
            "a",
            "b",
            "rmse",
            "r2",
            "entropy_lo",
            "entropy_hi",
            "reward_varies",
            "meaningful",
        ],
    )


def quadrant_summary(df):
    """covariance_by_quadrant's frame -> one row per (run, quadrant) over the whole run: tokens, cov_sum
    (summed over the steps), share (of the run's summed |cov_sum| over the four quadrants), law_sign (the
    entropy change the quadrant's covariance drives, -sign(cov_sum)), expected (the quadrant's sign in the
    law's table: PA&HP -, PA&LP +, NA&HP +, NA&LP -) and agrees."""
    import numpy as np
    import pandas as pd

    d = df[df["quadrant"].isin(QUADRANTS)]
    if d.empty:
        return pd.DataFrame(
            columns=["run", "method", "quadrant", "tokens", "cov_sum", "share", "law_sign", "expected", "agrees"]
        )
    g = (
        d.assign(run=d["run"].astype(str))
        .groupby(["run", "quadrant"], sort=True)
        .agg(method=("method", "first"), tokens=("tokens", "sum"), cov_sum=("cov_sum", "sum"))
        .reset_index()
    )
    tot = g.groupby("run")["cov_sum"].transform(lambda s: s.abs().sum())
    g["share"] = g["cov_sum"].abs() / tot.where(tot > 0)
    g["law_sign"] = -np.sign(g["cov_sum"]).astype(int)
    g["expected"] = g["quadrant"].map(LAW_SIGN)
    g["agrees"] = g["law_sign"] == g["expected"]
    return g[["run", "method", "quadrant", "tokens", "cov_sum", "share", "law_sign", "expected", "agrees"]]


def tables(con) -> dict:
    """Runs the three analyses on ``con`` (entropylens.connect / read.query.connect) -> {"quadrants":
    quadrant_summary, "law": law_summary, "fit": fit_summary, and the analyses' own frames under their
    names}."""
    from ..read.query import run_analysis

    cov = run_analysis(con, "covariance_by_quadrant")
    law = run_analysis(con, "covariance_law_by_step")
    fit = run_analysis(con, "entropy_performance_fit")
    return {
        "quadrants": quadrant_summary(cov),
        "law": law_summary(law),
        "fit": fit_summary(fit),
        "covariance_by_quadrant": cov,
        "covariance_law_by_step": law,
        "entropy_performance_fit": fit,
    }
