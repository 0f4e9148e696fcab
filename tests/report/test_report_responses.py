"""The report's token-viewer pages: one per run, linked from the index and from the step figures (entropy,
clip fractions, entropy budget) at the steps each page holds; chosen by --responses / --where."""

import json
import re

from cli_calls import err, ok
from fixture_runs import build

from entropylens.report.build import DEFAULT_PAGE_BYTES, STEP_LINK_FIGURES, response_pages, write_report


def _data(page):
    m = re.search(r'<script type="application/json" id="el-data">(.*?)</script>', page.read_text(), re.S)
    return json.loads(m.group(1))


def test_each_run_gets_a_page_linked_from_the_index_and_the_step_figures(tmp_path):
    index = write_report(build(tmp_path / "runs"), tmp_path / "rep")
    html = index.read_text()
    for run in ("a", "b"):
        page = index.parent / f"responses-{run}.html"
        assert page.is_file() and f'href="responses-{run}.html"' in html
        data = _data(page)
        assert data["run"] == run and data["steps"]
    # run a: steps 0 and 1, both embedded (4 responses < 40): each step figure links to both
    steps_a = [d["step"] for d in _data(index.parent / "responses-a.html")["steps"]]
    assert steps_a == [0, 1]
    for name in STEP_LINK_FIGURES:
        fig = re.search(rf'<figure id="{name}">(.*?)</figure>', html, re.S).group(1)
        assert re.findall(r'href="responses-a\.html#step=(\d+)"', fig) == ["0", "1"], name
    md = (index.parent / "report.md").read_text()
    assert "[0](responses-a.html#step=0)" in md and "## Responses, token by token" in md
    assert "http://" not in (index.parent / "responses-a.html").read_text()


def test_responses_and_where_choose_what_the_pages_hold(tmp_path):
    runs = build(tmp_path / "runs")
    out = tmp_path / "rep"
    out.mkdir()
    (page,) = response_pages(runs, out, ["a"], n=1, where=None, tokenizer=None, max_bytes=DEFAULT_PAGE_BYTES)
    assert page.responses == 1 and sum(len(s["responses"]) for s in _data(out / page.file)["steps"]) == 1
    # fixture run a: the clipped tokens are t1 (seq 0 / 2, PA&LP) and t2 (seq 1 / 3, NA&LP)
    where = "quadrant = 'PA&LP' AND clipped"
    (page,) = response_pages(runs, out, ["a"], n=40, where=where, tokenizer=None, max_bytes=DEFAULT_PAGE_BYTES)
    data = _data(out / page.file)
    assert sorted((s["step"], r["seq"]) for s in data["steps"] for r in s["responses"]) == [(0, 0), (1, 2)]
    assert where in data["selection"] and page.steps == (0, 1)


def test_report_cli_options(tmp_path):
    runs = build(tmp_path / "runs")
    ok("report", runs, "--out", tmp_path / "none", "--responses", "0")
    assert not list((tmp_path / "none").glob("responses-*.html"))
    assert "responses-" not in (tmp_path / "none" / "index.html").read_text()
    # a bad condition fails at once (before the figures), one line naming it
    line = err("report", runs, "--out", tmp_path / "bad", "--where", "nosuch = 1")
    assert "--where" in line and "nosuch" in line and not (tmp_path / "bad" / "index.html").exists()
    assert "unbalanced" in err("report", runs, "--out", tmp_path / "bad", "--where", "(clipped")


def test_a_report_over_another_keeps_only_its_own_pages(tmp_path):
    """Found by a new-user trial: a second report into the same folder left the first one's responses pages
    beside it. Now the pages of runs no longer reported are removed; a file that is not an entropylens
    responses page is never touched."""
    runs = build(tmp_path / "runs")
    out = tmp_path / "rep"
    write_report(runs, out)
    assert (out / "responses-a.html").is_file() and (out / "responses-b.html").is_file()
    mine = out / "responses-notes.html"
    mine.write_text("<html><title>my notes</title></html>")
    write_report(runs, out, runs=["a"])
    assert (out / "responses-a.html").is_file() and not (out / "responses-b.html").exists()
    assert mine.read_text() == "<html><title>my notes</title></html>"
    assert "responses-b.html" not in (out / "index.html").read_text()
    write_report(runs, out, responses=0)  # no pages at all: none left behind
    assert sorted(p.name for p in out.glob("responses-*.html")) == ["responses-notes.html"]
