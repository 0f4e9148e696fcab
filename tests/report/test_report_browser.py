"""The report opens from disk in a real headless Chromium: a non-blank screenshot, every image present."""

import os
import re
import shutil
import subprocess

import pytest
from fixture_runs import build

from entropylens.report.build import FIGURES, write_report

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


def test_report_files_and_links(tmp_path):
    index = write_report(build(tmp_path / "runs"), tmp_path / "rep")
    html = index.read_text()
    srcs = re.findall(r'<img src="([^"]+)"', html)
    shown = [f for f in FIGURES if not f.optional]  # the fixture records no probes
    assert len(srcs) == len(shown)
    for s in srcs:
        assert (index.parent / s).is_file() and (index.parent / s).stat().st_size > 1000
    assert "http://" not in html and "https://" not in html  # opens offline
    md = (index.parent / "report.md").read_text()
    for f in shown:
        assert f"({f.name}.png)" in md and f.caption in md
    assert not (index.parent / "probe.png").exists()
    assert "Not shown: Parameter-space probe" in md and "Not shown: Parameter-space probe" in html
    assert "| a | grpo |" in md and "| b | ce_gppo |" in md


@pytest.mark.skipif(CHROMIUM is None and not os.environ.get("CI"), reason="chromium not installed (CI installs it)")
def test_report_renders_in_headless_chromium(tmp_path):
    assert CHROMIUM, "chromium must be installed in CI (.ci/run installs Debian's chromium)"
    from PIL import Image, ImageStat

    index = write_report(build(tmp_path / "runs"), tmp_path / "rep")
    shot = tmp_path / "shot.png"
    subprocess.run(
        [
            CHROMIUM,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            f"--user-data-dir={tmp_path / 'profile'}",
            "--window-size=1200,2400",
            "--hide-scrollbars",
            f"--screenshot={shot}",
            index.as_uri(),
        ],
        check=True,
        capture_output=True,
        timeout=120,
    )
    img = Image.open(shot).convert("L")
    assert img.size == (1200, 2400)
    stat = ImageStat.Stat(img)
    assert stat.stddev[0] > 20  # text, tables and figures, not a blank page
    # the figures rendered: plenty of non-white pixels below the summary table
    lower = img.crop((0, 800, 1200, 2400))
    dark = sum(lower.histogram()[:200])
    assert dark > 20_000


@pytest.mark.skipif(CHROMIUM is None and not os.environ.get("CI"), reason="chromium not installed (CI installs it)")
def test_every_figure_decodes_in_chromium_with_content(tmp_path):
    """Each figure of the page loads in the real browser at a readable size, and is not blank."""
    assert CHROMIUM, "chromium must be installed in CI (.ci/run installs Debian's chromium)"
    from PIL import Image, ImageStat

    index = write_report(build(tmp_path / "runs"), tmp_path / "rep")
    srcs = re.findall(r'<img src="([^"]+)"', index.read_text())
    probe = index.parent / "probe.html"  # the page's images, their decoded sizes written by the browser
    imgs = "".join(f'<img src="{s}">' for s in srcs)
    probe.write_text(
        f"<!doctype html><html><body>{imgs}<pre id=out></pre><script>function check() {{"
        "const ims = [...document.images]; if (!ims.every(i => i.complete)) { setTimeout(check, 50); return; }"
        "document.getElementById('out').textContent = ims.map("
        "i => i.getAttribute('src') + ' ' + i.naturalWidth + 'x' + i.naturalHeight).join(';');} check();"
        "</script></body></html>"
    )
    dom = subprocess.run(
        [
            CHROMIUM,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            f"--user-data-dir={tmp_path / 'profile'}",
            "--virtual-time-budget=5000",
            "--dump-dom",
            probe.as_uri(),
        ],
        check=True,
        capture_output=True,
        text=True,
        timeout=120,
    ).stdout
    sizes = dict(x.split(" ") for x in re.search(r'<pre id="out">([^<]*)</pre>', dom).group(1).split(";"))
    assert set(sizes) == set(srcs)
    for src, wh in sizes.items():
        w, h = map(int, wh.split("x"))
        assert w >= 600 and h >= 300, (src, wh)  # decoded by Chromium, large enough to read
        img = Image.open(index.parent / src).convert("L")
        assert ImageStat.Stat(img).stddev[0] > 15, src  # not a blank canvas
        inked = sum(img.histogram()[:200]) / (img.size[0] * img.size[1])
        assert inked > 0.01, (src, inked)  # axes, lines and text, not an empty frame (1-2 step runs: few lines)
