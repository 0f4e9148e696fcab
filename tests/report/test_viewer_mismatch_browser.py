"""The token viewer's mismatch colour and hover value in headless Chromium: tests/mismatch_runs.py's run m
(delta = old_logprob - sampler_logprob = 0, +0.2, -0.05, +0.3 on t0..t3) and run n (no sampler log-probs)."""

import shutil

import numpy as np
import pytest

from entropylens.read.query import connect
from entropylens.report import responses
from entropylens.report.viewer import page_name, write_page

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="chromium not installed (CI installs it)")


def _page(root, out, run):
    from entropylens.read.run_decoder import decoder_for_run

    con = connect(root)
    data = responses.page_data(con, run, responses.select(con, run, n=4), decoder_for_run(root, run), method="grpo")
    con.close()
    return write_page(out / page_name(run), data)


def _open(browser, path, hash_):
    pg = browser.new_page(viewport={"width": 1300, "height": 900})
    errors = []
    pg.on("pageerror", lambda e: errors.append(str(e)))
    pg.goto(path.as_uri() + hash_)
    pg.wait_for_selector('body[data-ready="1"]')
    return pg, errors


def _colours(pg):
    return pg.eval_on_selector_all("#el-text span.tk", "ss => ss.map(s => getComputedStyle(s).backgroundColor)")


def _detail(pg, col):
    return pg.text_content(f'#el-details tr[data-col="{col}"] td.v')


def test_mismatch_colour_and_hover(browser, tmp_path):
    import mismatch_runs

    root = mismatch_runs.build(tmp_path / "runs")
    # seq 0 at step 0 holds t0 (pos 0, delta 0) and t1 (pos 1, delta +0.2, clipped); seq 1 t2 (-0.05), t3 (+0.3)
    path = _page(root, tmp_path / "report", "m")
    pg, errors = _open(browser, path, "#step=0&seq=1&update=1")
    opts = pg.eval_on_selector_all("#el-metric option", "os => os.map(o => o.value)")
    assert "sampler_log_ratio" in opts
    pg.select_option("#el-metric", "entropy")
    before = _colours(pg)
    pg.select_option("#el-metric", "sampler_log_ratio")
    after = _colours(pg)
    assert after != before and len(set(after)) == 2  # t2 (-0.05) and t3 (+0.3): two sides of the diverging scale
    # the legend names the response's lowest and highest delta (float32 of old - sampler): -0.05 and 0.3
    lo, hi = (float(pg.text_content(f'#el-legend [data-role="{r}"]')) for r in ("min", "max"))
    assert lo == pytest.approx(-0.05, abs=1e-6) and hi == pytest.approx(0.3, abs=1e-6)
    # hover: the token's mismatch, its sampler log-prob and whether the IS correction masked it
    pg.hover('#el-text span.tk[data-pos="1"]')  # t3
    assert float(_detail(pg, "sampler_log_ratio")) == pytest.approx(0.3, abs=1e-6)
    old = float(np.float32(np.log(np.float32(0.85))))
    assert float(_detail(pg, "sampler_logprob")) == pytest.approx(old - 0.3, abs=1e-6)
    assert _detail(pg, "is_masked") == "true"
    pg.hover('#el-text span.tk[data-pos="0"]')  # t2
    assert float(_detail(pg, "sampler_log_ratio")) == pytest.approx(-0.05, abs=1e-6)
    assert _detail(pg, "is_masked") == "false"
    pg.screenshot(path=str(tmp_path / "mm.png"), full_page=True)
    pg.screenshot(path="/tmp/viewer_mismatch.png", full_page=True)
    assert errors == []
    pg.close()

    # run n: no sampler log-probs: null on hover, the null colour for every token
    path = _page(root, tmp_path / "report", "n")
    pg, errors = _open(browser, path, "#step=0&seq=1&update=1&metric=sampler_log_ratio")
    assert pg.eval_on_selector("#el-metric", "s => s.value") == "sampler_log_ratio"
    assert set(_colours(pg)) == {"rgb(220, 220, 220)"}  # viewer.js NULL_COLOR #dcdcdc
    pg.hover('#el-text span.tk[data-pos="1"]')
    assert _detail(pg, "sampler_log_ratio") == "null" and _detail(pg, "is_masked") == "null"
    assert errors == []
    pg.close()
