"""The report's Cui et al. section (entropylens/report/covlaw.py) on recorded runs whose laws are known by
construction (tests/covlaw_runs.py): a run of 20 steps that follows both laws, and one of 3 steps, too few
for a fit. The runs and the report are built once per module."""

import re

import covlaw_runs
import pytest

from entropylens.read.query import connect, run_analysis
from entropylens.report import captions, covlaw, plots
from entropylens.report.build import write_report
from entropylens.report.figures import CUI, FIGURES, SECTIONS

CUI_FIGURES = [f for f in FIGURES if f.section == CUI]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("covlaw") / "runs"
    covlaw_runs.record_run(root, "law-20", 20)
    covlaw_runs.record_run(root, "short-3", 3, seed=1)
    return root


@pytest.fixture(scope="module")
def report(runs, tmp_path_factory):
    return write_report(runs, tmp_path_factory.mktemp("rep") / "rep", responses=0)


def _caption(md: str, analysis: str) -> str:
    return next(x for x in md.splitlines() if f"(analysis: `{analysis}`)" in x)


def test_the_section_holds_three_figures_after_its_heading(report):
    assert [f.analysis for f in CUI_FIGURES] == [
        "covariance_by_quadrant",
        "covariance_law_by_step",
        "entropy_performance_fit",
    ]
    md = (report.parent / "report.md").read_text()
    head = md.index(f"## {SECTIONS[CUI][0]}")
    for f in CUI_FIGURES:
        assert md.index(f"### {f.title}") > head and (report.parent / f"{f.name}.png").stat().st_size > 1000
    html = report.read_text()
    assert "<tr><th>run</th><th>method</th>" in html  # the run table's header is still the table's
    assert html.index('id="section-cui"') < html.index('id="covariance_by_quadrant"')
    assert "<h3>Entropy change predicted by the covariance law against the measured change</h3>" in html


def test_captions_say_what_the_run_shows_and_that_three_steps_fit_nothing(report):
    md = (report.parent / "report.md").read_text()
    law = _caption(md, "covariance_law_by_step")
    r = float(re.search(r"law-20 \(grpo\) r = ([-0-9.]+) over 19 steps", law).group(1))
    assert r > 0.8 and "As the law predicts" in law
    assert (
        "short-3 (grpo) has 2 steps with a next step: the fit (its scale and r) is not meaningful below 5 steps" in law
    )
    assert "short-3 (grpo) r =" not in law  # no correlation claimed for it
    fit = _caption(md, "entropy_performance_fit")
    assert "law-20 (grpo) a = 0.05, b = 0.9," in fit and "at H = 0: b - a = 0.85" in fit
    assert (
        "short-3 (grpo) has 3 steps with a reward and an entropy: a fit of a and b is not meaningful below 5 steps, "
        "so no curve is drawn." in fit
    )
    cov = _caption(md, "covariance_by_quadrant")
    assert "law-20 (grpo) (PA&HP +" in cov and "the law's sign in 4 of 4" in cov


def test_a_curve_only_for_a_run_with_enough_steps(runs):
    import matplotlib.pyplot as plt

    df = run_analysis(connect(runs), "entropy_performance_fit")
    fig = plots.entropy_performance(df)
    curves = [ln for ln in fig.axes[0].lines if ln.get_gid() == "fit"]
    assert len(curves) == 1  # law-20's; short-3 is drawn as points only
    h, r = curves[0].get_data()
    assert r == pytest.approx(covlaw_runs.B_FIT - covlaw_runs.A_FIT * __import__("numpy").exp(h), rel=1e-5)
    labels = [t.get_text() for lg in fig.legends for t in lg.get_texts()]
    assert "short-3 (grpo): 3 steps: fit not meaningful below 5, no curve" in labels
    plt.close(fig)


def test_one_run_of_few_steps_gets_the_honest_caption(tmp_path):
    from fixture_runs import build

    index = write_report(build(tmp_path / "runs"), tmp_path / "rep", runs=["a"], responses=0)
    md = (index.parent / "report.md").read_text()
    assert "One run." in md
    law = _caption(md, "covariance_law_by_step")
    assert "a (grpo) has 1 step with a next step: the fit (its scale and r) is not meaningful below 5 steps" in law
    assert " r = " not in law
    fit = _caption(md, "entropy_performance_fit")
    assert "a (grpo) has 2 steps with a reward and an entropy: a fit of a and b is not meaningful below 5" in fit


def test_library_tables_for_the_claims_report(runs):
    t = covlaw.tables(connect(runs))
    law = t["law"].set_index("run")
    assert law.loc["law-20", "meaningful"] and not law.loc["short-3", "meaningful"]
    assert law.loc["law-20", "corr"] > 0.8 and law.loc["law-20", "steps"] == 19
    fit = t["fit"].set_index("run")
    assert fit.loc["law-20", "a"] == pytest.approx(covlaw_runs.A_FIT, rel=1e-5)
    assert fit.loc["law-20", "b"] == pytest.approx(covlaw_runs.B_FIT, rel=1e-5)
    q = t["quadrants"]
    assert set(q["quadrant"]) == set(covlaw.QUADRANTS) and q[q["run"] == "law-20"]["agrees"].all()
    # the captions read the same tables: the figure's caption and the library agree
    text = captions.entropy_performance(t["entropy_performance_fit"], None)
    assert f"a = {fit.loc['law-20', 'a']:.3g}" in text


def test_the_section_renders_in_chromium(report, browser):
    pg = browser.new_page(viewport={"width": 1200, "height": 900})
    pg.goto(report.as_uri())
    pg.wait_for_load_state("load")
    assert pg.locator("#section-cui").is_visible()
    for f in CUI_FIGURES:
        img = pg.locator(f"#{f.name} img")
        img.scroll_into_view_if_needed()
        w = pg.evaluate(f"document.querySelector('#{f.name} img').naturalWidth")
        assert w > 300, f.name
    pg.locator("#section-cui").screenshot(path=str(report.parent / "section.png"))
    pg.locator("#entropy_performance").screenshot(path=str(report.parent / "entropy_performance_in_page.png"))
    pg.close()
