"""#13.6: the figures users see first are readable, and their captions say what THIS run shows.

Unit tests on the matplotlib Figure objects (axes, scales, legends, markers) and on the measured
captions (hand-made frames whose answer is known); tests/test_report_browser.py checks the page.
"""

import matplotlib

matplotlib.use("Agg")

import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from entropylens import captions, plots  # noqa: E402
from entropylens.report import FIGURES  # noqa: E402

METHODS = ("ce_gppo", "dapo", "erc_dapo", "grpo")


def ratio_frame(steps=10):
    rows = []
    for i, m in enumerate(METHODS):
        for s in range(steps):
            rows.append(dict(run=f"{m}-s0", method=m, step=s, p05=0.8 - 0.01 * i, p50=1.0 - 0.002 * i,
                             p95=1.2 + 0.01 * i, outside_band=0.5 - 0.1 * (m == "erc_dapo"), tokens=100))
    return pd.DataFrame(rows)


def visible(fig):
    return [ax for ax in fig.axes if ax.get_visible()]


def test_entropy_ratio_one_linear_panel_per_method_with_its_median():
    df = ratio_frame()
    fig = plots.entropy_ratio_band(df)
    axes = visible(fig)
    assert len(axes) == 4  # four bands no longer merge into one grey blob
    for ax, m in zip(axes, METHODS):
        assert ax.get_yscale() == "linear" and m in ax.get_title()
        want = df[df["method"] == m]["p50"].to_numpy()
        medians = [ln for ln in ax.get_lines()
                   if len(ln.get_ydata()) == len(want) and np.allclose(ln.get_ydata(), want)]
        assert medians and medians[0].get_linewidth() >= 1.5  # the median is drawn, on top, thick
        lo, hi = ax.get_ylim()
        assert lo < 0.95 and hi > 1.05 and hi - lo < 1.0  # the ERC band is visible, not a sliver
    assert axes[0].get_shared_y_axes().joined(axes[0], axes[3])


def test_ratio_vs_prob_linear_shared_axis_one_legend():
    rng = np.random.default_rng(0)
    n = 200
    df = pd.DataFrame(dict(run=np.repeat(["a", "b"], n), method="grpo", step=0, prob=rng.uniform(0, 1, 2 * n),
                           ratio=np.r_[rng.normal(1, 0.1, 2 * n - 2), 1e-5, 50.0],
                           quadrant=rng.choice(["PA&HP", "PA&LP", "NA&HP", "NA&LP"], 2 * n), clipped=False,
                           eps_low=0.2, eps_high=0.28))
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
    assert f.plot == "clipped_prob"
    df = pd.DataFrame(dict(run="a", method="grpo", side=["low", "low", "high"], bin=[0, 9, 0], prob_lo=[0, 0.9, 0],
                           prob_hi=[0.1, 1.0, 0.1], tokens=[8, 2, 5], share=[0.8, 0.2, 1.0], lp_share=[0.8, 0.8, 1.0]))
    fig = plots.clipped_prob(df)
    heights = sorted(round(p.get_height()) for ax in fig.axes for p in ax.patches)
    assert heights == [20, 80, 100]  # % of each side's clipped tokens


def test_captions_measure_the_run_and_flag_disagreement():
    drift = pd.DataFrame(dict(run="a", method="grpo", bin=[0, 3, 9], prob_lo=[0.0, 0.3, 0.9], prob_hi=[0.1, 0.4, 1.0],
                              tokens=[10, 10, 10], mean_abs_log_ratio=[0.1, 0.3, 0.2]))
    text = captions.drift_by_prob(drift)
    assert "largest drift: p in [0.3, 0.4)" in text and "differs from the paper" in text
    drift["mean_abs_log_ratio"] = [0.5, 0.3, 0.2]
    text = captions.drift_by_prob(drift)
    assert "[0, 0.1)" in text and "differs" not in text
    text = captions.entropy_ratio(ratio_frame())  # erc_dapo: 40% outside vs 50%: fewer, as the paper says
    assert "erc_dapo 40.0%" in text and "as the paper reports" in text
    clipped = pd.DataFrame(dict(run="a", method="grpo", side=["low", "high"], bin=0, prob_lo=0.0, prob_hi=0.1,
                                tokens=[30, 10], share=1.0, lp_share=[0.9, 0.2]))
    assert captions.clipped_prob(clipped).startswith("Here, 90.0% of 30 low-side clipped tokens have p < tau")


def test_report_captions_carry_measured_text(tmp_path):
    from entropylens.report import write_report
    from fixture_runs import build

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
    """New-user trial: a single-run report cropped the legend (six entries in one row, one panel wide)."""
    rng = np.random.default_rng(1)
    for n_runs in (1, 2, 4):
        n = 50
        df = pd.DataFrame(dict(run=np.repeat([f"r{i}" for i in range(n_runs)], n), method="grpo", step=0,
                               prob=rng.uniform(0, 1, n_runs * n), ratio=rng.normal(1, 0.1, n_runs * n),
                               quadrant=rng.choice(["PA&HP", "PA&LP", "NA&HP", "NA&LP"], n_runs * n),
                               clipped=False, eps_low=0.2, eps_high=0.28))
        fig = plots.ratio_vs_prob(df)
        (legend,) = fig.legends
        assert _inside_figure(fig, legend), n_runs
        top = max(ax.get_tightbbox(fig.canvas.get_renderer()).y1 for ax in visible(fig))
        assert top <= legend.get_window_extent(fig.canvas.get_renderer()).y0 + 1  # no panel under the legend
