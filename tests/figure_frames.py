"""Hand-made analysis frames of many runs for the figure tests (tests/report/test_figures.py).

``frames(specs)`` returns {analysis name: DataFrame} with the columns of analyses/<name>.sql (plus the
columns report/build.py adds: ``series``, and per run ``band_low`` / ``band_high`` for the entropy ratio and
``tau`` for the clipped-token histogram). One spec per run: a dict with run, method and optionally
series, steps, lr, seed, erc (the run's ERC band or None), tau, eps_low, eps_high. Values are smooth
functions of the step plus seeded noise, so a figure test can compute what a line must show.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

QUADS = ("PA&HP", "PA&LP", "NA&HP", "NA&LP")


def spec(run, method, **kw) -> dict:
    return {
        "run": run,
        "method": method,
        "steps": 30,
        "lr": 1e-3,
        "seed": 0,
        "erc": None,
        "tau": 0.5,
        "eps_low": 0.2,
        "eps_high": 0.2,
        **kw,
    }


def _tag(df: pd.DataFrame, s: dict) -> pd.DataFrame:
    df.insert(0, "method", s["method"])
    df.insert(0, "run", s["run"])
    if s.get("series") is not None:
        df["series"] = s["series"]
    return df


def entropy_curve(steps: int, lr: float, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    t = np.arange(steps)
    return 1.2 * np.exp(-t * lr * 30 / max(1, steps / 30)) + 0.1 + rng.normal(0, 0.05, steps)


def frames(specs) -> dict[str, pd.DataFrame]:
    out: dict[str, list] = {}

    def add(name, df):
        out.setdefault(name, []).append(df)

    for i, s in enumerate(specs):
        n, lr, seed = s["steps"], s["lr"], s["seed"] + 1000 * i
        rng = np.random.default_rng(seed)
        step = np.arange(n)
        h = entropy_curve(n, lr, seed)
        add("entropy_by_step", _tag(pd.DataFrame(dict(step=step, entropy=h * 0.98, old_entropy=h, tokens=400)), s))
        add(
            "reward_by_step",
            _tag(pd.DataFrame(dict(step=step, reward=np.clip(0.9 - 0.6 * h, 0, 1), reward_std=0.1, sequences=32)), s),
        )
        add(
            "grad_norm_by_step",
            _tag(pd.DataFrame(dict(step=step, grad_norm=0.1 + rng.gamma(2, 0.02, n), grad_norm_max=0.3, updates=2)), s),
        )
        add("kl_by_step", _tag(pd.DataFrame(dict(step=step, kl=10 ** rng.normal(-2, 0.2, n))), s))
        share = np.stack([0.3 + 0.2 * (1 - h / h.max()), 0.2 * h / h.max(), 0.3 + 0 * h, 0.2 * h / h.max()], 1)
        share = share / share.sum(1, keepdims=True) * 0.95
        rows = [
            pd.DataFrame(dict(step=step, quadrant=q, tokens=(share[:, j] * 400).round(), share=share[:, j]))
            for j, q in enumerate(QUADS)
        ]
        rows.append(pd.DataFrame(dict(step=step, quadrant="ZA", tokens=20.0, share=0.05)))
        add("quadrant_share_by_step", _tag(pd.concat(rows, ignore_index=True), s))
        g = np.stack([0.1 + 0 * h, 0.3 * h / h.max(), 0.1 + 0 * h, 0.5 + 0.2 * (1 - h / h.max())], 1)
        g = g / g.sum(1, keepdims=True)
        add(
            "grad_share_by_quadrant",
            _tag(
                pd.concat(
                    [
                        pd.DataFrame(
                            dict(
                                step=step,
                                quadrant=q,
                                grad_sq=g[:, j] * 10,
                                share=g[:, j],
                                clipped_share=0.1 + 0.1 * (q.endswith("LP")),
                            )
                        )
                        for j, q in enumerate(QUADS)
                    ],
                    ignore_index=True,
                ),
                s,
            ),
        )
        low = {"PA&HP": 0.0, "PA&LP": 0.0, "NA&HP": 0.02, "NA&LP": 0.25 + 0.05 * rng.random()}
        high = {"PA&HP": 0.01, "PA&LP": 0.15 + 0.05 * rng.random(), "NA&HP": 0.0, "NA&LP": 0.0}
        add(
            "clip_by_quadrant",
            _tag(
                pd.DataFrame(
                    dict(
                        quadrant=list(QUADS),
                        tokens=100,
                        clip_low_frac=[low[q] for q in QUADS],
                        clip_high_frac=[high[q] for q in QUADS],
                        clipped_frac=[low[q] + high[q] for q in QUADS],
                    )
                ),
                s,
            ),
        )
        m = 300
        prob = rng.uniform(0, 1, m)
        add(
            "ratio_vs_prob",
            _tag(
                pd.DataFrame(
                    dict(
                        step=rng.integers(0, n, m),
                        prob=prob,
                        ratio=1 + rng.normal(0, 0.1, m) * (1.5 - prob),
                        quadrant=rng.choice(QUADS, m),
                        clipped=False,
                        eps_low=s["eps_low"],
                        eps_high=s["eps_high"],
                    )
                ),
                s,
            ),
        )
        b = np.arange(10)
        for side in ("low", "high"):
            tok = np.round(100 * np.exp(-b / 2.5) * (1 + 0.2 * rng.random(10)))
            add(
                "clipped_prob_distribution",
                _tag(
                    pd.DataFrame(
                        dict(
                            side=side,
                            bin=b,
                            prob_lo=b / 10,
                            prob_hi=(b + 1) / 10,
                            tokens=tok,
                            share=tok / tok.sum(),
                            lp_share=tok[b < s["tau"] * 10].sum() / tok.sum(),
                            tau=s["tau"],
                        )
                    ),
                    s,
                ),
            )
        erc = s.get("erc")
        lo_b, hi_b = erc if erc else (np.nan, np.nan)
        width = 0.06 if erc else 0.2
        med = 1 + rng.normal(0, 0.005, n) - 0.01
        add(
            "entropy_ratio_by_step",
            _tag(
                pd.DataFrame(
                    dict(
                        step=step,
                        p05=med - width,
                        p50=med,
                        p95=med + width,
                        outside_band=0.03 if erc else 0.4 + 0 * med,
                        tokens=400,
                        band_low=lo_b,
                        band_high=hi_b,
                    )
                ),
                s,
            ),
        )
        add(
            "drift_by_prob_bin",
            _tag(
                pd.DataFrame(
                    dict(
                        bin=b,
                        prob_lo=b / 10,
                        prob_hi=(b + 1) / 10,
                        tokens=50,
                        mean_abs_log_ratio=0.05 + 0.03 * np.cos(b) + 0.01 * lr * 100,
                    )
                ),
                s,
            ),
        )
        eff = {"PA&HP": -0.3 * h, "PA&LP": 0.15 * h, "NA&HP": 0.25 * h, "NA&LP": -0.2 * h}
        noise = rng.normal(0, 0.03, n)
        tot = sum(eff.values()) + noise
        add(
            "entropy_budget_by_step",
            _tag(
                pd.concat(
                    [
                        pd.DataFrame(
                            dict(
                                step=step,
                                quadrant=q,
                                effect=eff[q] + noise / 4,
                                dropped=0.1 * eff[q],
                                step_effect=tot,
                                step_dropped=0.0,
                                dropped_clip_low=0.0,
                                dropped_clip_high=0.0,
                                dropped_dual_clip=0.0,
                                dropped_erc=0.0,
                            )
                        )
                        for q in QUADS
                    ],
                    ignore_index=True,
                ),
                s,
            ),
        )
        mean_dh = np.array([0.04, -0.05, 0.045, -0.03]) + rng.normal(0, 0.005, 4)
        add(
            "entropy_change_by_quadrant",
            _tag(
                pd.DataFrame(
                    dict(
                        quadrant=list(QUADS),
                        tokens=100,
                        mean_dh=mean_dh,
                        relative_dh=mean_dh - mean_dh.mean(),
                        predicted_sign=[-1, 1, 1, -1],
                        agrees=False,
                    )
                ),
                s,
            ),
        )
        parts = ["step", *QUADS, *[f"{q} dropped" for q in QUADS]]
        ps = step[:: max(1, n // 5)]
        pr = [
            pd.DataFrame(
                dict(
                    step=ps,
                    update=0,
                    part=p,
                    tokens=100,
                    grad_norm=1.0,
                    predicted_dh=rng.normal(0, 0.01, len(ps)) + (0.002 if "LP" in p else -0.002),
                    measured_dh=rng.normal(0, 0.01, len(ps)) if p == "step" else np.nan,
                    entropy_before=1.0,
                    optimizer="adam",
                )
            )
            for p in parts
        ]
        add("probe_vs_measured", _tag(pd.concat(pr, ignore_index=True), s))
        # Cui et al.: covariance per quadrant (PA&HP, NA&LP > 0), the law dH = -0.5 cov + noise, R = 0.9 - 0.05 e^H
        sign = {"PA&HP": 1.0, "PA&LP": -0.3, "NA&HP": -0.4, "NA&LP": 0.8}
        cq = pd.concat(
            [
                pd.DataFrame(
                    dict(
                        step=step,
                        quadrant=q,
                        tokens=100.0,
                        cov_sum=sign[q] * h * 10,
                        cov_mean=sign[q] * h / 10,
                        contribution=sign[q] * h / 40,
                        step_cov=sum(sign.values()) * h / 40,
                    )
                )
                for q in QUADS
            ],
            ignore_index=True,
        )
        add("covariance_by_quadrant", _tag(cq, s))
        cov = sum(sign.values()) * h / 40
        dh = np.append(np.diff(h), np.nan)
        both = ~np.isnan(dh)
        scale = float(np.sum(-cov[both] * dh[both]) / np.sum(cov[both] ** 2))
        add(
            "covariance_law_by_step",
            _tag(
                pd.DataFrame(
                    dict(
                        step=step,
                        tokens=400,
                        cov=cov,
                        cov_prob=cov / 2,
                        entropy=h,
                        measured_dh=dh,
                        predicted_dh=-scale * cov,
                        scale=scale,
                        corr=float(np.corrcoef(-cov[both], dh[both])[0, 1]) if both.sum() > 1 else np.nan,
                        corr_prob=np.nan,
                        steps=int(both.sum()),
                    )
                ),
                s,
            ),
        )
        rew = 0.9 - 0.05 * np.exp(h) + rng.normal(0, 0.01, n)
        x = np.exp(h)
        sl = float(np.mean((x - x.mean()) * (rew - rew.mean())) / np.var(x)) if n > 1 else np.nan
        fitted = rew.mean() + sl * (x - x.mean())
        add(
            "entropy_performance_fit",
            _tag(
                pd.DataFrame(
                    dict(
                        step=step,
                        entropy=h,
                        reward=rew,
                        fitted_reward=fitted,
                        a=-sl,
                        b=rew.mean() - sl * x.mean(),
                        rmse=float(np.sqrt(np.mean((rew - fitted) ** 2))),
                        r2=np.nan,
                        steps=n,
                    )
                ),
                s,
            ),
        )
        # mismatch: a rising |delta log p| where the run has a sampler (seed even), NULL columns where not
        has = s["seed"] % 2 == 0
        mm = []
        for k, q in enumerate(QUADS):
            d = (0.01 + 0.002 * step * (1 + k)) if has else np.full(n, np.nan)
            mm.append(
                pd.DataFrame(
                    dict(
                        step=step,
                        quadrant=q,
                        tokens=100,
                        sampled=100 if has else 0,
                        mean_abs_log_ratio=d,
                        kl_k1=-d / 10,
                        kl_k3=d * d / 2,
                        mismatched_frac=np.minimum(1, d * 3),
                        masked_frac=d / 10,
                        clipped=10 if has else np.nan,
                        clipped_mismatched_frac=np.minimum(1, d * 5),
                        unclipped_mismatched_frac=np.minimum(1, d * 3),
                        effect=-0.1 if has else np.nan,
                        effect_mismatched=-0.05 if has else np.nan,
                        abs_effect=0.2 if has else np.nan,
                        abs_effect_mismatched_share=np.minimum(1, d * 4),
                    )
                )
            )
        add("mismatch_by_quadrant_by_step", _tag(pd.concat(mm, ignore_index=True), s))
    return {k: pd.concat(v, ignore_index=True) for k, v in out.items()}
