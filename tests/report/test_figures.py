"""The figures users see first are readable, and their captions say what THIS run shows.

Unit tests on the matplotlib Figure objects (axes, scales, legends, markers) and on the measured
captions (hand-made frames whose answer is known); tests/report/test_report_browser.py checks the page.
"""

import matplotlib

matplotlib.use("Agg")

import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import pytest  # noqa: E402

from entropylens.report import captions, plots  # noqa: E402
from entropylens.report.build import FIGURES  # noqa: E402

METHODS = ("ce_gppo", "dapo", "erc_dapo", "grpo")


def ratio_frame(steps=10):
    rows = []
    for i, m in enumerate(METHODS):
        for s in range(steps):
            rows.append(
                dict(
                    run=f"{m}-s0",
                    method=m,
                    step=s,
                    p05=0.8 - 0.01 * i,
                    p50=1.0 - 0.002 * i,
                    p95=1.2 + 0.01 * i,
                    outside_band=0.5 - 0.1 * (m == "erc_dapo"),
                    tokens=100,
                )
            )
    return pd.DataFrame(rows)


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    import matplotlib.pyplot as plt

    plt.close("all")


def visible(fig):
    return [ax for ax in fig.axes if ax.get_visible()]


def bar_heights(ax) -> list[float]:
    """The heights of the bars plots draws as one PolyCollection (gid "bars"), in drawing order."""
    return [
        float(p.vertices[1, 1] - p.vertices[0, 1])
        for c in ax.collections
        if c.get_gid() == "bars"
        for p in c.get_paths()
    ]


def test_entropy_ratio_one_linear_panel_per_method_with_its_median():
    df = ratio_frame()
    fig = plots.entropy_ratio_band(df)
    axes = visible(fig)
    assert len(axes) == 4  # one panel per method: four bands in one panel merge into a grey blob
    for ax, m in zip(axes, METHODS):
        assert ax.get_yscale() == "linear" and m in ax.get_title()
        want = df[df["method"] == m]["p50"].to_numpy()
        medians = [
            ln for ln in ax.get_lines() if len(ln.get_ydata()) == len(want) and np.allclose(ln.get_ydata(), want)
        ]
        assert medians and medians[0].get_linewidth() >= 1.5  # the median is drawn, on top, thick
        lo, hi = ax.get_ylim()
        assert lo < 0.95 and hi > 1.05 and hi - lo < 1.0  # the ERC band is visible, not a sliver
    assert axes[0].get_shared_y_axes().joined(axes[0], axes[3])


def test_ratio_vs_prob_linear_shared_axis_one_legend():
    rng = np.random.default_rng(0)
    n = 200
    df = pd.DataFrame(
        dict(
            run=np.repeat(["a", "b"], n),
            method="grpo",
            step=0,
            prob=rng.uniform(0, 1, 2 * n),
            ratio=np.r_[rng.normal(1, 0.1, 2 * n - 2), 1e-5, 50.0],
            quadrant=rng.choice(["PA&HP", "PA&LP", "NA&HP", "NA&LP"], 2 * n),
            clipped=False,
            eps_low=0.2,
            eps_high=0.28,
        )
    )
    fig = plots.ratio_vs_prob(df)
    axes = visible(fig)
    assert len(axes) == 2
    lo, hi = axes[0].get_ylim()
    assert axes[0].get_yscale() == "linear" and lo <= 0.8 and hi >= 1.28
    assert (1.28 - 0.8) / (hi - lo) > 0.25  # the clip interval takes a good part of the height
    assert axes[0].get_shared_y_axes().joined(axes[0], axes[1])
    assert len(fig.legends) == 1 and all(ax.get_legend() is None for ax in axes)
    assert "off the axis" in axes[1].get_title()  # the two extreme points are counted, drawn on the edge


def test_short_runs_are_drawn_as_markers_not_empty_axes():
    one = pd.DataFrame(dict(run=["a"], method=["grpo"], step=[0], old_entropy=[1.0]))
    fig = plots.entropy_vs_step(one)
    (line,) = fig.axes[0].get_lines()
    assert line.get_marker() == "o" and len(line.get_xdata()) == 1
    fig = plots.entropy_ratio_band(ratio_frame(steps=1))
    assert all(any(ln.get_marker() == "o" for ln in ax.get_lines()) for ax in visible(fig))


def test_clipped_token_probability_histogram_is_in_the_report():
    f = next(f for f in FIGURES if f.analysis == "clipped_prob_distribution")
    assert f.plot is plots.clipped_prob and f.observe is captions.clipped_prob
    df = pd.DataFrame(
        dict(
            run="a",
            method="grpo",
            side=["low", "low", "high"],
            bin=[0, 9, 0],
            prob_lo=[0, 0.9, 0],
            prob_hi=[0.1, 1.0, 0.1],
            tokens=[8, 2, 5],
            share=[0.8, 0.2, 1.0],
            lp_share=[0.8, 0.8, 1.0],
        )
    )
    fig = plots.clipped_prob(df)
    heights = sorted(round(h) for ax in fig.axes for h in bar_heights(ax) if h)
    assert heights == [20, 80, 100]  # % of each side's clipped tokens


def test_captions_measure_the_run_and_flag_disagreement():
    drift = pd.DataFrame(
        dict(
            run="a",
            method="grpo",
            bin=[0, 3, 9],
            prob_lo=[0.0, 0.3, 0.9],
            prob_hi=[0.1, 0.4, 1.0],
            tokens=[10, 10, 10],
            mean_abs_log_ratio=[0.1, 0.3, 0.2],
        )
    )
    text = captions.drift_by_prob(drift)
    assert "largest drift: a (grpo) p in [0.3, 0.4)" in text and "differs from the paper" in text
    drift["mean_abs_log_ratio"] = [0.5, 0.3, 0.2]
    text = captions.drift_by_prob(drift)
    assert "[0, 0.1)" in text and "differs" not in text
    frame = ratio_frame().assign(band_low=0.95, band_high=1.05)
    frame["erc"] = frame["method"] == "erc_dapo"
    text = captions.entropy_ratio(frame)  # erc_dapo: 40% outside vs 50%: fewer, as the paper says
    assert "erc_dapo-s0 40.0% outside (its ERC band (0.95, 1.05)" in text and "as the paper reports" in text
    clipped = pd.DataFrame(
        dict(
            run="a",
            method="grpo",
            side=["low", "high"],
            bin=0,
            prob_lo=0.0,
            prob_hi=0.1,
            tokens=[30, 10],
            share=1.0,
            lp_share=[0.9, 0.2],
        )
    )
    assert captions.clipped_prob(clipped).startswith(
        "Here, share of the clipped tokens with p < tau: a (grpo) 90.0% of 30 low-side, 20.0% of 10 high-side."
    )


def test_report_captions_carry_measured_text(tmp_path):
    from fixture_runs import build

    from entropylens.report.build import write_report

    md = (write_report(build(tmp_path / "runs"), tmp_path / "rep").parent / "report.md").read_text()
    for f in (f for f in FIGURES if not f.optional):  # the fixture records no probes
        line = next(x for x in md.splitlines() if x.startswith(f"*{f.caption}*"))
        assert "Here" in line or "No " in line, line  # the claim AND what this run shows


def _inside_figure(fig, artist) -> bool:
    fig.canvas.draw()
    box = artist.get_window_extent(fig.canvas.get_renderer())
    w, h = fig.canvas.get_width_height()
    return box.x0 >= 0 and box.y0 >= 0 and box.x1 <= w and box.y1 <= h


def test_ratio_vs_prob_legend_inside_the_figure_for_one_to_four_runs():
    """The legend of one to four runs lies inside the figure, above every panel (six entries in one row
    one panel wide would be cropped)."""
    rng = np.random.default_rng(1)
    for n_runs in (1, 2, 4):
        n = 50
        df = pd.DataFrame(
            dict(
                run=np.repeat([f"r{i}" for i in range(n_runs)], n),
                method="grpo",
                step=0,
                prob=rng.uniform(0, 1, n_runs * n),
                ratio=rng.normal(1, 0.1, n_runs * n),
                quadrant=rng.choice(["PA&HP", "PA&LP", "NA&HP", "NA&LP"], n_runs * n),
                clipped=False,
                eps_low=0.2,
                eps_high=0.28,
            )
        )
        fig = plots.ratio_vs_prob(df)
        (legend,) = fig.legends
        assert _inside_figure(fig, legend), n_runs
        top = max(ax.get_tightbbox(fig.canvas.get_renderer()).y1 for ax in visible(fig))
        assert top <= legend.get_window_extent(fig.canvas.get_renderer()).y0 + 1  # no panel under the legend


# ------------------------------------------------------------------ series, bands, smoothing, thresholds
from figure_frames import QUADS, frames, spec  # noqa: E402
from matplotlib.colors import to_hex  # noqa: E402


def series_lines(ax):
    """The bold line of each series (label = the series), {label: Line2D}."""
    return {ln.get_label(): ln for ln in ax.get_lines() if not ln.get_label().startswith("_")}


def legend_texts(fig) -> list[str]:
    legends = list(fig.legends) + [ax.get_legend() for ax in fig.axes if ax.get_legend()]
    return [t.get_text() for lg in legends for t in lg.get_texts()]


def two_lrs(steps=30):
    """Two GRPO runs at two learning rates (one method), a DAPO run: no series column (the fallback)."""
    return frames(
        [
            spec("grpo-lr1e-3", "grpo", lr=1e-3, steps=steps),
            spec("grpo-lr3e-4", "grpo", lr=3e-4, steps=steps),
            spec("dapo-a", "dapo", steps=steps),
        ]
    )


def grouped(band_runs=3, steps=30):
    """Runs of one method at two learning rates, ``band_runs`` seeds each, series = the lr group."""
    return frames(
        [
            spec(f"grpo-lr{lr:g}-s{k}", "grpo", lr=lr, seed=k, steps=steps, series=f"lr={lr:g}")
            for lr in (1e-3, 3e-4)
            for k in range(band_runs)
        ]
    )


def test_two_runs_of_one_method_get_their_own_colour_and_legend_entry():
    f = two_lrs()
    for fn, name in (
        (plots.entropy_vs_step, "entropy_by_step"),
        (plots.reward_vs_step, "reward_by_step"),
        (plots.grad_norm_vs_step, "grad_norm_by_step"),
        (plots.kl_vs_step, "kl_by_step"),
    ):
        fig = fn(f[name])
        lines = series_lines(fig.axes[0])
        assert set(lines) == {"grpo-lr1e-3", "grpo-lr3e-4", "dapo-a"}, fn.__name__
        assert len({to_hex(ln.get_color()) for ln in lines.values()}) == 3, fn.__name__
        assert set(legend_texts(fig)) == set(lines) and fig.legends[0].get_title().get_text() == "run"
    # a run whose id does not name its method is labelled with it
    d = f["entropy_by_step"].replace({"run": {"dapo-a": "baseline"}})
    assert "baseline (dapo)" in series_lines(plots.entropy_vs_step(d).axes[0])


def test_series_column_names_lines_and_legend_title():
    f = grouped(band_runs=1)
    fig = plots.entropy_vs_step(f["entropy_by_step"], legend_title="lr")
    assert set(series_lines(fig.axes[0])) == {"lr=0.001", "lr=0.0003"}
    assert fig.legends[0].get_title().get_text() == "lr"
    # colours follow the sorted series names, the same in every figure
    colors = plots.series_colors(["lr=0.001", "lr=0.0003"])
    assert list(colors) == ["lr=0.0003", "lr=0.001"]
    q = plots.quadrant_share(f["quadrant_share_by_step"], legend_title="lr")
    for ax in q.axes:
        for label, ln in series_lines(ax).items():
            assert to_hex(ln.get_color()) == colors[label]


def _band_at(ax, x0):
    """(low, high) of the shaded spread at x = x0 (the fill_between polygon's vertices there)."""
    (coll,) = [c for c in ax.collections if c.get_gid() != "bars"]
    v = coll.get_paths()[0].vertices
    ys = v[np.isclose(v[:, 0], x0), 1]
    return ys.min(), ys.max()


def test_shared_series_is_the_mean_over_its_runs_with_a_minmax_or_sd_band():
    f = grouped(band_runs=3)
    df = f["entropy_by_step"]
    for band in (None, "minmax", "sd"):
        fig = plots.entropy_vs_step(df, band=band, legend_title="lr")
        ax = fig.axes[0]
        lines = series_lines(ax)
        assert set(lines) == {"lr=0.001", "lr=0.0003"}
        for s, ln in lines.items():
            per_step = df[df["series"] == s].pivot(index="step", columns="run", values="old_entropy")
            assert np.allclose(ln.get_ydata(), per_step.mean(axis=1).to_numpy())
        ax_collections = [c for c in ax.collections]
        assert len(ax_collections) == 2  # one shaded band per series
        s = "lr=0.001"
        per_step = df[df["series"] == s].pivot(index="step", columns="run", values="old_entropy")
        if band == "sd":
            want = (per_step.mean(axis=1) - per_step.std(axis=1), per_step.mean(axis=1) + per_step.std(axis=1))
        else:
            want = (per_step.min(axis=1), per_step.max(axis=1))
        color = to_hex(lines[s].get_color())
        coll = next(c for c in ax.collections if to_hex(c.get_facecolor()[0]) == color)
        v = coll.get_paths()[0].vertices
        for step in (3, 17):
            ys = v[np.isclose(v[:, 0], step), 1]
            assert ys.min() == pytest.approx(want[0][step]) and ys.max() == pytest.approx(want[1][step])
        assert ("mean +- 1 sd" if band == "sd" else "min..max") in ax.get_title()


def test_band_is_an_aggregation_keyword_not_the_erc_band():
    df = ratio_frame()
    with pytest.raises(ValueError, match="band_low"):
        plots.entropy_ratio_band(df, band=(0.95, 1.05))
    with pytest.raises(TypeError):
        plots.entropy_ratio_band(df, (0.95, 1.05))  # keyword-only
    import inspect

    for fn in {f.plot for f in FIGURES}:
        name = fn.__name__
        params = inspect.signature(fn).parameters
        assert params["band"].kind is inspect.Parameter.KEYWORD_ONLY and params["band"].default is None, name
        assert params["legend_title"].default == "run", name


def test_bar_figures_draw_the_mean_of_a_series_with_an_error_bar():
    f = grouped(band_runs=3)
    d = f["clip_by_quadrant"]
    fig = plots.clip_by_quadrant(d, legend_title="lr")
    low = fig.axes[0]
    names = ["lr=0.0003", "lr=0.001"]
    want = d.groupby(["series", "quadrant"])["clip_low_frac"].agg(["mean", "min", "max"]) * 100
    heights = bar_heights(low)  # series-major: [s0 NA&HP, s0 NA&LP, s1 NA&HP, s1 NA&LP]
    assert heights == pytest.approx([want.loc[(s, q), "mean"] for s in names for q in ("NA&HP", "NA&LP")])
    (err,) = [c for c in low.collections if c.get_gid() != "bars"]  # the error bars: one LineCollection
    spans = sorted((float(seg[:, 1].min()), float(seg[:, 1].max())) for seg in err.get_segments())
    expect = sorted((want.loc[(s, "NA&LP"), "min"], want.loc[(s, "NA&LP"), "max"]) for s in names)
    # NA&HP: every run clips the same share, no spread, no error bar; NA&LP: min..max over the 3 runs
    assert np.allclose(spans, expect)
    # entropy_change, clipping_removed, clipped_prob, probe: one bar per (series, category), error bars
    for fn, name in (
        (plots.entropy_change, "entropy_change_by_quadrant"),
        (plots.clipping_removed, "entropy_budget_by_step"),
        (plots.clipped_prob, "clipped_prob_distribution"),
        (plots.probe_vs_measured, "probe_vs_measured"),
    ):
        fig = fn(f[name], legend_title="lr")
        drawn = [ax for ax in fig.axes if bar_heights(ax)]
        assert drawn, fn.__name__
        assert any(c.get_gid() != "bars" for ax in drawn for c in ax.collections), fn.__name__  # error bars
        assert set(names) <= set(legend_texts(fig)), fn.__name__


def test_clip_by_quadrant_draws_only_the_quadrants_each_side_can_clip():
    f = two_lrs()
    fig = plots.clip_by_quadrant(f["clip_by_quadrant"])
    low, high = fig.axes
    assert [t.get_text() for t in low.get_xticklabels()] == ["NA&HP", "NA&LP"]
    assert [t.get_text() for t in high.get_xticklabels()] == ["PA&HP", "PA&LP"]
    assert len(bar_heights(low)) == len(bar_heights(high)) == 2 * 3  # two groups of one bar per series
    d = f["clip_by_quadrant"].set_index(["run", "quadrant"])
    runs = sorted(f["clip_by_quadrant"]["run"].unique())
    assert bar_heights(high) == pytest.approx(
        [100 * d.loc[(r, q), "clip_high_frac"] for r in runs for q in ("PA&HP", "PA&LP")]
    )


def test_per_series_panels_pool_runs_and_say_how_many_are_not_shown():
    f = grouped(band_runs=3)
    fig = plots.ratio_vs_prob(f["ratio_vs_prob"], legend_title="lr")
    axes = visible(fig)
    assert len(axes) == 2
    assert axes[0].get_title().startswith("lr=0.0003") and "900 tokens, 3 runs" in axes[0].get_title()
    fig = plots.entropy_budget(f["entropy_budget_by_step"], legend_title="lr")
    assert len(visible(fig)) == 2 and "mean of 3 runs" in visible(fig)[0].get_title()
    nine = frames([spec(f"r{k}", "grpo", seed=k) for k in range(9)])
    for fn, name in (
        (plots.ratio_vs_prob, "ratio_vs_prob"),
        (plots.entropy_budget, "entropy_budget_by_step"),
        (plots.entropy_ratio_band, "entropy_ratio_by_step"),
    ):
        fig = fn(nine[name])
        assert len(visible(fig)) == 6, fn.__name__
        text = " ".join(t.get_text() for t in fig.texts)
        assert "6 of 9 shown" in text and "r6 (grpo), r7 (grpo), r8 (grpo)" in text, fn.__name__


def test_entropy_ratio_draws_each_runs_own_band_and_the_papers_only_as_a_reference():
    f = frames(
        [
            spec("erc_dapo-a", "erc_dapo", erc=(0.9, 1.1)),
            spec("erc_dapo-b", "erc_dapo", erc=(0.8, 1.2)),
            spec("grpo-a", "grpo"),
        ]
    )
    fig = plots.entropy_ratio_band(f["entropy_ratio_by_step"])
    axes = {ax.get_title().split(":")[0]: ax for ax in visible(fig)}
    assert set(axes) == {"erc_dapo-a", "erc_dapo-b", "grpo-a"}

    def lines(ax, gid):
        return sorted(round(float(ln.get_ydata()[0]), 6) for ln in ax.get_lines() if ln.get_gid() == gid)

    assert lines(axes["erc_dapo-a"], "erc band") == [0.9, 1.1] and not lines(axes["erc_dapo-a"], "reference band")
    assert lines(axes["erc_dapo-b"], "erc band") == [0.8, 1.2]
    assert axes["erc_dapo-a"].get_title() == "erc_dapo-a: ERC band (0.9, 1.1); 3% outside"
    assert lines(axes["grpo-a"], "reference band") == [0.95, 1.05] and not lines(axes["grpo-a"], "erc band")
    ref = [ln for ln in axes["grpo-a"].get_lines() if ln.get_gid() == "reference band"][0]
    assert to_hex(ref.get_color()) == to_hex("0.55")  # grey, not the run's colour or black
    assert "no ERC" in axes["grpo-a"].get_title() and "ERC paper's (0.95, 1.05)" in axes["grpo-a"].get_title()
    assert any("ERC paper's reference band (0.95, 1.05)" in t and "not its own" in t for t in legend_texts(fig))
    # the report's form: a run without ERC carries the reference band it was measured against, erc = false
    d = f["entropy_ratio_by_step"].assign(erc=lambda x: x["band_low"].notna())
    d.loc[~d["erc"], ["band_low", "band_high"]] = (0.9, 1.1)
    fig = plots.entropy_ratio_band(d)
    ax = next(ax for ax in visible(fig) if ax.get_title().startswith("grpo-a"))
    assert lines(ax, "reference band") == [0.9, 1.1] and not lines(ax, "erc band")
    assert "outside the reference (0.9, 1.1)" in ax.get_title()


def test_clipped_prob_draws_each_runs_tau_and_falls_back_to_the_keyword():
    f = frames([spec("a", "grpo", tau=0.3), spec("b", "grpo", tau=0.5)])
    d = f["clipped_prob_distribution"]

    def taus(fig):
        return sorted(
            {
                round(float(ln.get_xdata()[0]), 6)
                for ax in fig.axes
                for ln in ax.get_lines()
                if ln.get_linestyle() == ":"
            }
        )

    fig = plots.clipped_prob(d)
    assert taus(fig) == [0.3, 0.5]
    assert any(t.startswith("tau = 0.3 (a") for t in legend_texts(fig))
    assert {t.get_text() for ax in fig.axes for t in ax.texts} >= {"tau = 0.3", "tau = 0.5"}
    assert taus(plots.clipped_prob(d.drop(columns="tau"), tau=0.4)) == [0.4]  # the keyword, where no run says
    assert taus(plots.clipped_prob(d.assign(tau=np.nan), tau=0.4)) == [0.4]


def test_drift_reference_lines_are_labelled_as_the_papers():
    fig = plots.drift_by_prob(two_lrs()["drift_by_prob_bin"])
    xs = sorted(float(ln.get_xdata()[0]) for ln in fig.axes[0].get_lines() if ln.get_linestyle() == ":")
    assert xs == [0.2, 0.6]
    assert any(t.startswith("ERC paper: drift strongest below") for t in legend_texts(fig))


def test_smooth_window_is_a_pure_function_of_the_steps():
    assert [plots.smooth_window(n) for n in (1, 50, 199, 200, 1000, 5000, 5100)] == [1, 1, 1, 5, 21, 101, 103]
    assert all(plots.smooth_window(n) % 2 == 1 for n in range(200, 20000, 37))
    # steps_per_series: distinct steps of the series that holds the most (two runs of one series, offset)
    df = pd.DataFrame(
        dict(
            run=["a"] * 300 + ["b"] * 300,
            method="grpo",
            series="g",
            step=np.r_[np.arange(300), np.arange(100, 400)],
            old_entropy=1.0,
        )
    )
    assert plots.steps_per_series(df) == 400 and plots.steps_per_series(df.drop(columns="series")) == 300


def test_5000_steps_draw_a_faint_raw_line_under_a_rolling_mean():
    rng = np.random.default_rng(7)
    n = 5000
    y = 1 + 0.5 * np.cos(np.arange(n) / 700) + rng.normal(0, 0.2, n)
    df = pd.DataFrame(dict(run="grpo-long", method="grpo", step=np.arange(n), old_entropy=y, tokens=1))
    w = plots.smooth_window(n)
    assert w == 101
    fig = plots.entropy_vs_step(df)
    ax = fig.axes[0]
    raw = [ln for ln in ax.get_lines() if ln.get_label().startswith("_raw")]
    (smooth,) = series_lines(ax).values()
    assert len(raw) == 1 and raw[0].get_alpha() <= 0.3 and raw[0].get_linewidth() < 1
    assert np.allclose(raw[0].get_ydata(), y)
    assert smooth.get_linewidth() > 1.5 and smooth.get_alpha() in (None, 1)
    got = np.asarray(smooth.get_ydata())
    for i in (0, 30, 2500, 4321, n - 1):  # centred window, truncated at the ends
        assert got[i] == pytest.approx(np.mean(y[max(0, i - w // 2) : i + w // 2 + 1]))
    assert "rolling mean of 101 steps" in ax.get_title()
    # the other step-line figures smooth the same way, and say so
    long = frames([spec("grpo-long", "grpo", steps=n)])
    for fn, name in (
        (plots.quadrant_share, "quadrant_share_by_step"),
        (plots.grad_share, "grad_share_by_quadrant"),
        (plots.entropy_ratio_band, "entropy_ratio_by_step"),
        (plots.entropy_budget, "entropy_budget_by_step"),
        (plots.kl_vs_step, "kl_by_step"),
        (plots.reward_vs_step, "reward_by_step"),
        (plots.grad_norm_vs_step, "grad_norm_by_step"),
    ):
        fig = fn(long[name])
        text = " ".join([t.get_text() for t in fig.texts] + [ax.get_title() for ax in fig.axes])
        assert "rolling mean of 101 steps" in text, fn.__name__
        faint = [
            ln for ax in fig.axes for ln in ax.get_lines() if (ln.get_alpha() or 1) <= 0.35 and len(ln.get_xdata()) == n
        ]
        assert faint, fn.__name__


def test_50_steps_are_not_smoothed():
    df = two_lrs(steps=50)["entropy_by_step"]
    fig = plots.entropy_vs_step(df)
    ax = fig.axes[0]
    assert all((ln.get_alpha() or 1) > 0.5 for ln in ax.get_lines()) and len(ax.get_lines()) == 3
    for run, ln in series_lines(ax).items():
        assert np.allclose(ln.get_ydata(), df[df["run"] == run].sort_values("step")["old_entropy"])
    assert "rolling" not in ax.get_title()


def test_legends_sit_outside_the_data():
    f = two_lrs()
    for fig in (
        plots.kl_vs_step(f["kl_by_step"]),
        plots.entropy_vs_step(f["entropy_by_step"]),
        plots.quadrant_share(f["quadrant_share_by_step"]),
        plots.grad_share(f["grad_share_by_quadrant"]),
        plots.entropy_budget(f["entropy_budget_by_step"]),
        plots.clip_by_quadrant(f["clip_by_quadrant"]),
        plots.entropy_change(f["entropy_change_by_quadrant"]),
    ):
        fig.canvas.draw()
        r = fig.canvas.get_renderer()
        assert all(ax.get_legend() is None for ax in fig.axes) and len(fig.legends) == 1
        box = fig.legends[0].get_window_extent(r)
        assert _inside_figure(fig, fig.legends[0])
        for ax in visible(fig):
            assert not box.overlaps(ax.get_window_extent(r)), fig.legends[0].get_title().get_text()


def test_grad_share_legend_explains_solid_and_dotted():
    fig = plots.grad_share(two_lrs()["grad_share_by_quadrant"])
    handles = {t.get_text(): h for t, h in zip(fig.legends[0].get_texts(), fig.legends[0].legend_handles)}
    assert handles["dotted: part PPO-clip would drop"].get_linestyle() == ":"
    assert handles["solid: share"].get_linestyle() == "-"


def test_entropy_budget_is_readable():
    fig = plots.entropy_budget(two_lrs()["entropy_budget_by_step"])
    axes = visible(fig)
    assert len(fig.legends) == 1 and all(ax.get_legend() is None for ax in axes)
    assert set(legend_texts(fig)) >= set(QUADS) | {"step total"}
    assert fig.get_figwidth() <= 11  # shown near its size in the report, not shrunk
    assert all(ax.title.get_fontsize() >= 10 for ax in axes)
    assert all(t.get_fontsize() >= 9 for ax in axes for t in ax.get_yticklabels())
    assert "entropy push" in axes[0].get_ylabel() and "dH per unit logit step" not in axes[0].get_ylabel()


def test_many_colours_beyond_ten_series():
    names = [f"s{i:02d}" for i in range(50)]
    colors = plots.series_colors(names)
    assert len(set(list(colors.values())[:20])) == 20 and len(set(colors.values())) >= 50
    assert len(set(plots.series_colors(names[:10]).values())) == 10


def test_50_runs_render_with_a_capped_legend(capsys):
    import time

    import matplotlib.pyplot as plt

    specs = [
        spec(f"run{k:02d}", m, lr=1e-3 * (1 + k % 5), seed=k, erc=(0.9, 1.1) if m == "erc_dapo" else None)
        for k, m in ((k, ("grpo", "dapo", "erc_dapo", "ce_gppo")[k % 4]) for k in range(50))
    ]
    f = frames(specs)
    names = set(plots.series_names(f["entropy_by_step"]))
    assert len(names) == 50
    t0 = time.perf_counter()
    for fig_spec in FIGURES:
        fig = fig_spec.plot(f[fig_spec.analysis])
        texts = legend_texts(fig)
        listed = [t for t in texts if t in names]
        assert len(listed) <= 12, fig_spec.name
        if listed:
            assert "... and 38 more" in texts and len(listed) + 1 <= 13, fig_spec.name
        fig.canvas.draw()
        for lg in fig.legends:
            assert _inside_figure(fig, lg), fig_spec.name
        plt.close(fig)
    with capsys.disabled():
        print(f"\n[info] {len(FIGURES)} figures of 50 runs drawn in {time.perf_counter() - t0:.1f} s")


def test_grad_norm_marks_the_steps_with_a_nan_norm():
    df = pd.DataFrame(
        dict(
            run=["a"] * 4 + ["b"] * 4,
            method="grpo",
            step=list(range(4)) * 2,
            grad_norm=[0.5, 0.6, float("nan"), 0.7, 0.4, 0.4, 0.4, 0.4],
            nonfinite=[0, 1, 1, 0, 0, 0, 0, 0],
        )
    )
    fig = plots.grad_norm_vs_step(df)
    marks = [c for c in fig.axes[0].collections if c.get_gid() == "nonfinite"]
    assert len(marks) == 1 and sorted(marks[0].get_offsets()[:, 0]) == [1, 2]  # run a's steps 1 and 2 only
    text = captions.grad_norm(df)
    assert (
        "Updates with a NaN / inf norm (x in the figure; left out of the step mean): a (grpo) at 2 steps "
        "from step 1." in text
    )
    assert not [
        c for c in plots.grad_norm_vs_step(df.assign(nonfinite=0)).axes[0].collections if c.get_gid() == "nonfinite"
    ]


def test_clip_by_quadrant_says_where_a_quadrant_has_no_tokens():
    # every sampled token below tau (a small model's early steps): no HP tokens in any run
    df = pd.DataFrame(
        dict(
            run="a",
            method="grpo",
            step=float("nan"),
            quadrant=["PA&LP", "NA&LP"],
            tokens=[10, 12],
            clip_low_frac=[0.0, 0.25],
            clip_high_frac=[0.1, 0.0],
            clipped_frac=[0.1, 0.25],
        )
    )
    fig = plots.clip_by_quadrant(df)
    notes = sorted(t.get_text() for ax in fig.axes for t in ax.texts if t.get_gid() == "no tokens")
    assert notes == ["no NA&HP tokens", "no PA&HP tokens"]


# ------------------------------------------------------------------ one registry, a caption that raises fails
def test_every_figure_is_declared_once_with_its_plot_and_observer():
    import inspect

    from entropylens.report import build as report
    from entropylens.report import figures, runset

    assert report.FIGURES is figures.FIGURES and report.Figure is figures.Figure
    assert len({f.name for f in FIGURES}) == len(FIGURES)
    for f in FIGURES:
        assert figures.figure(f.name) is f
        assert getattr(plots, f.plot.__name__) is f.plot, f.name  # the function object, not a name to look up
        assert getattr(captions, f.observe.__name__) is f.observe, f.name
        assert list(inspect.signature(f.observe).parameters) == ["df", "rs"], f.name  # one signature for all
        one = runset.build(pd.DataFrame({"run": ["a"], "method": ["grpo"], "config": [None]}))
        assert f.params is None or isinstance(f.params(one), dict), f.name  # the analysis's parameters
    assert report.STEP_LINK_FIGURES == ("entropy", "clip_by_quadrant", "entropy_budget")
    with pytest.raises(KeyError, match="unknown figure 'nope'"):
        figures.figure("nope")


def test_every_caption_measures_the_fixture_and_many_runs_without_raising(tmp_path):
    """Each observer called directly (no fallback) on the report's own frames of the fixture runs, per run
    and grouped, and on hand-made frames of 50 runs."""
    from fixture_runs import build

    from entropylens.report import build as report
    from entropylens.report import runset

    con = report.open_report(build(tmp_path / "runs"))
    for group_by in (None, "method"):
        rs = runset.from_connection(con, group_by=group_by)
        for f in FIGURES:
            text = f.observe(report._frame(con, f, rs), rs)
            assert isinstance(text, str) and text and "rows of this figure" not in text, f.name
    specs = [
        spec(
            f"run{k:02d}",
            ("grpo", "dapo", "erc_dapo", "ce_gppo")[k % 4],
            seed=k,
            erc=(0.9, 1.1) if k % 4 == 2 else None,
        )
        for k in range(50)
    ]
    many = frames(specs)
    for f in FIGURES:
        assert isinstance(f.observe(many[f.analysis], None), str), f.name


def _raising(name="kl"):
    import dataclasses

    from entropylens.report.figures import figure

    def broken(df, rs):
        return df["no such column"]

    return dataclasses.replace(figure(name), observe=broken)


def test_a_caption_that_raises_fails_the_tests_and_warns_a_user():
    import pickle

    from entropylens.report.figures import CaptionFailure, CaptionWarning

    df = pd.DataFrame(dict(run=["a", "a"], method="grpo", step=[0, 1], kl=[0.1, 0.2]))
    bad = _raising()
    with pytest.raises(CaptionWarning, match=r"figure 'kl': its measured caption \(broken\) raised KeyError"):
        bad.observed(df, None)  # the suite's filterwarnings (pyproject): the warning is an error
    with pytest.warns(CaptionWarning, match="row count in its place"):  # a user's run: warned, and said so
        text = bad.observed(df, None)
    assert text == "Here: 2 rows of this figure's analysis (its measured caption failed: KeyError)."
    assert isinstance(text, CaptionFailure) and "KeyError" in text.why
    back = pickle.loads(pickle.dumps(text))  # from a demo worker to the process that writes the report
    assert isinstance(back, CaptionFailure) and back == text and back.why == text.why


def test_a_caption_that_failed_in_another_process_is_warned_by_the_report(tmp_path):
    from fixture_runs import build

    from entropylens.report.build import write_report
    from entropylens.report.figures import CaptionFailure, CaptionWarning

    runs = build(tmp_path / "runs")
    failed = CaptionFailure(
        "Here: 2 rows of this figure's analysis (its measured caption failed: KeyError).",
        "figure 'kl': its measured caption (kl) raised KeyError: 'kl'",
    )
    done = {f.name: (f"{f.name}.png", "Here, drawn elsewhere.") for f in FIGURES} | {"kl": ("kl.png", failed)}
    with pytest.raises(CaptionWarning, match="figure 'kl'"):  # every figure drawn "elsewhere": none drawn here
        write_report(runs, tmp_path / "rep", elsewhere=tuple(done), done=done, responses=0)
    with pytest.warns(CaptionWarning, match="figure 'kl'"):
        md = write_report(runs, tmp_path / "rep", elsewhere=tuple(done), done=done, responses=0).parent / "report.md"
    assert "(its measured caption failed: KeyError). (analysis: `kl_by_step`)" in md.read_text()


def test_the_registry_imports_no_matplotlib():
    """FIGURES holds the plots functions themselves: importing the report still imports no matplotlib
    (plots.py imports it when a figure is drawn)."""
    import subprocess
    import sys

    code = "import sys, entropylens.report.build; print('matplotlib' in sys.modules)"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and res.stdout.strip() == "False", res.stdout + res.stderr


# ------------------------------------------------------------------ layout at 1, 2, 4 and 8 runs, palettes
def _runs(n: int) -> dict:
    methods = ("grpo", "dapo", "ce_gppo", "erc_dapo")
    return frames([spec(f"{methods[k % 4]}-s{k}", methods[k % 4], seed=k) for k in range(n)])


@pytest.mark.parametrize("n_runs", [1, 2, 4, 8])
def test_every_figure_fits_its_canvas_and_keeps_its_legend_narrow(n_runs):
    """No title, label or legend outside the canvas (matplotlib's tight bbox inside the figure: a one-run
    entropy budget, 5.2 inches wide, cut its title at both edges); a legend right of the panels takes at
    most a fifth of the width (a wider one goes above them)."""
    f = _runs(n_runs)
    drawn = 0
    for fig_def in FIGURES:
        if fig_def.analysis not in f:
            continue
        fig = fig_def.plot(f[fig_def.analysis], band=None, legend_title="run")
        fig.canvas.draw()
        r = fig.canvas.get_renderer()
        box = fig.get_tightbbox(r)
        w, h = fig.get_figwidth(), fig.get_figheight()
        assert box.x0 >= -0.01 and box.y0 >= -0.01 and box.x1 <= w + 0.01 and box.y1 <= h + 0.01, (
            fig_def.name,
            n_runs,
            box,
            (w, h),
        )
        right = max(ax.get_window_extent(r).x1 for ax in visible(fig))
        for lg in fig.legends:
            lb = lg.get_window_extent(r)
            if lb.x0 >= right - 1:  # a legend right of the panels
                assert lb.width / fig.dpi <= w / 5 + 0.01, (fig_def.name, n_runs, lb.width / fig.dpi, w)
        drawn += 1
        import matplotlib.pyplot as plt

        plt.close(fig)
    assert drawn >= 12


def test_quadrant_colours_are_fixed_and_never_a_runs():
    """One palette for quadrants in every figure (and the viewer, test_viewer_browser), none of its colours
    a run's: the quadrant panels' titles sit on their quadrant's colour, in black."""
    from entropylens.report.palette import QUADRANT_COLORS, RUN_COLORS

    assert not set(QUADRANT_COLORS.values()) & set(RUN_COLORS)
    assert plots.series_colors([f"r{i}" for i in range(10)]) == dict(zip([f"r{i}" for i in range(10)], RUN_COLORS))
    f = _runs(4)
    fig = plots.quadrant_share(f["quadrant_share_by_step"])
    for ax, q in zip(visible(fig), QUADS):
        assert ax.get_title() == q and to_hex(ax.title.get_color()) == "#000000"
        assert to_hex(ax.title.get_bbox_patch().get_facecolor()[:3]) == QUADRANT_COLORS[q]
    fig = plots.entropy_budget(f["entropy_budget_by_step"])
    handles = {t.get_text(): hd for t, hd in zip(fig.legends[0].get_texts(), fig.legends[0].legend_handles)}
    assert all(to_hex(handles[q].get_facecolor()[:3]) == QUADRANT_COLORS[q] for q in QUADS)


def test_mismatch_figure_with_and_without_sampler_logprobs(tmp_path):
    """The mismatch figure of a run with sampler log-probs draws |delta log p| by quadrant and the shares;
    one without says so in its row (no line at 0), and so does the caption."""
    import mismatch_runs

    from entropylens.read.query import connect, run_analysis

    df = run_analysis(connect(mismatch_runs.build(tmp_path / "runs")), "mismatch_by_quadrant_by_step")
    fig = plots.mismatch(df)
    left, right, none_l, none_r = fig.axes
    lines = {ln.get_label(): ln for ln in left.get_lines()}
    # delta t0..t3 = 0, .2, -.05, .3 at every step: |delta| per quadrant and the all-token mean 0.1375
    assert lines["PA&LP"].get_ydata() == pytest.approx([0.2, 0.2], abs=1e-6)
    assert lines["NA&HP"].get_ydata() == pytest.approx([0.3, 0.3], abs=1e-6)
    assert lines["all tokens"].get_ydata() == pytest.approx([0.1375, 0.1375], abs=1e-6)
    shares = {ln.get_label(): list(ln.get_ydata()) for ln in right.get_lines()}
    # mismatched (default: |delta| > ln 2 or masked): t3 alone (masked). Clipped t1, t2: none of them; the
    # others t0, t3: half; t3's |effect| 0.3 of 0.1 + 0.3
    assert shares["of the clipped tokens"] == pytest.approx([0.0, 0.0])
    assert shares["of the other tokens"] == pytest.approx([0.5, 0.5])
    assert shares["of sum |entropy effect|"] == pytest.approx([0.75, 0.75])
    assert not none_l.get_lines() and not none_r.get_lines() and not none_l.axison
    assert "no sampler log-probs recorded" in " ".join(t.get_text() for t in none_l.texts)
    fig.savefig(tmp_path / "both.png")
    text = captions.mismatch(df, None)
    assert "m (grpo) mean |delta log p| 0.138 nats" in text and "25.0% of tokens mismatched" in text
    assert "0.0% of the clipped tokens vs 50.0% of the others" in text
    assert "75.0% of sum |entropy effect|" in text
    assert "No sampler log-probs recorded in n (grpo)" in text
    only = captions.mismatch(df[df["run"] == "n"], None)
    assert only.startswith("No sampler log-probs recorded in n (grpo)") and "Here" not in only
    fig = plots.mismatch(df[df["run"] == "n"])
    assert not any(ax.get_lines() for ax in fig.axes)


def test_present_query_is_empty_exactly_where_has_data_is_false(tmp_path):
    """A figure's ``present`` query (run before its analysis, which it skips when empty) finds a row exactly
    where has_data finds the analysis's data: runs with and without sampler log-probs, each alone and together."""
    import mismatch_runs

    from entropylens.read.query import connect, run_analysis, run_sql
    from entropylens.report.figures import FIGURES

    root = mismatch_runs.build(tmp_path / "runs")
    with_present = [f for f in FIGURES if f.present is not None]
    assert [f.name for f in with_present] == ["mismatch"]
    for runs in (None, ["m"], ["n"]):
        con = connect(root, runs=runs)
        for f in with_present:
            df = run_analysis(con, f.analysis)
            assert f.has_data is not None and run_sql(con, f.present).empty == (df.empty or not f.has_data(df)), runs
    assert run_sql(connect(root, runs=["n"]), with_present[0].present).empty
