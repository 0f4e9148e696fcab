"""One function per paper figure: a DataFrame from an analysis in, a matplotlib Figure out. No I/O.

Lines, bars and panels are drawn per *series*: the frame's string column ``series`` (report/build.py sets
one label per run, or one per group with ``entropylens report --group-by KEY``); without it, per run
(labelled by :func:`_label`). Colours follow the sorted series names. Where several runs share a
series, a line is the mean over those runs per step with the runs' spread shaded (``band="minmax"``:
min..max, the default; ``band="sd"``: mean +- 1 sd), a bar is the mean with an error bar of the same
kind, and a per-run panel pools the runs. Long runs: step lines draw the raw per-step value faint and a
centred rolling mean of :func:`smooth_window` steps bold. Every threshold drawn comes from the
runs' own rows (eps, tau, the ERC band); the papers' numbers are drawn only as labelled references.

Every plot function takes the keyword-only ``band`` and ``legend_title`` (the legend's heading, e.g.
"run" or "lr"). Each function's docstring names the analysis it takes and the figure it mirrors;
build.py writes the files.
"""

from __future__ import annotations

import math
import textwrap

from .escape import plot_text
from .palette import QUADRANT_COLORS, RUN_COLORS

QUAD_ORDER = ("PA&HP", "PA&LP", "NA&HP", "NA&LP")
QUAD_COLORS = QUADRANT_COLORS  # one fixed palette for quadrants in every figure and the viewer (palette.py)
_PALETTE = RUN_COLORS
MAX_LEGEND = 12  # series entries in a legend; more are summed up in one "... and N more" entry
MAX_PANELS = 6  # panels of a one-panel-per-series figure; the figure says how many are not shown
ERC_PAPER_BAND = (0.95, 1.05)  # the ERC paper's scripts: drawn, as a reference, only for runs without ERC
ERC_PAPER_DRIFT = (0.2, 0.6)  # the ERC paper: global drift strongest below 0.2 and above 0.6
DEFAULT_TAU = 0.5  # entropylens' default HP / LP threshold (the papers give none): only where no run says
# the low side can only clip A < 0 tokens, the high side only A > 0 ones (the advantage-gated definition)
LOW_SIDE = ("NA&HP", "NA&LP")
HIGH_SIDE = ("PA&HP", "PA&LP")
_BANDS = ("minmax", "sd")


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update(
        {
            "figure.dpi": 100,
            "axes.grid": True,
            "grid.alpha": 0.3,
            "font.size": 9,
            "axes.spines.top": False,
            "axes.spines.right": False,
        }
    )
    return plt


# ------------------------------------------------------------------ series, colours, legends
def _label(run: str, method: str) -> str:
    return run if run.startswith(str(method)) else f"{run} ({method})"


def _run_labels(df):
    """Each row's run, labelled as a legend says it (:func:`_label`): the fallback series."""
    import pandas as pd

    if "run" not in df:
        return (
            df["method"].fillna("?").astype(str) if "method" in df else pd.Series("all", index=df.index, dtype=object)
        )
    runs = df["run"].astype(str)
    if "method" not in df:
        return runs
    first = df.assign(_run=runs, _m=df["method"].fillna("?").astype(str)).groupby("_run", sort=False)["_m"].first()
    return runs.map({r: _label(r, m) for r, m in first.items()})


def _prep(df):
    """A copy of ``df`` with ``_s`` (the series label, as drawn: escape.plot_text) and ``_r`` (the run id)
    columns."""
    labels = _run_labels(df)
    if "series" in df and df["series"].notna().any():
        s = df["series"].astype(object)
        labels = s.where(s.notna(), labels).astype(str)
    runs = df["run"].astype(str) if "run" in df else labels
    return df.assign(_s=labels.astype(str).map(plot_text), _r=runs)


def series_names(df) -> list[str]:
    """The series of ``df`` in drawing order (sorted): the ``series`` column, else the runs' labels."""
    return sorted(_prep(df)["_s"].unique()) if len(df) else []


def _listed(name: str) -> list[str]:
    """A listed colormap's colours as hex, in order."""
    from matplotlib import colormaps
    from matplotlib.colors import to_hex

    cmap = colormaps[name]
    return [to_hex(cmap(i)) for i in range(cmap.N)]


def _big_palette(n: int) -> list[str]:
    # dark shades of every hue first, then the lighter ones: neighbours in sorted order differ in hue
    out = _listed("tab20")[0::2] + _listed("tab20")[1::2]
    if n > 20:
        for shade in range(4):
            out += [c for m in ("tab20b", "tab20c") for c in _listed(m)[shade::4]]
    return out


def series_colors(names) -> dict[str, str]:
    """{series: colour} in sorted order: the 10-colour palette, a 20- or 60-colour one beyond 10 series."""
    names = sorted({str(n) for n in names})
    pal = _PALETTE if len(names) <= len(_PALETTE) else _big_palette(len(names))
    return {n: pal[i % len(pal)] for i, n in enumerate(names)}


def method_colors(df) -> dict[str, str]:
    """{method: colour} (kept for callers that colour by method)."""
    return series_colors(df["method"].fillna("?").unique()) if "method" in df else {}


def _series_handles(colors: dict, names=None, *, kind: str = "line") -> list:
    """Legend handles for the series (at most MAX_LEGEND, then one '... and N more')."""
    from matplotlib.artist import Artist
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    if names is None:
        names = list(colors)
    else:
        wanted = set(names)
        names = [n for n in colors if n in wanted]
    shown = names if len(names) <= MAX_LEGEND + 1 else names[:MAX_LEGEND]
    handles: list[Artist]
    if kind == "bar":
        handles = [Patch(color=colors[n], label=n) for n in shown]
    elif kind == "point":
        handles = [Line2D([], [], ls="", marker="o", color=colors[n], label=n) for n in shown]
    else:
        handles = [Line2D([], [], color=colors[n], lw=1.8, label=n) for n in shown]
    if len(shown) < len(names):
        handles.append(Line2D([], [], ls="", label=f"... and {len(names) - len(shown)} more"))
    return handles


def _check_band(band):
    if band is not None and band not in _BANDS:
        raise ValueError(
            f"band={band!r}: None, 'minmax' or 'sd' (how the runs of a series spread); an ERC band "
            "comes from the frame's band_low / band_high columns"
        )
    return band or "minmax"


def _spread_text(band: str) -> str:
    return "mean +- 1 sd" if band == "sd" else "min..max"


def _notes(window: int, shared: bool, band: str, *, bars: bool = False) -> str:
    """What the lines / bars are, for a title: rolling mean, and the spread over the runs of a series."""
    parts = []
    if window > 1:
        parts.append(f"bold: rolling mean of {window} steps, faint: per step")
    if shared:
        parts.append(
            f"bars: mean over a series' runs, error bars: {_spread_text(band)}"
            if bars
            else f"line: mean over a series' runs, shaded: {_spread_text(band)}"
        )
    return "; ".join(parts)


def _legend_right(fig, handles, title, *, fontsize: int = 8) -> None:
    """One legend right of the axes, outside the data: the figure grows by the legend's width."""
    if not handles:
        fig.tight_layout()
        return
    renderer = fig.canvas.get_renderer()
    legend = fig.legend(
        handles=handles,
        title=title,
        loc="upper left",
        fontsize=fontsize,
        title_fontsize=fontsize,
        frameon=False,
        borderaxespad=0.2,
    )
    width_in = legend.get_window_extent(renderer).width / fig.dpi + 0.15
    base = fig.get_figwidth()
    if width_in > (base + width_in) / 5:  # more than a fifth of the width: above the panels instead
        legend.remove()
        _legend_top(fig, handles, panels_height=fig.get_figheight(), title=title, fontsize=fontsize)
        return
    fig.set_figwidth(base + width_in)
    right = base / (base + width_in)
    fig.tight_layout(rect=(0, 0, right, 1))
    top = max(ax.get_position().y1 for ax in fig.axes if ax.get_visible())
    legend.set_bbox_to_anchor((right, top), transform=fig.transFigure)


def _legend_top(
    fig, handles, *, panels_height: float, title: str | None = None, header: str | None = None, fontsize: int = 8
) -> None:
    """A header line (``header``, the figure's title) and one legend above the panels, in as many columns
    as fit the figure's width; the figure grows by their height, the panels stay below them."""
    renderer = fig.canvas.get_renderer()
    width = fig.get_figwidth() * fig.dpi
    head_in, st = 0.0, None
    if header:
        chars = int(fig.get_figwidth() * 13)
        while True:  # wrapped until it fits the canvas (a 5-inch figure of one run is narrower than the text)
            text = "\n".join(textwrap.fill(line, chars) for line in header.split("\n"))
            # fig.text, not suptitle: tight_layout would reserve the suptitle's height a second time
            st = fig.text(0.5, 1.0, text, fontsize=fontsize + 2, ha="center", va="top")
            if st.get_window_extent(renderer).width <= 0.98 * width or chars <= 20:
                break
            st.remove()
            chars -= 4
        head_in = st.get_window_extent(renderer).height / fig.dpi + 0.08
    legend, leg_in = None, 0.0
    if handles:
        kw = dict(
            loc="upper center",
            fontsize=fontsize,
            frameon=False,
            title=title,
            title_fontsize=fontsize,
            borderaxespad=0.1,
        )
        # one column's width (the widest entry) says how many columns fit: two legends drawn, not one per ncol
        one = fig.legend(handles=handles, ncol=1, **kw)
        col_px = one.get_window_extent(renderer).width
        one.remove()
        gap = 2.0 * fontsize * fig.dpi / 72  # matplotlib's columnspacing, 2 font sizes
        ncol = max(1, min(len(handles), int((0.98 * width + gap) // (col_px + gap))))
        while True:  # the estimate fits (its columns are as wide as the widest entry): narrower ones may too
            legend = fig.legend(handles=handles, ncol=ncol, **kw)
            box = legend.get_window_extent(renderer)
            if box.width <= 0.98 * width or ncol == 1:
                break
            legend.remove()
            ncol -= 1
        tried = ncol
        while tried < len(handles):  # keep the fewest rows that fit the width
            tried += 1
            wider = fig.legend(handles=handles, ncol=tried, **kw)
            wbox = wider.get_window_extent(renderer)
            if wbox.width > 0.98 * width:
                wider.remove()
                break
            if wbox.height < box.height - 1:
                legend.remove()
                legend, box = wider, wbox
            else:
                wider.remove()
        leg_in = box.height / fig.dpi + 0.08
    height = panels_height + head_in + leg_in + 0.06
    fig.set_figheight(height)
    if st is not None:
        st.set_y(1 - 0.04 / height)
    if legend is not None:
        legend.set_bbox_to_anchor((0.5, 1 - (0.04 + head_in) / height), transform=fig.transFigure)
    fig.tight_layout(rect=(0, 0, 1, 1 - (head_in + leg_in + 0.06) / height))


def _top_legend(fig, handles, *, panels_height: float, fontsize: int = 8) -> None:
    """One legend above the panels (kept for callers of the old helper)."""
    _legend_top(fig, handles, panels_height=panels_height, fontsize=fontsize)


def _empty(fig, msg="no data in these runs"):
    for ax in fig.axes:
        ax.set_visible(False)
    fig.text(0.5, 0.5, msg, ha="center", va="center", color="0.4")
    return fig


# ------------------------------------------------------------------ smoothing and aggregation
def smooth_window(n_steps: int) -> int:
    """The rolling-mean window (in steps) of a step-line figure: 1 (no smoothing) below 200 steps, else the
    odd number n_steps // 50 or the one above it (200 -> 5, 1000 -> 21, 5000 -> 101).

    ``n_steps`` is :func:`steps_per_series` of the figure's DataFrame: the number of distinct ``step``
    values of the series that holds the most, counted over every row the figure receives (NaN values
    and all quadrants included). A caption that states the window calls
    ``smooth_window(steps_per_series(df))`` on the same frame."""
    n = int(n_steps)
    if n < 200:
        return 1
    w = max(3, n // 50)
    return w if w % 2 else w + 1


def steps_per_series(df) -> int:
    """The number of distinct ``step`` values in the series of ``df`` that holds the most (0 when empty)."""
    if df is None or len(df) == 0 or "step" not in df:
        return 0
    return int(_prep(df).groupby("_s")["step"].nunique().max())


def _roll(values, window: int):
    import numpy as np
    import pandas as pd

    if window <= 1:
        return np.asarray(values, dtype=float)
    return pd.Series(np.asarray(values, dtype=float)).rolling(window, center=True, min_periods=1).mean().to_numpy()


def _per_series(d, x: str, cols, band: str, window: int = 1):
    """Mean over the runs of each series per ``x`` (each run's mean at x first) and the spread: a frame
    with _s, x, and per column c: c, c_lo, c_hi, c_raw; plus {series: number of runs}. ``window`` > 1:
    each run's values are first replaced by their centred rolling mean over the run's own rows in x
    order (c is then the mean of the runs' rolling means, the spread that of the runs' trends, not of
    per-step noise); c_raw is the mean over runs before smoothing."""
    cols = [cols] if isinstance(cols, str) else list(cols)
    per = d.groupby(["_s", "_r", x], sort=True)[cols].mean()
    raw = per.groupby(level=["_s", x]).mean()
    if window > 1:
        per = per.groupby(level=["_s", "_r"], group_keys=False, sort=False).apply(
            lambda r: r.rolling(window, center=True, min_periods=1).mean()
        )
    g = per.groupby(level=["_s", x])
    mean = g.mean()
    if band == "sd":
        sd = g.std()
        lo, hi = mean - sd, mean + sd
    else:
        lo, hi = g.min(), g.max()
    out = (
        mean.join(lo.add_suffix("_lo"))
        .join(hi.add_suffix("_hi"))
        .join(raw.add_suffix("_raw"))
        .reset_index()
        .sort_values(["_s", x])
    )
    return out, d.groupby("_s")["_r"].nunique().to_dict()


def _series_lines(
    ax,
    d,
    x: str,
    y: str,
    colors,
    *,
    band: str,
    window: int = 1,
    logy: bool = False,
    ls: str = "-",
    spread: bool = True,
    raw: bool = True,
) -> bool:
    """One line per series: the mean over its runs per ``x`` (bold rolling mean over a faint raw line
    when ``window`` > 1), its runs' spread shaded. Returns whether any series holds several runs."""
    import numpy as np

    stats, nruns = _per_series(d, x, y, band, window)
    shared = False
    for s, g in stats.groupby("_s", sort=True):
        xs, m = g[x].to_numpy(), g[y].to_numpy(dtype=float)
        c = colors.get(s, "k")
        few = len(g) < 3
        if spread and nruns.get(s, 1) > 1:
            shared = True
            lo, hi = g[f"{y}_lo"].to_numpy(dtype=float), g[f"{y}_hi"].to_numpy(dtype=float)
            if logy:
                lo = np.where(lo > 0, lo, np.nan)
            if few:
                ax.errorbar(
                    xs,
                    m,
                    yerr=[np.clip(m - lo, 0, None), np.clip(hi - m, 0, None)],
                    fmt="none",
                    ecolor=c,
                    elinewidth=0.9,
                    capsize=3,
                    alpha=0.7,
                )
            else:
                ax.fill_between(xs, lo, hi, color=c, alpha=0.18, lw=0)
        if window > 1:
            if raw:
                ax.plot(xs, g[f"{y}_raw"].to_numpy(dtype=float), color=c, lw=0.5, alpha=0.2, ls=ls, label="_raw " + s)
            ax.plot(xs, m, color=c, lw=1.8, ls=ls, label=s)
        else:
            ax.plot(
                xs, m, color=c, lw=1.4, alpha=0.9, ls=ls, label=s, marker="o" if few else None, ms=4
            )  # a short run shows as points, not nothing
    if logy:
        ax.set_yscale("log")
    return shared


def _bar_stats(d, cat: str, cols, band: str):
    """Per (series, category): the mean over the series' runs of each run's value, lo, hi, runs."""
    stats, nruns = _per_series(d, cat, cols, band)
    return stats.set_index(["_s", cat]), nruns


def _bars(ax, x, height, width: float, colors, *, edgecolor=None, hatch=None, lw: float = 0.0):
    """Bars centred on ``x`` from 0 to ``height`` as ONE PolyCollection (gid "bars"; ax.bar adds one patch
    per bar: seconds for a 50-run figure). Each bar's path starts (x0, 0), (x0, height): a test reads the
    height as vertices[1, 1] - vertices[0, 1]."""
    import numpy as np
    from matplotlib.collections import PolyCollection

    x, h = np.asarray(x, dtype=float), np.asarray(height, dtype=float)
    x0, x1, z = x - width / 2, x + width / 2, np.zeros_like(h)
    verts = np.stack([np.stack([x0, z], 1), np.stack([x0, h], 1), np.stack([x1, h], 1), np.stack([x1, z], 1)], 1)
    coll = PolyCollection(
        verts,  # type: ignore[arg-type]  # the stub wants a Sequence; a 3-D array is matplotlib's fast path
        facecolors=list(colors),
        edgecolors=edgecolor if edgecolor is not None else "none",
        linewidths=lw,
        hatch=hatch,
        gid="bars",
        zorder=2,
    )
    coll.sticky_edges.y.append(0)  # the value axis starts at 0 as ax.bar's does
    ax.add_collection(coll, autolim=True)
    ax.autoscale_view()
    return coll


def _grouped_bars(
    ax,
    stats,
    col: str,
    cats,
    names,
    colors,
    nruns,
    *,
    scale: float = 1.0,
    width: float = 0.8,
    bar_frac: float = 1.0,
    **bar_kw,
):
    """Bars of ``col`` per category, one per series side by side (one bar call), error bars where a
    series holds several runs (one errorbar call); ``bar_frac``: a bar's share of its slot (a narrower
    bar drawn over another). Returns the bars' x positions [series x category]."""
    import numpy as np

    k, n = len(names), len(cats)
    w = width / max(1, k)
    xs = np.arange(n)[None, :] + (np.arange(k)[:, None] - (k - 1) / 2) * w
    idx = [(s, c) for s in names for c in cats]
    m = stats[col].reindex(idx).to_numpy(dtype=float).reshape(k, n) * scale
    _bars(ax, xs.ravel(), np.nan_to_num(m).ravel(), w * bar_frac, np.repeat([colors[s] for s in names], n), **bar_kw)
    multi = np.repeat([nruns.get(s, 1) > 1 for s in names], n).reshape(k, n) & ~np.isnan(m)
    if multi.any():
        lo = stats[f"{col}_lo"].reindex(idx).to_numpy(dtype=float).reshape(k, n) * scale
        hi = stats[f"{col}_hi"].reindex(idx).to_numpy(dtype=float).reshape(k, n) * scale
        multi &= np.nan_to_num(hi - lo) > 0  # no bar for runs that agree (an empty bin: all 0)
    if multi.any():
        err = np.stack([np.clip(m - lo, 0, None)[multi], np.clip(hi - m, 0, None)[multi]])
        ax.errorbar(
            xs[multi],
            m[multi],
            yerr=np.nan_to_num(err),
            fmt="none",
            ecolor="k",
            elinewidth=0.8,
            capsize=min(3, max(1, 60 / max(1, k * n))),
        )
    ax.set_xticks(range(n), cats)
    return xs


# ------------------------------------------------------------------ step lines
def _step_figure(
    df,
    y: str,
    ylabel: str,
    title: str,
    *,
    band=None,
    legend_title="run",
    logy=False,
    window: int | None = None,
    keep=None,
):
    band = _check_band(band)
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    if df.empty or y not in df or df[y].isna().all():
        return _empty(fig)
    window = smooth_window(steps_per_series(df)) if window is None else window
    full = _prep(df)
    colors = series_colors(full["_s"].unique())
    d = full.dropna(subset=[y])
    if keep is not None:
        d = d[keep(d)]
    shared = _series_lines(ax, d, "step", y, colors, band=band, window=window, logy=logy)
    ax.set_xlabel("training step")
    ax.set_ylabel(ylabel)
    note = _notes(window, shared, band)
    ax.set_title(title + (f"\n{note}" if note else ""), fontsize=10 if not note else 9)
    _legend_right(fig, _series_handles(colors, d["_s"].unique()), legend_title)
    return fig


def entropy_vs_step(df, *, band: str | None = None, legend_title: str = "run"):
    """entropy_by_step -> policy entropy H(pi_old) per step (CE-GPPO Fig. 2, 3, 5); the y axis starts at 0
    (entropy is >= 0), so a collapse shows as the fall towards 0 it is."""
    fig = _step_figure(
        df, "old_entropy", "mean token entropy (nats)", "Policy entropy", band=band, legend_title=legend_title
    )
    if fig.axes and fig.axes[0].has_data():
        fig.axes[0].set_ylim(bottom=0)
    return fig


def reward_vs_step(df, *, band: str | None = None, legend_title: str = "run"):
    """reward_by_step -> mean reward per step (CE-GPPO Fig. 2 right, training reward)."""
    return _step_figure(df, "reward", "mean reward", "Reward", band=band, legend_title=legend_title)


def grad_norm_vs_step(df, *, band: str | None = None, legend_title: str = "run"):
    """grad_norm_by_step -> global grad norm before clipping (CE-GPPO Fig. 4 right). Steps with an update
    whose norm is NaN / inf (column ``nonfinite`` > 0: a blow-up, left out of the line's mean) are marked
    with an x at the top of the axis, in their series' colour."""
    fig = _step_figure(
        df, "grad_norm", "gradient norm (L2, before clipping)", "Gradient norm", band=band, legend_title=legend_title
    )
    if df.empty or "nonfinite" not in df or not (df["nonfinite"].fillna(0) > 0).any():
        return fig
    ax = fig.axes[0]
    full = _prep(df)
    colors = series_colors(full["_s"].unique())
    bad = full[full["nonfinite"].fillna(0) > 0]
    for s, g in bad.groupby("_s"):
        ax.scatter(
            g["step"],
            [0.97] * len(g),
            marker="x",
            s=36,
            color=colors.get(s, "k"),
            transform=ax.get_xaxis_transform(),
            clip_on=False,
            zorder=5,
            gid="nonfinite",
        )
    ax.text(0.01, 0.90, "x: a NaN / inf grad norm at this step", transform=ax.transAxes, fontsize=8, color="0.3")
    return fig


def kl_vs_step(df, *, band: str | None = None, legend_title: str = "run"):
    """kl_by_step -> KL(pi_old || pi_theta), k3, log scale (CE-GPPO Fig. 4 left); steps with KL <= 0 are
    left out of the lines (a log axis cannot show them), the smoothing window counts every step."""
    return _step_figure(
        df,
        "kl",
        "KL(old || new), nats (log)",
        "KL to the old policy",
        band=band,
        legend_title=legend_title,
        logy=True,
        keep=lambda d: d["kl"] > 0,
    )


def _integer_ticks():
    from matplotlib.ticker import MaxNLocator

    return MaxNLocator(integer=True)


def _quadrant_panels(
    df,
    y: str,
    ylabel: str,
    *,
    band=None,
    legend_title="run",
    dotted: str | None = None,
    empty="no data in these runs",
    title: str = "",
):
    """One panel per quadrant, ``y`` vs step per series; optional dotted column (same colour). One legend
    above the panels."""
    from matplotlib.lines import Line2D

    band = _check_band(band)
    plt = pyplot()
    height = 3.0
    fig, axes = plt.subplots(1, 4, figsize=(11, height), sharey=True)
    if df.empty:
        return _empty(fig, empty)
    window = smooth_window(steps_per_series(df))
    full = _prep(df)
    colors = series_colors(full["_s"].unique())
    shared = False
    for ax, q in zip(axes, QUAD_ORDER):
        d = full[full["quadrant"] == q]
        if d.empty:
            ax.text(0.5, 0.5, "no tokens", ha="center", va="center", color="0.4", transform=ax.transAxes)
        else:
            shared |= _series_lines(ax, d.dropna(subset=[y]), "step", y, colors, band=band, window=window)
            if dotted is not None:
                _series_lines(
                    ax,
                    d.dropna(subset=[dotted]),
                    "step",
                    dotted,
                    colors,
                    band=band,
                    window=window,
                    ls=":",
                    spread=False,
                    raw=False,
                )
        # the quadrant's own colour behind its name (dark text: the light quadrants stay legible), never a
        # run's colour on the text
        ax.set_title(q, color="black", bbox=dict(facecolor=QUAD_COLORS[q], alpha=0.45, edgecolor="none", pad=2))
        ax.set_xlabel("training step")
        ax.xaxis.set_major_locator(_integer_ticks())  # steps are whole: no 0.5 on a short run
    axes[0].set_ylabel(ylabel)
    handles = _series_handles(colors, full["_s"].unique())
    if dotted is not None:
        handles += [
            Line2D([], [], color="0.3", lw=1.4, label="solid: share"),
            Line2D([], [], color="0.3", lw=1.4, ls=":", label="dotted: part PPO-clip would drop"),
        ]
    note = _notes(window, shared, band)
    _legend_top(fig, handles, panels_height=height, title=legend_title, header=title + (f" ({note})" if note else ""))
    return fig


def quadrant_share(df, *, band: str | None = None, legend_title: str = "run"):
    """quadrant_share_by_step -> share of tokens per quadrant vs step, one panel per quadrant (CE-GPPO
    Fig. 1: the four token types)."""
    return _quadrant_panels(
        df, "share", "share of tokens", band=band, legend_title=legend_title, title="Share of tokens per quadrant"
    )


def grad_share(df, *, band: str | None = None, legend_title: str = "run"):
    """grad_share_by_quadrant -> each quadrant's share of ||dLoss/dz||^2 per step; dotted: the part
    from tokens PPO-clip would drop (CE-GPPO Sec. 3)."""
    d = df.assign(dropped=df["share"] * df["clipped_share"].fillna(0)) if not df.empty else df
    return _quadrant_panels(
        d,
        "share",
        "share of squared logit-grad norm",
        band=band,
        legend_title=legend_title,
        dotted="dropped",
        empty="no logit-gradient norms recorded (watch_logits)",
        title="Share of the squared logit-gradient norm per quadrant",
    )


# ------------------------------------------------------------------ bars
def clip_by_quadrant(df, *, band: str | None = None, legend_title: str = "run"):
    """clip_by_quadrant (whole-run rows) -> clip fraction by quadrant, per series (CE-GPPO Fig. 1 / Sec. 3).
    Each side shows the only two quadrants it can clip: the low side (r < 1 - eps_low, A < 0) NA&HP
    and NA&LP, the high side (r > 1 + eps_high, A > 0) PA&HP and PA&LP."""
    band = _check_band(band)
    plt = pyplot()
    height = 3.4
    fig, axes = plt.subplots(1, 2, figsize=(9, height), sharey=True)
    d = df[df["step"].isna()] if "step" in df else df  # tolerate the old mixed table
    if d.empty:
        return _empty(fig)
    d = _prep(d)
    colors = series_colors(d["_s"].unique())
    names = list(colors)
    stats, nruns = _bar_stats(d, "quadrant", ["clip_low_frac", "clip_high_frac"], band)
    for ax, side, cats, title in (
        (axes[0], "clip_low_frac", LOW_SIDE, "low side: r < 1 - eps_low, A < 0"),
        (axes[1], "clip_high_frac", HIGH_SIDE, "high side: r > 1 + eps_high, A > 0"),
    ):
        _grouped_bars(ax, stats, side, cats, names, colors, nruns, scale=100, width=0.7)
        for j, q in enumerate(cats):  # a quadrant no run has tokens in: say so, not an empty slot
            if "tokens" in d and not (d.loc[d["quadrant"] == q, "tokens"].fillna(0) > 0).any():
                ax.text(
                    j,
                    0.5,
                    f"no {q} tokens",
                    transform=ax.get_xaxis_transform(),
                    ha="center",
                    va="center",
                    fontsize=9,
                    color="0.45",
                    gid="no tokens",
                )
        ax.set_title(title)
        ax.set_xlabel("quadrant")
        ax.set_xlim(-0.6, len(cats) - 0.4)
    axes[0].set_ylabel("tokens clipped (% of quadrant)")
    shared = any(v > 1 for v in nruns.values())
    note = _notes(1, shared, band, bars=True)
    _legend_top(
        fig,
        _series_handles(colors, kind="bar"),
        panels_height=height,
        title=legend_title,
        header="Clipped tokens by quadrant" + (f" ({note})" if note else ""),
    )
    return fig


def entropy_change(df, *, band: str | None = None, legend_title: str = "run"):
    """entropy_change_by_quadrant -> measured entropy change per quadrant (relative to the run's mean)
    next to the covariance law's predicted sign (Cui et al.; CE-GPPO Sec. 3)."""
    import numpy as np

    band = _check_band(band)
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    if df.empty:
        return _empty(fig)
    d = _prep(df)
    colors = series_colors(d["_s"].unique())
    stats, nruns = _bar_stats(d, "quadrant", "relative_dh", band)
    _grouped_bars(ax, stats, "relative_dh", QUAD_ORDER, list(colors), colors, nruns)
    vals = stats[["relative_dh", "relative_dh_lo", "relative_dh_hi"]].to_numpy(dtype=float)
    ymax = max(1e-9, float(np.nanmax(np.abs(vals))) if np.isfinite(vals).any() else 1e-9)
    for j, q in enumerate(QUAD_ORDER):
        sign = -1 if q in ("PA&HP", "NA&LP") else 1
        ax.annotate(
            "predicted " + ("+" if sign > 0 else "-"),
            (j, sign * ymax * 1.05),
            ha="center",
            va="bottom" if sign > 0 else "top",
            fontsize=8,
            color="0.3",
        )
    ax.axhline(0, color="k", lw=0.8)
    ax.set_ylim(-ymax * 1.35, ymax * 1.35)
    ax.set_xlabel("quadrant")
    ax.set_ylabel("entropy change (nats), minus run mean")
    note = _notes(1, any(v > 1 for v in nruns.values()), band, bars=True)
    ax.set_title(
        "Entropy drift per quadrant vs covariance law\n(confounded: see the entropy budget)"
        + (f"\n{note}" if note else ""),
        fontsize=10 if not note else 9,
    )
    _legend_right(fig, _series_handles(colors, kind="bar"), legend_title)
    return fig


def _taus(d, fallback: float) -> dict:
    """{tau: [series]}: each run's own tau (the frame's ``tau`` column), ``fallback`` where none is given."""
    import pandas as pd

    t = d["tau"].astype(float) if "tau" in d else pd.Series(float("nan"), index=d.index)
    t = t.fillna(float(fallback))
    out: dict = {}
    for (tau, s), _ in d.assign(_t=t).groupby(["_t", "_s"], sort=True):
        out.setdefault(float(tau), []).append(s)
    return out


def clipped_prob(df, tau: float = DEFAULT_TAU, *, band: str | None = None, legend_title: str = "run"):
    """clipped_prob_distribution -> sampling probability of the tokens PPO-clip drops, one panel per
    side (low: r < 1-eps_low, A < 0; high: r > 1+eps_high, A > 0), bars per series (each run's share of
    its side's clipped tokens per bin, mean over a series' runs), each run's tau (the frame's ``tau``
    column; ``tau`` where a run has none) dotted and labelled (CE-GPPO Sec. 3: the clipped tokens are
    mostly low-probability)."""
    import numpy as np
    from matplotlib.lines import Line2D

    band = _check_band(band)
    plt = pyplot()
    height = 3.4
    fig, axes = plt.subplots(1, 2, figsize=(10, height), sharey=True)
    if df.empty:
        return _empty(fig, "no token was clipped in these runs")
    d = _prep(df)
    colors = series_colors(d["_s"].unique())
    names = list(colors)
    bins = d.groupby(["prob_lo", "prob_hi"], as_index=False).size()[["prob_lo", "prob_hi"]]
    width = float((bins["prob_hi"] - bins["prob_lo"]).min()) if len(bins) else 0.1
    t = d.groupby(["_s", "_r", "side", "prob_lo"], as_index=False)["tokens"].sum()
    # each run's share per bin, 0 in the bins where a run that clipped on this side has none
    full = t.pivot_table(index=["_s", "_r", "side"], columns="prob_lo", values="tokens", aggfunc="sum", fill_value=0)
    share = full.div(full.sum(axis=1), axis=0).stack().rename("share").reset_index()
    nruns_all = d.groupby("_s")["_r"].nunique().to_dict()
    taus = _taus(d, tau)
    for ax, side, title in (
        (axes[0], "low", "low side: r < 1-eps_low, A < 0"),
        (axes[1], "high", "high side: r > 1+eps_high, A > 0"),
    ):
        s_ = share[share["side"] == side]
        if s_.empty:
            ax.text(0.5, 0.5, "no clipped token", ha="center", va="center", color="0.4", transform=ax.transAxes)
        else:
            stats, nruns = _bar_stats(s_, "prob_lo", "share", band)
            here = [n for n in names if n in set(s_["_s"])]
            lo_edges = np.array(sorted(s_["prob_lo"].unique()), dtype=float)
            k = len(here)
            w = width * 0.85 / max(1, k)
            xs = lo_edges[None, :] + width * 0.075 + (np.arange(k)[:, None] + 0.5) * w
            idx = [(s, b) for s in here for b in lo_edges]
            m = stats["share"].reindex(idx).to_numpy(dtype=float).reshape(k, len(lo_edges)) * 100
            _bars(ax, xs.ravel(), np.nan_to_num(m).ravel(), w, np.repeat([colors[s] for s in here], len(lo_edges)))
            multi = np.repeat([nruns.get(s, 1) > 1 for s in here], len(lo_edges)).reshape(m.shape) & ~np.isnan(m)
            if multi.any():
                lo = stats["share_lo"].reindex(idx).to_numpy(dtype=float).reshape(m.shape) * 100
                hi = stats["share_hi"].reindex(idx).to_numpy(dtype=float).reshape(m.shape) * 100
                multi &= np.nan_to_num(hi - lo) > 0
            if multi.any():
                ax.errorbar(
                    xs[multi],
                    m[multi],
                    fmt="none",
                    ecolor="k",
                    elinewidth=0.7,
                    capsize=1.5,
                    yerr=np.nan_to_num(np.stack([np.clip(m - lo, 0, None)[multi], np.clip(hi - m, 0, None)[multi]])),
                )
        for value in taus:
            ax.axvline(value, color="k", ls=":", lw=1.0)
            ax.annotate(
                f"tau = {value:g}",
                (value, 1.0),
                xycoords=("data", "axes fraction"),
                xytext=(3, -3),
                textcoords="offset points",
                ha="left",
                va="top",
                fontsize=8,
                color="0.25",
            )
        ax.set_xlim(0, 1)
        ax.set_title(title)
        ax.set_xlabel("sampling probability p = pi_old(a)")
    axes[0].set_ylabel("% of the side's clipped tokens")
    handles = _series_handles(colors, kind="bar")
    if len(taus) == 1:
        handles.append(Line2D([], [], color="k", ls=":", label=f"tau = {next(iter(taus)):g}: HP / LP threshold"))
    else:
        for value, who in taus.items():
            who_text = ", ".join(who[:3]) + (f" +{len(who) - 3}" if len(who) > 3 else "")
            handles.append(Line2D([], [], color="k", ls=":", label=f"tau = {value:g} ({who_text})"))
    note = _notes(1, any(v > 1 for v in nruns_all.values()), band, bars=True)
    _legend_top(
        fig,
        handles,
        panels_height=height,
        title=legend_title,
        header="Sampling probability of the clipped tokens" + (f" ({note})" if note else ""),
    )
    return fig


def clipping_removed(df, *, band: str | None = None, legend_title: str = "run"):
    """entropy_budget_by_step -> what clipping took away: each quadrant's dropped entropy effect
    (sum over a run's steps of (g_unclipped - g) s / T^2, mean over a series' runs), beside the
    effect its gradient kept. CE-GPPO's argument: PA&LP (high side) and NA&LP (low side) dominate."""
    band = _check_band(band)
    plt = pyplot()
    height = 3.4
    fig, axes = plt.subplots(1, 2, figsize=(10, height))
    if df.empty or df["effect"].isna().all():
        return _empty(fig, "no entropy attribution recorded (entropy_sensitivity)")
    d = _prep(df)
    colors = series_colors(d["_s"].unique())
    runs = d.groupby(["_s", "_r", "quadrant"], as_index=False)[["effect", "dropped"]].sum()
    stats, nruns = _bar_stats(runs, "quadrant", ["effect", "dropped"], band)
    for ax, col, title in (
        (axes[0], "dropped", "taken away by clipping / beta / ERC / dual-clip"),
        (axes[1], "effect", "kept: the gradient actually applied"),
    ):
        _grouped_bars(ax, stats, col, QUAD_ORDER, list(colors), colors, nruns)
        ax.axhline(0, color="k", lw=0.6)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("quadrant")
    axes[0].set_ylabel("entropy push summed over the run\n(first-order, per unit step)")
    note = _notes(1, any(v > 1 for v in nruns.values()), band, bars=True)
    _legend_top(
        fig,
        _series_handles(colors, kind="bar"),
        panels_height=height,
        title=legend_title,
        header="Entropy effect removed and kept, by quadrant" + (f" ({note})" if note else ""),
    )
    return fig


def probe_vs_measured(df, *, band: str | None = None, legend_title: str = "run"):
    """probe_vs_measured -> left: the probe's predicted entropy change of each probed update against
    the measured one (dashed: y = x); right: mean predicted dH per quadrant's kept gradient (solid)
    and dropped part (hatched), per series (mean over its runs of each run's mean). Parameter-space
    counterpart of the entropy budget (CE-GPPO Sec. 3)."""
    band = _check_band(band)
    plt = pyplot()
    height = 3.6
    fig, axes = plt.subplots(1, 2, figsize=(10, height))
    if df.empty:
        return _empty(fig, "no probes recorded (Recorder.probe / demo --probe-every K)")
    d = _prep(df)
    colors = series_colors(d["_s"].unique())
    names = list(colors)
    st = d[d["part"] == "step"]
    for s, g in st.groupby("_s", sort=True):
        axes[0].scatter(g["measured_dh"], g["predicted_dh"], s=14, color=colors[s], label=s)
    lim = max(1e-12, float(st[["measured_dh", "predicted_dh"]].abs().max().max()) * 1.1) if len(st) else 1.0
    if lim != lim:
        lim = 1.0
    axes[0].plot([-lim, lim], [-lim, lim], color="k", ls="--", lw=0.8)
    axes[0].set_xlim(-lim, lim)
    axes[0].set_ylim(-lim, lim)
    axes[0].set_xlabel("measured dH (after the real step)")
    axes[0].set_ylabel("predicted dH = grad(H) . step")
    axes[0].set_title("probed updates", fontsize=10)
    kept = d[d["part"].isin(QUAD_ORDER)]
    dropped = d[d["part"].isin([f"{q} dropped" for q in QUAD_ORDER])]
    dropped = dropped.assign(part=dropped["part"].str.replace(" dropped", "", regex=False))
    nruns = {}
    if len(kept):
        stats, nruns = _bar_stats(kept, "part", "predicted_dh", band)
        _grouped_bars(axes[1], stats, "predicted_dh", QUAD_ORDER, names, colors, nruns)
    if len(dropped):
        stats_d, nd = _bar_stats(dropped, "part", "predicted_dh", band)
        _grouped_bars(
            axes[1],
            stats_d,
            "predicted_dh",
            QUAD_ORDER,
            names,
            {n: "none" for n in names},
            nd,
            bar_frac=0.5,
            edgecolor=[colors[n] for n in names for _ in QUAD_ORDER],
            hatch="///",
            lw=0.8,
        )
    axes[1].set_xticks(range(4), QUAD_ORDER)
    axes[1].axhline(0, color="k", lw=0.6)
    axes[1].set_ylabel("mean predicted dH per probe")
    axes[1].set_title("per quadrant: kept (solid), dropped (hatched)", fontsize=10)
    note = _notes(1, any(v > 1 for v in nruns.values()), band, bars=True)
    _legend_top(
        fig,
        _series_handles(colors, kind="bar"),
        panels_height=height,
        title=legend_title,
        header="Parameter-space probe" + (f" ({note})" if note else ""),
    )
    return fig


# ------------------------------------------------------------------ panels per series
def _series_grid(d, shown, *, cols: int, width: float, height: float, sharey: bool = True):
    """One panel per series of ``shown`` (seaborn's FacetGrid over ``_s``, wrapped after ``cols``, x shared,
    inner tick labels hidden; unused slots are not drawn): the grid and its number of rows."""
    import seaborn as sns

    pyplot()
    cols = min(cols, len(shown))
    grid = sns.FacetGrid(
        d[d["_s"].isin(shown)],
        col="_s",
        col_order=shown,
        col_wrap=cols,
        height=height,
        aspect=width / height,
        sharex=True,
        sharey=sharey,
    )
    return grid, math.ceil(len(shown) / cols)


def _not_shown(names: list, n_shown: int, legend_title: str) -> str:
    """'one panel per run: 6 of 9 shown; not shown: a, b, c' ('' when every series has its panel)."""
    hidden = list(names)[n_shown:]
    if not hidden:
        return ""
    if len(hidden) <= 3:
        return f"one panel per {legend_title}: {n_shown} of {len(names)} shown; not shown: {', '.join(hidden)}"
    return (
        f"one panel per {legend_title}: the first {n_shown} of {len(names)} (sorted by name) shown, "
        f"{len(hidden)} not shown"
    )


def ratio_vs_prob(df, *, span: float = 3.0, band: str | None = None, legend_title: str = "run"):
    """ratio_vs_prob -> importance ratio vs sampling probability, hue by quadrant, with each run's clip
    interval [1-eps_low, 1+eps_high] (its eps_low / eps_high columns) shaded (CE-GPPO Fig. 1 left). One
    panel per series (its runs' points pooled; at most 6, the figure says how many are not shown), shared
    linear y axis centred on 1 and ``span`` times the widest clip interval wide; points beyond it are
    drawn on the edge as triangles (counted in the panel title); one legend for the figure. ``band``:
    accepted for the common signature (points have no spread)."""
    import numpy as np
    import seaborn as sns
    from matplotlib.lines import Line2D

    _check_band(band)
    plt = pyplot()
    if df.empty:
        fig, _ = plt.subplots(figsize=(4.2, 3.8))
        return _empty(fig)
    d = _prep(df)
    names = sorted(d["_s"].unique())
    shown = names[:MAX_PANELS]
    lows, highs = d["eps_low"].astype(float), d["eps_high"].astype(float)
    r = d["ratio"].astype(float)
    if lows.notna().any() and highs.notna().any():
        y_lo, y_hi = max(0.0, 1 - span * lows.max()), 1 + span * highs.max()
    else:  # no run says its clip interval: the axis follows the data
        y_lo, y_hi = max(0.0, float(np.nanpercentile(r, 1))), float(np.nanpercentile(r, 99))
    # a point beyond the axis is drawn on its edge, as a triangle pointing the way it left
    d = d.assign(ratio=r.clip(y_lo, y_hi), _edge=np.select([r > y_hi, r < y_lo], ["above", "below"], "in"))
    grid, rows = _series_grid(d, shown, cols=3, width=4.2, height=3.3)
    kw = dict(x="prob", y="ratio", hue="quadrant", hue_order=QUAD_ORDER, palette=QUAD_COLORS, legend=False)
    for s, ax in grid.axes_dict.items():
        g = d[d["_s"] == s]
        for lo, hi in g[["eps_low", "eps_high"]].astype(float).drop_duplicates().itertuples(index=False):
            if lo == lo and hi == hi:
                ax.axhspan(1 - lo, 1 + hi, color="0.85", alpha=0.6, lw=0, zorder=0)
                ax.axhline(1 - lo, color="k", ls="--", lw=0.8)
                ax.axhline(1 + hi, color="k", ls="--", lw=0.8)
        inside, edge = g[g["_edge"] == "in"], g[g["_edge"] != "in"]
        sns.scatterplot(inside, ax=ax, s=5, alpha=0.5, lw=0, rasterized=True, **kw)
        if len(edge):
            sns.scatterplot(
                edge,
                ax=ax,
                style="_edge",
                markers={"above": "^", "below": "v"},
                s=14,
                lw=1.5,
                edgecolor="face",
                clip_on=False,
                **kw,
            )
        k = g["_r"].nunique()
        runs = f", {k} runs" if k > 1 else ""
        ax.set_title(f"{s}  ({len(g)} tokens{runs}, {len(edge) / max(1, len(g)):.1%} off the axis)", fontsize=9)
    grid.set(xlim=(0, 1), ylim=(y_lo, y_hi))
    grid.set_axis_labels("sampling probability p = pi_old(a)", "importance ratio r")
    handles = [Line2D([], [], ls="", marker="o", color=QUAD_COLORS[q], label=q) for q in QUAD_ORDER]
    handles.append(Line2D([], [], ls="--", color="k", lw=0.8, label="the run's 1 - eps_low, 1 + eps_high"))
    handles.append(Line2D([], [], ls="", marker="^", color="0.4", label="beyond the axis"))
    _legend_top(grid.figure, handles, panels_height=3.3 * rows, header=_not_shown(names, len(shown), legend_title))
    return grid.figure


def _erc_bands(g) -> tuple[list, list]:
    """The runs of ``g`` by band: ([(low, high, runs)] of the runs with ERC (their own band),
    [(low, high, runs)] of the runs without: the reference band they are measured against). A run is
    without ERC where its ``erc`` column is false or its band_low / band_high are NaN; its reference
    band is then the frame's band_low / band_high (what its outside_band was measured against) or,
    where NaN, the ERC paper's (0.95, 1.05)."""
    import numpy as np

    per_run = g.groupby("_r").first()
    lo = per_run["band_low"].astype(float) if "band_low" in per_run else np.nan
    hi = per_run["band_high"].astype(float) if "band_high" in per_run else np.nan
    per_run = per_run.assign(_lo=lo, _hi=hi)
    erc = per_run["_lo"].notna() & per_run["_hi"].notna()
    if "erc" in per_run:
        erc &= per_run["erc"].fillna(False).astype(bool)
    ref = per_run[~erc].assign(
        _lo=lambda x: x["_lo"].fillna(ERC_PAPER_BAND[0]), _hi=lambda x: x["_hi"].fillna(ERC_PAPER_BAND[1])
    )

    def count(x):
        return [(float(a), float(b), int(n)) for (a, b), n in x.groupby(["_lo", "_hi"]).size().items()]

    return count(per_run[erc]), count(ref)


def _ref_name(lo: float, hi: float) -> str:
    if (lo, hi) == ERC_PAPER_BAND:
        return f"the ERC paper's ({lo:g}, {hi:g})"
    return f"the reference ({lo:g}, {hi:g})"


def _band_title(bands, refs, runs: int, out: float) -> str:
    """'ERC band (0.9, 1.1); 3% outside' / "no ERC; 40% outside the ERC paper's (0.95, 1.05)"."""
    parts = [f"ERC band ({lo:g}, {hi:g})" + (f" in {n} of {runs} runs" if n < runs else "") for lo, hi, n in bands]
    no_erc = sum(n for *_, n in refs)
    if no_erc:
        parts.append("no ERC" + (f" in {no_erc} of {runs} runs" if no_erc < runs else ""))
    text = ", ".join(parts)
    if out == out:
        if bands and not refs:
            text += f"; {out:.0%} outside"
        elif refs and not bands and len(refs) == 1:
            text += f"; {out:.0%} outside {_ref_name(*refs[0][:2])}"
        else:
            text += f"; {out:.0%} outside each run's band"
    return text


def entropy_ratio_band(df, *, band: str | None = None, legend_title: str = "run"):
    """entropy_ratio_by_step -> per-token entropy ratio rho = H(pi)/H(pi_old) per step (ERC Sec. 3 / Fig. 1):
    one panel per series (at most 6, the figure says how many are not shown; shared axes), the median
    as a line (mean over a series' runs, their spread shaded darker), the p05-p95 band shaded light.
    Each run's own ERC band (its band_low / band_high columns) is drawn dashed and stated in the panel
    title with the token-weighted share of tokens outside it (outside_band). A run without ERC (NaN
    band, or ``erc`` false) gets its reference band in grey, dotted, labelled as a reference, not as the
    run's: the frame's band_low / band_high where given, else the ERC paper's (0.95, 1.05). Linear
    axis, cut at the 2nd / 98th percentile of the band edges (the panel title says how many steps
    leave it). Long runs: rolling mean (:func:`smooth_window`)."""
    import numpy as np
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    band = _check_band(band)
    plt = pyplot()
    if df.empty:
        fig, _ = plt.subplots(figsize=(5.4, 2.7))
        return _empty(fig)
    d = _prep(df)
    names = sorted(d["_s"].unique())
    shown = names[:MAX_PANELS]
    grid, rows = _series_grid(d, shown, cols=2, width=5.4, height=2.7)
    height = 2.7 * rows
    window = smooth_window(steps_per_series(df))
    colors = series_colors(names)
    d = d[d["_s"].isin(shown)]
    info = {s: _erc_bands(d[d["_s"] == s]) for s in shown}
    edges = [b for bands, refs in info.values() for lo, hi, _ in bands + refs for b in (lo, hi)]
    lo_edge = np.nanpercentile(d["p05"], 2)
    hi_edge = np.nanpercentile(d["p95"], 98)
    y_lo = min([lo_edge] + edges) - 0.02
    y_hi = max([hi_edge] + edges) + 0.02
    shared = False
    wrap = int(5.4 * 12)
    for s, ax in grid.axes_dict.items():
        g = d[d["_s"] == s]
        c = colors[s]
        stats, nruns = _per_series(g, "step", ["p05", "p50", "p95"], band, window)
        xs = stats["step"].to_numpy()
        med = stats["p50"].to_numpy(dtype=float)
        p05, p95 = stats["p05"].to_numpy(dtype=float), stats["p95"].to_numpy(dtype=float)
        if len(stats) < 3:  # a short run: the band as error bars, the median as points
            ax.errorbar(
                xs,
                med,
                yerr=[np.clip(med - p05, 0, None), np.clip(p95 - med, 0, None)],
                fmt="o",
                color=c,
                ms=4,
                capsize=3,
            )
        else:
            ax.fill_between(xs, p05, p95, color=c, alpha=0.2, lw=0)
            ax.plot(xs, p05, color=c, lw=0.5, alpha=0.6)
            ax.plot(xs, p95, color=c, lw=0.5, alpha=0.6)
            if nruns.get(s, 1) > 1:
                shared = True
                ax.fill_between(xs, stats["p50_lo"], stats["p50_hi"], color=c, alpha=0.45, lw=0)
            if window > 1:
                ax.plot(xs, stats["p50_raw"], color=c, lw=0.5, alpha=0.3)
            ax.plot(xs, med, color=c, lw=1.8, label=s)
        bands, refs = info[s]
        for lo, hi, _ in bands:
            for b in (lo, hi):
                ax.axhline(b, color="k", ls="--", lw=0.9, gid="erc band")
        for lo, hi, _ in refs:
            for b in (lo, hi):
                ax.axhline(b, color="0.55", ls=":", lw=1.1, gid="reference band")
        if "outside_band" in g and g["outside_band"].notna().any():
            o = g["outside_band"].astype(float)
            w = g["tokens"].astype(float).where(o.notna(), 0) if "tokens" in g else o.notna().astype(float)
            out = float((o.fillna(0) * w).sum() / w.sum()) if w.sum() > 0 else float(o.mean())
        else:
            out = float("nan")
        off = int(((g["p05"] < y_lo) | (g["p95"] > y_hi)).sum())
        title = f"{s}: {_band_title(bands, refs, g['_r'].nunique(), out)}"
        title += f" ({off} step{'s' if off != 1 else ''} beyond the axis)" if off else ""
        ax.set_title(textwrap.fill(title, wrap), fontsize=9)
    grid.set(ylim=(y_lo, y_hi))
    grid.set_axis_labels("training step", "entropy ratio rho")
    handles = [
        Line2D([], [], color="0.2", lw=1.8, label="median" + (" (mean over runs)" if shared else "")),
        Patch(color="0.2", alpha=0.2, lw=0, label="p05-p95 of the step's tokens"),
    ]
    if shared:
        handles.append(Patch(color="0.2", alpha=0.45, lw=0, label=f"median: {_spread_text(band)} over runs"))
    if any(bands for bands, _ in info.values()):
        handles.append(Line2D([], [], color="k", ls="--", lw=0.9, label="the run's own ERC band"))
    for lo, hi in sorted({(lo, hi) for _, refs in info.values() for lo, hi, _ in refs}):
        whose = "ERC paper's reference band" if (lo, hi) == ERC_PAPER_BAND else "reference band"
        handles.append(
            Line2D(
                [], [], color="0.55", ls=":", lw=1.1, label=f"{whose} ({lo:g}, {hi:g}): a run without ERC, not its own"
            )
        )
    header = "Entropy ratio per step"
    if window > 1:
        header += f" (bold: rolling mean of {window} steps, faint: per step)"
    more = _not_shown(names, len(shown), legend_title)
    _legend_top(grid.figure, handles, panels_height=height, header=header + (f"\n{more}" if more else ""))
    return grid.figure


def drift_by_prob(df, *, band: str | None = None, legend_title: str = "run"):
    """drift_by_prob_bin -> mean |log entropy ratio| per sampling-probability bin, per series (mean over
    its runs, spread shaded); dotted: the ERC paper's reported drift ranges (below 0.2, above 0.6;
    ERC Sec. 3), drawn as the paper's numbers, not this run's."""
    from matplotlib.lines import Line2D

    band = _check_band(band)
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    if df.empty:
        return _empty(fig)
    d = _prep(df)
    d = d.assign(center=(d["prob_lo"] + d["prob_hi"]) / 2)
    colors = series_colors(d["_s"].unique())
    shared = _series_lines(
        ax, d.dropna(subset=["mean_abs_log_ratio"]), "center", "mean_abs_log_ratio", colors, band=band
    )
    for x in ERC_PAPER_DRIFT:
        ax.axvline(x, color="k", ls=":", lw=0.8)
    ax.set_xlim(0, 1)
    ax.set_xlabel("sampling probability bin (center)")
    ax.set_ylabel("mean |log entropy ratio|")
    note = _notes(1, shared, band)
    ax.set_title("Global drift by sampling probability" + (f"\n{note}" if note else ""), fontsize=10 if not note else 9)
    handles = _series_handles(colors)
    handles.append(
        Line2D(
            [],
            [],
            color="k",
            ls=":",
            lw=0.8,
            label=f"ERC paper: drift strongest below\n{ERC_PAPER_DRIFT[0]:g} and above {ERC_PAPER_DRIFT[1]:g}",
        )
    )
    _legend_right(fig, handles, legend_title)
    return fig


def _stairs(ax, edges, lower, upper, color) -> None:
    """A filled staircase between ``lower`` and ``upper`` (one value per bin of ``edges``): one polygon
    (ax.stairs would cost seconds at thousands of steps: it updates the data limits per segment)."""
    import numpy as np

    xx = np.repeat(edges, 2)[1:-1]
    ax.fill_between(xx, np.repeat(lower, 2), np.repeat(upper, 2), color=color, lw=0)


def entropy_budget(df, *, band: str | None = None, legend_title: str = "run"):
    """entropy_budget_by_step -> the entropy budget per step: each quadrant's first-order entropy effect
    (sum of g s / T^2 over its tokens) stacked, raising quadrants above 0, lowering ones below;
    black: the step's total. One panel per series (mean over its runs per step, the total's spread over
    runs shaded grey; at most 6, the figure says how many are not shown); one legend above the panels.
    Long runs: the stacks and the total are rolling means (:func:`smooth_window`), the raw total faint.
    CE-GPPO Sec. 3, measured per token."""
    import numpy as np
    from matplotlib.artist import Artist
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    band = _check_band(band)
    if df.empty or df["effect"].isna().all():
        fig, _ = pyplot().subplots(figsize=(6.4, 3.0))
        return _empty(fig, "no entropy attribution recorded (entropy_sensitivity)")
    d = _prep(df.dropna(subset=["effect"]))
    names = sorted(d["_s"].unique())
    shown = names[:MAX_PANELS]
    grid, rows = _series_grid(d, shown, cols=2, width=5.2, height=3.0, sharey=False)
    height = 3.0 * rows
    window = smooth_window(steps_per_series(df))
    shared = False
    for s, ax in grid.axes_dict.items():
        g = d[d["_s"] == s]
        steps = np.array(sorted(g["step"].unique()))
        # one filled staircase per quadrant and side (bars of width 1 centred on each step, a step
        # without rows at 0): a few artists instead of one rectangle per step, quadrant and side
        at = np.arange(steps[0], steps[-1] + 1)
        edges = np.append(at - 0.5, at[-1] + 0.5)
        per_q = g.groupby(["quadrant", "_r", "step"])["effect"].sum().groupby(level=["quadrant", "step"]).mean()
        up, down = np.zeros(len(at)), np.zeros(len(at))
        for q in QUAD_ORDER:
            v = per_q.get(q)
            v = v.reindex(at).fillna(0).to_numpy() if v is not None else np.zeros(len(at))
            v = _roll(v, window)
            pos, neg = np.clip(v, 0, None), np.clip(v, None, 0)
            _stairs(ax, edges, up, up + pos, QUAD_COLORS[q])
            _stairs(ax, edges, down, down + neg, QUAD_COLORS[q])
            up, down = up + pos, down + neg
        tot = g.groupby(["_r", "step"])["step_effect"].first().reset_index().assign(_s=s)
        stats, nruns = _per_series(tot, "step", "step_effect", band, window)
        xs, m = stats["step"].to_numpy(), stats["step_effect"].to_numpy(dtype=float)
        if nruns.get(s, 1) > 1 and len(xs) > 1:
            shared = True
            ax.fill_between(xs, stats["step_effect_lo"], stats["step_effect_hi"], color="k", alpha=0.2, lw=0)
        if window > 1:
            ax.plot(xs, stats["step_effect_raw"], color="k", lw=0.5, alpha=0.2)
        ax.plot(xs, m, color="k", lw=1.6 if window > 1 else 1.1, marker="o" if len(xs) < 3 else None, ms=4)
        ax.axhline(0, color="k", lw=0.6)
        k = g["_r"].nunique()
        ax.set_title(s + (f" (mean of {k} runs)" if k > 1 else ""), fontsize=11)
        ax.tick_params(labelsize=9)
    grid.set_axis_labels("training step", "entropy push\n(first-order, per unit step)", fontsize=10)
    handles: list[Artist] = [Patch(color=QUAD_COLORS[q], label=q) for q in QUAD_ORDER]
    handles.append(Line2D([], [], color="k", lw=1.6, label="step total"))
    if window > 1:
        handles.append(Line2D([], [], color="k", lw=0.6, alpha=0.35, label="step total, per step (faint)"))
    if shared:
        handles.append(Patch(color="k", alpha=0.2, lw=0, label=f"step total: {_spread_text(band)} over runs"))
    header = "Entropy budget per step: above 0 raises entropy, below 0 lowers it"
    if window > 1:
        header += f" (rolling mean of {window} steps)"
    more = _not_shown(names, len(shown), legend_title)
    _legend_top(grid.figure, handles, panels_height=height, header=header + (f"\n{more}" if more else ""), fontsize=10)
    return grid.figure


# ------------------------------------------------------------------ Cui et al. (entropylens/report/covlaw.py)
def covariance_by_quadrant(df, *, band: str | None = None, legend_title: str = "run"):
    """covariance_by_quadrant -> each quadrant's part of the step's Cov(log pi, A) (its summed
    (A - mean A)(log pi - mean log pi) over the step's tokens; the four parts and ZA add up to the step's
    covariance), one panel per quadrant. Cui et al. 2025: a positive covariance lowers the entropy."""
    fig = _quadrant_panels(
        df,
        "contribution",
        "part of the step's Cov(log pi, A)",
        band=band,
        legend_title=legend_title,
        empty="no token rows with advantage and log-prob",
        title="Covariance of log pi and A per quadrant (above 0: pushes entropy down)",
    )
    for ax in fig.axes:
        if ax.get_visible() and ax.has_data():
            ax.axhline(0, color="k", lw=0.6)
    return fig


def _fit_note(steps: int, min_steps: int) -> str:
    return f"{steps} step{'s' if steps != 1 else ''}: fit not meaningful below {min_steps}"


def covariance_law(df, *, band: str | None = None, legend_title: str = "run"):
    """covariance_law_by_step -> left: the measured entropy change of each step (next step's mean entropy
    minus this one's) against the law's prediction -scale * Cov(log pi, A) (the run's fitted scale), dashed
    y = x, with each run's Pearson r (at most 4 listed); right: both vs step (solid measured, dashed
    predicted). Runs under covlaw.MIN_STEPS fitted steps are drawn as points with a note, no r claimed."""
    import numpy as np
    from matplotlib.lines import Line2D

    from .covlaw import MIN_STEPS, law_summary

    band = _check_band(band)
    plt = pyplot()
    height = 3.6
    fig, axes = plt.subplots(1, 2, figsize=(10, height))
    d = _prep(df.dropna(subset=["measured_dh", "predicted_dh"])) if not df.empty else df
    if df.empty or d.empty:
        return _empty(fig, "fewer than 2 steps with token rows and a mean entropy: no entropy change to predict")
    colors = series_colors(_prep(df)["_s"].unique())
    for s, g in d.groupby("_s", sort=True):
        axes[0].scatter(g["predicted_dh"], g["measured_dh"], s=14, color=colors[s], label=s)
    lim = float(np.nanmax(np.abs(d[["measured_dh", "predicted_dh"]].to_numpy(dtype=float)))) * 1.1 or 1e-9
    axes[0].plot([-lim, lim], [-lim, lim], color="k", ls="--", lw=0.8)
    axes[0].set_xlim(-lim, lim)
    axes[0].set_ylim(-lim, lim)
    axes[0].set_xlabel("predicted dH = -scale * Cov(log pi, A)")
    axes[0].set_ylabel("measured dH (next step - this step)")
    summ = law_summary(df)
    labels = dict(zip(_prep(df)["_r"], _prep(df)["_s"]))
    lines = []
    for row in summ.itertuples():
        name = labels.get(row.run, row.run)
        lines.append(
            f"{name}: r = {row.corr:.2f} ({row.steps} steps)"
            if row.meaningful
            else f"{name}: {_fit_note(row.steps, MIN_STEPS)}"
        )
    if lines:
        more = len(lines) - 4
        axes[0].text(
            0.02,
            0.98,
            "\n".join(lines[:4]) + (f"\n... and {more} more runs" if more > 0 else ""),
            transform=axes[0].transAxes,
            ha="left",
            va="top",
            fontsize=7,
            color="0.2",
            gid="law_r",
            bbox=dict(fc="white", ec="0.8", alpha=0.85, lw=0.5),
            zorder=5,
        )
    axes[0].set_title("each step: measured against predicted", fontsize=10)
    shared = _series_lines(axes[1], d, "step", "measured_dh", colors, band=band)
    _series_lines(axes[1], d, "step", "predicted_dh", colors, band=band, ls="--", spread=False)
    axes[1].axhline(0, color="k", lw=0.6)
    axes[1].set_xlabel("training step")
    axes[1].set_ylabel("entropy change (nats)")
    axes[1].set_title("solid: measured, dashed: predicted", fontsize=10)
    handles = _series_handles(colors, d["_s"].unique())
    handles += [
        Line2D([], [], color="0.3", lw=1.4, label="measured"),
        Line2D([], [], color="0.3", lw=1.4, ls="--", label="predicted"),
    ]
    note = _notes(1, shared, band)
    _legend_top(
        fig,
        handles,
        panels_height=height,
        title=legend_title,
        header="Covariance law: dH ~ -eta Cov(log pi, A), eta fitted per run" + (f" ({note})" if note else ""),
    )
    return fig


def entropy_performance(df, *, band: str | None = None, legend_title: str = "run"):
    """entropy_performance_fit -> each step's mean reward against its mean entropy (points, per series) and
    each run's fitted R = -a exp(H) + b over the entropy range it saw (a line, with a and b listed for at
    most 4 runs). A run under covlaw.MIN_STEPS steps gets no curve, only its points and a note."""
    import numpy as np
    from matplotlib.lines import Line2D

    from .covlaw import MIN_STEPS, fit_summary

    _check_band(band)
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    if df.empty or df["reward"].isna().all():
        return _empty(fig, "no steps with both a reward and a mean entropy")
    d = _prep(df)
    colors = series_colors(d["_s"].unique())
    for s, g in d.groupby("_s", sort=True):
        ax.scatter(g["entropy"], g["reward"], s=12, color=colors[s], alpha=0.7, zorder=3)
    labels = dict(zip(d["_r"], d["_s"]))
    notes = []  # legend entries under the series: each run's a, b (a line in its colour) or why it has none
    for row in fit_summary(df).itertuples():
        name = labels.get(row.run, row.run)
        if row.meaningful:
            h = np.linspace(row.entropy_lo, row.entropy_hi, 100)
            ax.plot(h, row.b - row.a * np.exp(h), color=colors.get(name, "k"), lw=1.4, gid="fit")
            notes.append(
                Line2D(
                    [],
                    [],
                    color=colors.get(name, "k"),
                    lw=1.4,
                    label=f"{name}: a = {row.a:.3g}, b = {row.b:.3g}, RMSE {row.rmse:.2g}",
                )
            )
        elif not row.reward_varies:
            notes.append(Line2D([], [], ls="", label=f"{name}: the reward does not vary, no curve"))
        else:
            notes.append(Line2D([], [], ls="", label=f"{name}: {_fit_note(row.steps, MIN_STEPS)}, no curve"))
    if len(notes) > 4:  # many runs: the legend keeps its height; the caption lists them
        notes = [Line2D([], [], ls="", label=f"{len(notes)} runs: each run's a, b in the caption")]
    ax.set_xlabel("mean token entropy H of the step (nats)")
    ax.set_ylabel("mean reward R of the step")
    ax.set_title(
        "Entropy-performance fit: R = -a exp(H) + b, per run\npoints: steps, lines: each run's fit", fontsize=9
    )
    _legend_right(
        fig,
        _series_handles(colors, d["_s"].unique(), kind="point") + [Line2D([], [], ls="", label="fits:")] + notes,
        legend_title,
    )
    return fig


def mismatch_pooled(d):
    """Per step of one series, the quadrant rows of mismatch_by_quadrant_by_step pooled (token-weighted):
    sampled, mean_abs (mean |old_logprob - sampler_logprob|), mismatched (share of sampled tokens),
    clipped_mm / unclipped_mm (mismatched share of the clipped / other tokens) and effect_mm (the
    mismatched tokens' share of sum |entropy_effect|). NaN where nothing was sampled."""
    import numpy as np

    def pool(g):
        s, c = g["sampled"].astype(float), g["clipped"].fillna(0).astype(float)
        ae = g["abs_effect"].astype(float)

        def wmean(v, w):
            ok = v.notna() & (w > 0)
            return float((v[ok] * w[ok]).sum() / w[ok].sum()) if ok.any() else np.nan

        return {
            "sampled": s.sum(),
            "mean_abs": wmean(g["mean_abs_log_ratio"], s),
            "mismatched": wmean(g["mismatched_frac"], s),
            "clipped_mm": wmean(g["clipped_mismatched_frac"], c),
            "unclipped_mm": wmean(g["unclipped_mismatched_frac"], s - c),
            "effect_mm": wmean(g["abs_effect_mismatched_share"], ae),
        }

    import pandas as pd

    rows = [{"step": step, **pool(g)} for step, g in d.groupby("step", sort=True)]
    return pd.DataFrame(
        rows, columns=["step", "sampled", "mean_abs", "mismatched", "clipped_mm", "unclipped_mm", "effect_mm"]
    )


def mismatch(df, *, band: str | None = None, legend_title: str = "run"):
    """mismatch_by_quadrant_by_step -> one row of two panels per series (TIS / MIS: training-inference
    mismatch). Left: mean |delta log p| = |old_logprob - sampler_logprob| per step, by quadrant (colours)
    and over all tokens (black). Right, per step: the mismatched share (|delta| > the analysis's
    threshold, ln 2, or masked) of the clipped tokens (black), of the other tokens (grey), and the mismatched tokens'
    share of sum |entropy_effect| (black, dashed): no red, green or run colour, which name quadrants and runs. A series whose runs recorded no sampler log-probs (NULL) says so
    in its row instead of drawing zeros. Several runs in a series are pooled (token-weighted)."""
    from matplotlib.ticker import MaxNLocator

    _check_band(band)
    plt = pyplot()
    if df.empty:
        return _empty(plt.figure(figsize=(9.0, 3.0)))
    d = _prep(df)
    names = sorted(d["_s"].unique())
    shown = names[:MAX_PANELS]
    fig, axes = plt.subplots(len(shown), 2, figsize=(10.0, 2.7 * len(shown) + 0.6), squeeze=False)
    for row, name in zip(axes, shown):
        g = d[d["_s"] == name]
        left, right = row
        if not (g["sampled"].fillna(0) > 0).any():
            for ax in row:
                ax.set_axis_off()
            left.text(
                0.0,
                0.5,
                f"{name}: no sampler log-probs recorded (tokens.sampler_logprob is NULL):\n"
                f"nothing to draw, not a mismatch of zero",
                ha="left",
                va="center",
                color="0.3",
                transform=left.transAxes,
            )
            continue
        for q in QUAD_ORDER:
            qd = g[(g["quadrant"] == q) & (g["sampled"] > 0)].groupby("step")
            w = (
                qd.apply(
                    lambda x: (x["mean_abs_log_ratio"] * x["sampled"]).sum() / x["sampled"].sum(), include_groups=False
                )
                if len(g[g["quadrant"] == q])
                else None
            )
            if w is not None and len(w):
                left.plot(w.index, w.values, color=QUAD_COLORS[q], lw=1.0, label=q)
        p = mismatch_pooled(g)
        left.plot(p["step"], p["mean_abs"], color="k", lw=1.6, label="all tokens")
        left.set_ylabel("mean |log p_old - log p_sampler|", fontsize=8)
        left.set_title(f"{name}: |delta log p| by quadrant", fontsize=9)
        mk = "." if len(p) <= 10 else None  # a short run's steps as points
        right.plot(p["step"], p["clipped_mm"], color="k", lw=1.4, marker=mk, label="of the clipped tokens")
        right.plot(p["step"], p["unclipped_mm"], color="0.5", lw=1.2, label="of the other tokens")
        right.plot(p["step"], p["effect_mm"], color="k", lw=1.2, ls="--", label="of sum |entropy effect|")
        right.set_ylim(-0.02, 1.02)
        right.set_ylabel("share on mismatched tokens", fontsize=8)
        right.set_title(f"{name}: mismatched share of clipping, entropy effect", fontsize=9)
        for ax in row:
            ax.set_xlabel("step")
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        left.legend(fontsize=7, loc="upper left")
        right.legend(fontsize=7, loc="upper left")
    hidden = _not_shown(names, len(shown), legend_title)
    if hidden:
        fig.suptitle(hidden, fontsize=8)
    fig.tight_layout()
    return fig
