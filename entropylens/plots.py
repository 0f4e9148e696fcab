"""One function per paper figure: a DataFrame from an analysis in, a matplotlib Figure out. No I/O.

Runs are overlaid and coloured by method (seeds of one method share a colour). Each function's
docstring names the analysis it takes and the figure it mirrors; report.py writes the files.
"""

from __future__ import annotations

import math

QUAD_ORDER = ("PA&HP", "PA&LP", "NA&HP", "NA&LP")
QUAD_COLORS = {"PA&HP": "#1f77b4", "PA&LP": "#2ca02c", "NA&HP": "#ff7f0e", "NA&LP": "#d62728", "ZA": "#7f7f7f"}
_PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf",
            "#bcbd22", "#7f7f7f")


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update({"figure.dpi": 100, "axes.grid": True, "grid.alpha": 0.3, "font.size": 9,
                         "axes.spines.top": False, "axes.spines.right": False})
    return plt


def method_colors(df) -> dict[str, str]:
    methods = sorted(df["method"].fillna("?").unique()) if "method" in df else []
    return {m: _PALETTE[i % len(_PALETTE)] for i, m in enumerate(methods)}


def _label(run: str, method: str) -> str:
    return run if run.startswith(str(method)) else f"{run} ({method})"


def _lines(ax, df, x: str, y: str, colors, *, logy=False, alpha=0.9):
    seen = set()
    for run, g in df.sort_values(x).groupby("run", sort=True):
        method = str(g["method"].iloc[0])
        label = method if method not in seen else None
        seen.add(method)
        ax.plot(g[x], g[y], color=colors.get(method, "k"), lw=1.4, alpha=alpha, label=label,
                marker="o" if len(g) < 3 else None, ms=4)  # a short run shows as points, not nothing
    if logy:
        ax.set_yscale("log")
    if seen:
        ax.legend(title="method", fontsize=8, title_fontsize=8)


def _empty(fig, msg="no data in these runs"):
    fig.text(0.5, 0.5, msg, ha="center", va="center", color="0.4")
    return fig


def _step_figure(df, y: str, ylabel: str, title: str, *, logy=False):
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    if df.empty or df[y].isna().all():
        return _empty(fig)
    _lines(ax, df.dropna(subset=[y]), "step", y, method_colors(df), logy=logy)
    ax.set_xlabel("training step")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    fig.tight_layout()
    return fig


def entropy_vs_step(df):
    """entropy_by_step -> policy entropy H(pi_old) per step (CE-GPPO Fig. 2, 3, 5); the y axis starts at 0
    (entropy is >= 0), so a collapse shows as the fall towards 0 it is."""
    fig = _step_figure(df, "old_entropy", "mean token entropy (nats)", "Policy entropy")
    if fig.axes and fig.axes[0].has_data():
        fig.axes[0].set_ylim(bottom=0)
    return fig


def reward_vs_step(df):
    """reward_by_step -> mean reward per step (CE-GPPO Fig. 2 right, training reward)."""
    return _step_figure(df, "reward", "mean reward (0..1)", "Reward")


def grad_norm_vs_step(df):
    """grad_norm_by_step -> global grad norm before clipping (CE-GPPO Fig. 4 right)."""
    return _step_figure(df, "grad_norm", "gradient norm (L2, before clipping)", "Gradient norm")


def kl_vs_step(df):
    """kl_by_step -> KL(pi_old || pi_theta), k3, log scale (CE-GPPO Fig. 4 left)."""
    d = df[df["kl"] > 0] if not df.empty else df
    return _step_figure(d, "kl", "KL(old || new), nats (log)", "KL to the old policy", logy=True)


def _quadrant_panels(df, y: str, ylabel: str, *, dotted: str | None = None, empty="no data in these runs"):
    """One panel per quadrant, `y` vs step per run (coloured by method); optional dotted column."""
    plt = _plt()
    fig, axes = plt.subplots(1, 4, figsize=(11, 3.0), sharey=True)
    if df.empty:
        return _empty(fig, empty)
    colors = method_colors(df)
    for ax, q in zip(axes, QUAD_ORDER):
        d = df[df["quadrant"] == q]
        _lines(ax, d, "step", y, colors)
        if dotted is not None:
            for _, g in d.sort_values("step").groupby("run"):
                ax.plot(g["step"], g[dotted], color=colors.get(str(g["method"].iloc[0])), ls=":", lw=1.1,
                        marker="o" if len(g) < 3 else None, ms=3, mfc="none")
        ax.set_title(q, color=QUAD_COLORS[q])
        ax.set_xlabel("training step")
        if ax is not axes[0] and ax.get_legend():
            ax.get_legend().remove()
    axes[0].set_ylabel(ylabel)
    fig.tight_layout()
    return fig


def quadrant_share(df):
    """quadrant_share_by_step -> share of tokens per quadrant vs step, one panel per quadrant."""
    return _quadrant_panels(df, "share", "share of tokens")


def clip_by_quadrant(df):
    """clip_by_quadrant (whole-run rows) -> clip fraction by quadrant, low and high side, per method."""
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.4), sharey=True)
    d = df[df["step"].isna()] if "step" in df else df  # tolerate the old mixed table
    if d.empty:
        return _empty(fig)
    d = d.groupby(["method", "quadrant"], as_index=False)[["clip_low_frac", "clip_high_frac"]].mean()
    colors = method_colors(d)
    methods = list(colors)
    w = 0.8 / max(1, len(methods))
    for ax, side, title in ((axes[0], "clip_low_frac", "low side: r < 1-eps_low, A < 0"),
                            (axes[1], "clip_high_frac", "high side: r > 1+eps_high, A > 0")):
        for i, m in enumerate(methods):
            g = d[d["method"] == m].set_index("quadrant").reindex(QUAD_ORDER)
            xs = [j + (i - (len(methods) - 1) / 2) * w for j in range(4)]
            ax.bar(xs, g[side].fillna(0) * 100, width=w, color=colors[m], label=m)
        ax.set_xticks(range(4), QUAD_ORDER)
        ax.set_title(title)
        ax.set_xlabel("quadrant")
    axes[0].set_ylabel("tokens clipped (% of quadrant)")
    axes[0].legend(title="method", fontsize=8, title_fontsize=8)
    fig.tight_layout()
    return fig


def _bottom_labels(axes, used: int, xlabel: str) -> None:
    """Hide the unused panels of a grid; the lowest used panel of each column gets x ticks and label."""
    rows, cols = axes.shape
    for k, ax in enumerate(axes.flat):
        if k >= used:
            ax.set_visible(False)
    for c in range(cols):
        below = [r for r in range(rows) if r * cols + c < used]
        if below:
            ax = axes[below[-1], c]
            ax.xaxis.set_tick_params(labelbottom=True)
            ax.set_xlabel(xlabel)


def ratio_vs_prob(df, *, span: float = 3.0):
    """ratio_vs_prob -> importance ratio vs sampling probability by quadrant, with the clip interval
    [1-eps_low, 1+eps_high] shaded (CE-GPPO Fig. 1 left). One panel per run (at most 6), shared
    linear y axis centred on 1 and ``span`` times the clip interval wide; points beyond it are drawn on
    the edge as triangles (counted in the panel title); one legend for the figure."""
    from matplotlib.lines import Line2D

    plt = _plt()
    runs = list(dict.fromkeys(df["run"])) if not df.empty else []
    n = max(1, min(6, len(runs)))
    cols = min(3, n)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.3 * rows + 0.5), squeeze=False,
                             sharex=True, sharey=True)
    if not runs:
        for ax in axes.flat:
            ax.set_visible(False)
        return _empty(fig)
    eps_lo = df["eps_low"].astype(float).max() if df["eps_low"].notna().any() else 0.2
    eps_hi = df["eps_high"].astype(float).max() if df["eps_high"].notna().any() else 0.2
    y_lo, y_hi = max(0.0, 1 - span * eps_lo), 1 + span * eps_hi
    for ax, run in zip(axes.flat, runs[:6]):
        g = df[df["run"] == run]
        lo, hi = g["eps_low"].iloc[0], g["eps_high"].iloc[0]
        if lo == lo and lo is not None and hi == hi and hi is not None:
            ax.axhspan(1 - lo, 1 + hi, color="0.85", alpha=0.6, lw=0, zorder=0)
            ax.axhline(1 - lo, color="k", ls="--", lw=0.8)
            ax.axhline(1 + hi, color="k", ls="--", lw=0.8)
        outside = 0
        for q in QUAD_ORDER:
            h = g[g["quadrant"] == q]
            inside = h[(h["ratio"] >= y_lo) & (h["ratio"] <= y_hi)]
            ax.scatter(inside["prob"], inside["ratio"], s=5, alpha=0.5, color=QUAD_COLORS[q], lw=0,
                       rasterized=True)
            above, below = h[h["ratio"] > y_hi], h[h["ratio"] < y_lo]
            ax.scatter(above["prob"], [y_hi] * len(above), marker="^", s=14, color=QUAD_COLORS[q], clip_on=False)
            ax.scatter(below["prob"], [y_lo] * len(below), marker="v", s=14, color=QUAD_COLORS[q], clip_on=False)
            outside += len(above) + len(below)
        share = outside / max(1, len(g))
        ax.set_title(f"{run}  ({len(g)} tokens, {share:.1%} off the axis)", fontsize=9)
        ax.set_xlim(0, 1)
        ax.set_ylim(y_lo, y_hi)
    _bottom_labels(axes, len(runs[:6]), "sampling probability p = pi_old(a)")
    for ax in axes[:, 0]:
        ax.set_ylabel("importance ratio r")
    handles = [Line2D([], [], ls="", marker="o", color=QUAD_COLORS[q], label=q) for q in QUAD_ORDER]
    handles.append(Line2D([], [], ls="--", color="k", lw=0.8, label="1 - eps_low, 1 + eps_high"))
    handles.append(Line2D([], [], ls="", marker="^", color="0.4", label="beyond the axis"))
    _top_legend(fig, handles, panels_height=3.3 * rows)
    return fig


def _top_legend(fig, handles, *, panels_height: float, fontsize: int = 8) -> None:
    """One legend above the panels, in as many columns as fit the figure's width (a one-panel figure
    cannot hold six entries in a row); the figure grows by the legend's height, the panels stay below it."""
    renderer = fig.canvas.get_renderer()
    width = fig.get_figwidth() * fig.dpi
    for ncol in range(len(handles), 0, -1):
        legend = fig.legend(handles=handles, loc="upper center", ncol=ncol, fontsize=fontsize, frameon=False)
        box = legend.get_window_extent(renderer)
        if box.width <= 0.98 * width or ncol == 1:
            break
        legend.remove()
    legend_in = box.height / fig.dpi + 0.1
    fig.set_figheight(panels_height + legend_in)
    fig.tight_layout(rect=(0, 0, 1, 1 - legend_in / (panels_height + legend_in)))


def grad_share(df):
    """grad_share_by_quadrant -> each quadrant's share of ||dLoss/dz||^2 per step; dotted: the part
    from tokens PPO-clip would drop."""
    d = df.assign(dropped=df["share"] * df["clipped_share"].fillna(0)) if not df.empty else df
    return _quadrant_panels(d, "share", "share of squared logit-grad norm", dotted="dropped",
                            empty="no logit-gradient norms recorded (watch_logits)")


def entropy_ratio_band(df, band=(0.95, 1.05)):
    """entropy_ratio_by_step -> per-token entropy ratio rho = H(pi)/H(pi_old) per step (ERC Sec. 3):
    one panel per method (shared axes), the median as a line, the p05-p95 band shaded, ERC's band
    dashed. Linear axis, cut at the 2nd / 98th percentile of the band edges (a few spikes may leave it;
    the panel title says how many steps)."""
    import numpy as np

    plt = _plt()
    methods = sorted(df["method"].fillna("?").unique()) if not df.empty else []
    n = max(1, len(methods))
    cols = min(2, n)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 2.6 * rows + 0.4), squeeze=False,
                             sharex=True, sharey=True)
    if not methods:
        for ax in axes.flat:
            ax.set_visible(False)
        return _empty(fig)
    colors = method_colors(df)
    lo_edge = np.nanpercentile(df["p05"], 2)
    hi_edge = np.nanpercentile(df["p95"], 98)
    y_lo = min(band[0], lo_edge) - 0.02
    y_hi = max(band[1], hi_edge) + 0.02
    for ax, m in zip(axes.flat, methods):
        d = df[df["method"].fillna("?") == m]
        for _, g in d.sort_values("step").groupby("run"):
            few = len(g) < 3
            ax.fill_between(g["step"], g["p05"], g["p95"], color=colors[m], alpha=0.25, lw=0, step=None)
            if few:  # a short run: the band as error bars, the median as points
                ax.errorbar(g["step"], g["p50"], yerr=[g["p50"] - g["p05"], g["p95"] - g["p50"]],
                            fmt="o", color=colors[m], ms=4, capsize=3)
            else:
                ax.plot(g["step"], g["p50"], color=colors[m], lw=1.6)
                ax.plot(g["step"], g["p05"], color=colors[m], lw=0.5, alpha=0.6)
                ax.plot(g["step"], g["p95"], color=colors[m], lw=0.5, alpha=0.6)
        for b in band:
            ax.axhline(b, color="k", ls="--", lw=0.8)
        off = int(((d["p05"] < y_lo) | (d["p95"] > y_hi)).sum())
        out = d["outside_band"].mean() if "outside_band" in d else float("nan")
        title = f"{m}: {out:.0%} of tokens outside the band" if out == out else m
        ax.set_title(title + (f" ({off} step(s) beyond the axis)" if off else ""), fontsize=9, color=colors[m])
        ax.set_ylim(y_lo, y_hi)
    _bottom_labels(axes, len(methods), "training step")
    for ax in axes[:, 0]:
        ax.set_ylabel("entropy ratio rho")
    fig.suptitle(f"Entropy ratio per step: median (line), p05-p95 (shaded); dashed: ERC band "
                 f"({band[0]}, {band[1]})", fontsize=10)
    fig.tight_layout()
    return fig


def drift_by_prob(df):
    """drift_by_prob_bin -> mean |log entropy ratio| per sampling-probability bin (ERC Sec. 3)."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    if df.empty:
        return _empty(fig)
    d = df.assign(center=(df["prob_lo"] + df["prob_hi"]) / 2)
    d = d.groupby(["method", "center"], as_index=False)["mean_abs_log_ratio"].mean().assign(run=lambda x: x["method"])
    _lines(ax, d, "center", "mean_abs_log_ratio", method_colors(d))
    for x in (0.2, 0.6):
        ax.axvline(x, color="k", ls=":", lw=0.8)
    ax.set_xlabel("sampling probability bin (center)")
    ax.set_ylabel("mean |log entropy ratio|")
    ax.set_title("Global drift by sampling probability (dotted: 0.2, 0.6)")
    fig.tight_layout()
    return fig


def entropy_change(df):
    """entropy_change_by_quadrant -> measured entropy change per quadrant (relative to the run's mean)
    next to the covariance law's predicted sign (arrows)."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    if df.empty:
        return _empty(fig)
    d = df.groupby(["method", "quadrant"], as_index=False)["relative_dh"].mean()
    colors = method_colors(d)
    methods = list(colors)
    w = 0.8 / max(1, len(methods))
    for i, m in enumerate(methods):
        g = d[d["method"] == m].set_index("quadrant").reindex(QUAD_ORDER)
        xs = [j + (i - (len(methods) - 1) / 2) * w for j in range(4)]
        ax.bar(xs, g["relative_dh"].fillna(0), width=w, color=colors[m], label=m)
    ymax = max(1e-9, d["relative_dh"].abs().max())
    for j, q in enumerate(QUAD_ORDER):
        sign = -1 if q in ("PA&HP", "NA&LP") else 1
        ax.annotate("predicted " + ("+" if sign > 0 else "-"), (j, sign * ymax * 1.05), ha="center",
                    va="bottom" if sign > 0 else "top", fontsize=8, color="0.3")
    ax.axhline(0, color="k", lw=0.8)
    ax.set_xticks(range(4), QUAD_ORDER)
    ax.set_ylim(-ymax * 1.35, ymax * 1.35)
    ax.set_xlabel("quadrant")
    ax.set_ylabel("entropy change (nats), minus run mean")
    ax.set_title("Entropy drift per quadrant vs covariance law\n(confounded: see the entropy budget)")
    ax.legend(title="method", fontsize=8, title_fontsize=8)
    fig.tight_layout()
    return fig


def clipped_prob(df, tau: float = 0.5):
    """clipped_prob_distribution -> sampling probability of the tokens PPO-clip drops, one panel per
    side (low: r < 1-eps_low, A < 0; high: r > 1+eps_high, A > 0), bars per method, tau dotted
    (CE-GPPO Sec. 3: the clipped tokens are mostly low-probability)."""
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.4), sharey=True)
    if df.empty:
        return _empty(fig, "no token was clipped in these runs")
    d = df.groupby(["method", "side", "prob_lo", "prob_hi"], as_index=False)["tokens"].sum()
    d["share"] = d["tokens"] / d.groupby(["method", "side"])["tokens"].transform("sum")
    colors = method_colors(d)
    methods = list(colors)
    for ax, side, title in ((axes[0], "low", "low side: r < 1-eps_low, A < 0"),
                            (axes[1], "high", "high side: r > 1+eps_high, A > 0")):
        s_ = d[d["side"] == side]
        if s_.empty:
            ax.text(0.5, 0.5, "no clipped token", ha="center", va="center", color="0.4", transform=ax.transAxes)
        width = float((d["prob_hi"] - d["prob_lo"]).min()) if len(d) else 0.1
        w = width * 0.85 / max(1, len(methods))
        for i, m in enumerate(methods):
            g = s_[s_["method"] == m]
            xs = g["prob_lo"] + width * 0.075 + (i + 0.5) * w
            ax.bar(xs, g["share"] * 100, width=w, color=colors[m], label=m)
        ax.axvline(tau, color="k", ls=":", lw=0.9)
        ax.set_xlim(0, 1)
        ax.set_title(title)
        ax.set_xlabel(f"sampling probability p (dotted: tau = {tau})")
    axes[0].set_ylabel("% of the side's clipped tokens")
    axes[0].legend(title="method", fontsize=8, title_fontsize=8)
    fig.tight_layout()
    return fig


def _run_panels(runs: list, max_runs: int = 6, width: float = 4.6, height: float = 3.2):
    plt = _plt()
    n = max(1, min(max_runs, len(runs)))
    cols = min(3, n)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(width * cols, height * rows), squeeze=False)
    for ax in list(axes.flat)[n:]:
        ax.set_visible(False)
    return fig, list(axes.flat)[:n]


def entropy_budget(df):
    """entropy_budget_by_step -> the entropy budget per step: each quadrant's first-order entropy effect
    (sum of g s / T^2 over its tokens) stacked, raising quadrants above 0, lowering ones below;
    black: the step's total. One panel per run (at most 6). CE-GPPO Sec. 3, measured per token."""
    runs = list(dict.fromkeys(df["run"])) if not df.empty else []
    fig, axes = _run_panels(runs)
    if df.empty or df["effect"].isna().all():
        return _empty(fig, "no entropy attribution recorded (entropy_sensitivity)")
    import numpy as np

    for ax, run in zip(axes, runs):
        g = df[df["run"] == run]
        steps = np.array(sorted(g["step"].unique()))
        # one filled staircase per quadrant and side (bars of width 1 centred on each step, a step
        # without rows at 0): a few artists instead of one rectangle per step, quadrant and side
        grid = np.arange(steps[0], steps[-1] + 1)
        edges = np.append(grid - 0.5, grid[-1] + 0.5)
        up, down = np.zeros(len(grid)), np.zeros(len(grid))
        for q in QUAD_ORDER:
            v = g[g["quadrant"] == q].groupby("step")["effect"].sum().reindex(grid).fillna(0).to_numpy()
            pos, neg = np.clip(v, 0, None), np.clip(v, None, 0)
            ax.stairs(up + pos, edges, baseline=up, fill=True, color=QUAD_COLORS[q], label=q, lw=0)
            ax.stairs(down + neg, edges, baseline=down, fill=True, color=QUAD_COLORS[q], lw=0)
            up, down = up + pos, down + neg
        total = g.groupby("step")["step_effect"].first().reindex(steps)
        ax.plot(steps, total, color="k", lw=1.0, label="step total")
        ax.axhline(0, color="k", lw=0.6)
        ax.set_title(_label(str(run), str(g["method"].iloc[0])), fontsize=9)
        ax.set_xlabel("training step")
        ax.set_ylabel("first-order dH per unit logit step")
    axes[0].legend(fontsize=7, ncol=2)
    fig.tight_layout()
    return fig


def clipping_removed(df):
    """entropy_budget_by_step -> what clipping took away: each quadrant's dropped entropy effect
    (sum over the run's steps of (g_unclipped - g) s / T^2, mean over a method's runs), beside the
    effect its gradient kept. CE-GPPO's argument: PA&LP (high side) and NA&LP (low side) dominate."""
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.4))
    if df.empty or df["effect"].isna().all():
        return _empty(fig, "no entropy attribution recorded (entropy_sensitivity)")
    d = (df.groupby(["method", "run", "quadrant"], as_index=False)[["effect", "dropped"]].sum()
         .groupby(["method", "quadrant"], as_index=False)[["effect", "dropped"]].mean())
    colors = method_colors(d)
    methods = list(colors)
    w = 0.8 / max(1, len(methods))
    for ax, col, title in ((axes[0], "dropped", "taken away by clipping / beta / ERC / dual-clip"),
                           (axes[1], "effect", "kept: the gradient actually applied")):
        for i, m in enumerate(methods):
            g = d[d["method"] == m].set_index("quadrant").reindex(QUAD_ORDER)
            xs = [j + (i - (len(methods) - 1) / 2) * w for j in range(4)]
            ax.bar(xs, g[col].fillna(0), width=w, color=colors[m], label=m)
        ax.axhline(0, color="k", lw=0.6)
        ax.set_xticks(range(4), QUAD_ORDER)
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("quadrant")
    axes[0].set_ylabel("summed first-order dH (per run)")
    axes[0].legend(title="method", fontsize=8, title_fontsize=8)
    fig.tight_layout()
    return fig


def probe_vs_measured(df):
    """probe_vs_measured -> left: the probe's predicted entropy change of each probed update against
    the measured one (dashed: y = x); right: mean predicted dH per quadrant's kept gradient (solid)
    and dropped part (hatched), per method. Parameter-space counterpart of the entropy budget."""
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    if df.empty:
        return _empty(fig, "no probes recorded (Recorder.probe / demo --probe-every K)")
    colors = method_colors(df)
    st = df[df["part"] == "step"]
    for m, g in st.groupby("method"):
        axes[0].scatter(g["measured_dh"], g["predicted_dh"], s=14, color=colors[m], label=m)
    lim = max(1e-12, float(st[["measured_dh", "predicted_dh"]].abs().max().max()) * 1.1)
    axes[0].plot([-lim, lim], [-lim, lim], color="k", ls="--", lw=0.8)
    axes[0].set_xlim(-lim, lim)
    axes[0].set_ylim(-lim, lim)
    axes[0].set_xlabel("measured dH (after the real step)")
    axes[0].set_ylabel("predicted dH = grad(H) . step")
    axes[0].set_title("probed updates", fontsize=9)
    axes[0].legend(title="method", fontsize=8, title_fontsize=8)
    methods = list(colors)
    w = 0.8 / max(1, len(methods))
    for i, m in enumerate(methods):
        g = df[df["method"] == m].groupby("part")["predicted_dh"].mean()
        xs = [j + (i - (len(methods) - 1) / 2) * w for j in range(4)]
        axes[1].bar(xs, [g.get(q, 0.0) for q in QUAD_ORDER], width=w, color=colors[m], label=m)
        axes[1].bar(xs, [g.get(f"{q} dropped", 0.0) for q in QUAD_ORDER], width=w * 0.5, color="none",
                    edgecolor=colors[m], hatch="///", lw=0.8)
    axes[1].axhline(0, color="k", lw=0.6)
    axes[1].set_xticks(range(4), QUAD_ORDER)
    axes[1].set_ylabel("mean predicted dH per probe")
    axes[1].set_title("per quadrant: kept (solid), dropped (hatched)", fontsize=9)
    fig.tight_layout()
    return fig
