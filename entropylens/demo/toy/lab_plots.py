"""The claims lab's comparison figure: DataFrame in, matplotlib Figure out, no I/O (claims.figures saves it)."""

from __future__ import annotations

import math

_COLORS = [f"C{k}" for k in range(10) if k != 7]  # C7 is grey: the baseline's colour


def method_paths(df, y: str, *, baseline: str = "grpo", ylabel: str = "", order=None, cols: int = 4, labels=None):
    """Small multiples: one panel per method of ``df`` (columns run, method, step and ``y``, e.g.
    entropy_by_step's old_entropy or reward_by_step's reward), the method's mean over its runs (seeds) per
    step as a line with the min-max band over them, and the baseline's mean in grey on every panel, so
    each method is read against the same reference. Panels in ``order`` (default: sorted, baseline
    first); the y axis is shared. Each panel's title: the method and ``labels[method]`` (default: the
    final value of the mean path, mean of its last 5 steps, and the number of runs). The caller titles
    the figure (what this run shows)."""
    from ...report.plots import pyplot

    plt = pyplot()
    d = df.dropna(subset=[y])
    names = [n for n in (order or sorted(d["method"].unique())) if n in set(d["method"])]
    if baseline in names:
        names = [baseline] + [n for n in names if n != baseline]
    if not names:
        fig, ax = plt.subplots(figsize=(6.4, 3.0))
        ax.text(0.5, 0.5, "no data in these runs", ha="center", va="center", transform=ax.transAxes)
        ax.set_axis_off()
        return fig
    cols = min(cols, len(names))
    rows = math.ceil(len(names) / cols)
    fig, axes = plt.subplots(
        rows, cols, figsize=(3.0 * cols, 2.2 * rows + 0.3), sharex=True, sharey=True, squeeze=False
    )
    per_run = d.groupby(["method", "run", "step"])[y].mean().reset_index()
    stats = per_run.groupby(["method", "step"])[y].agg(["mean", "min", "max"]).reset_index()
    n_runs = per_run.groupby("method")["run"].nunique().to_dict()
    base = stats[stats["method"] == baseline]
    for i, ax in enumerate(axes.flat):
        if i >= len(names):
            ax.set_visible(False)
            continue
        name = names[i]
        g = stats[stats["method"] == name]
        if name != baseline and len(base):
            ax.plot(base["step"], base["mean"], color="0.55", lw=1.2, label=baseline)
        color = "0.2" if name == baseline else _COLORS[i % len(_COLORS)]
        if n_runs.get(name, 1) > 1:
            ax.fill_between(g["step"], g["min"], g["max"], color=color, alpha=0.2, lw=0)
        ax.plot(g["step"], g["mean"], color=color, lw=1.6, marker="o" if len(g) < 3 else None, ms=3)
        label = (labels or {}).get(name) or f"final {g['mean'].tail(5).mean():.3f} (n = {n_runs.get(name, 0)})"
        ax.set_title(f"{name}: {label}", fontsize=8)
        if i % cols == 0:
            ax.set_ylabel(ylabel, fontsize=8)
        if i >= len(names) - cols:  # the lowest panel of its column: its x axis is labelled
            ax.set_xlabel("training step", fontsize=8)
            ax.xaxis.set_tick_params(labelbottom=True)
        ax.tick_params(labelsize=7)
    if y in ("old_entropy", "entropy"):
        axes.flat[0].set_ylim(bottom=0)
    fig.tight_layout()
    return fig


__all__ = ["method_paths"]
