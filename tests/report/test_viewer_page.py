"""The token viewer's page file (entropylens/report/viewer.py), without a browser: one self-contained, offline
HTML file whose embedded data reads back equal to what was given, that no text can break out of, under
a file name that is safe and distinct per run (tests/report/test_viewer_browser.py drives it in Chromium)."""

from __future__ import annotations

import json
import re
from html.parser import HTMLParser
from importlib import resources

import pytest
from fixture_runs import build
from viewer_data import HOSTILE, small_data  # noqa: E402,F401

from entropylens.read.query import connect
from entropylens.report import responses
from entropylens.report.palette import QUADRANT_COLORS, RUN_COLORS
from entropylens.report.viewer import page_name, render_page, write_page


class Scripts(HTMLParser):
    """The page's elements as an HTML parser reads them: scripts (attributes, text), links, styles."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.scripts: list[tuple[dict, str]] = []
        self.tags: list[tuple[str, dict]] = []
        self._in: dict | None = None

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))
        if tag == "script":
            self._in = dict(attrs)
            self.scripts.append((self._in, ""))

    def handle_data(self, data):
        if self._in is not None:
            attrs, text = self.scripts[-1]
            self.scripts[-1] = (attrs, text + data)

    def handle_endtag(self, tag):
        if tag == "script":
            self._in = None


def embedded(html: str) -> tuple[dict, Scripts]:
    p = Scripts()
    p.feed(html)
    data = [t for a, t in p.scripts if a.get("id") == "el-data"]
    assert len(data) == 1 and [a.get("type") for a, _ in p.scripts] == ["application/json", None]
    got = json.loads(data[0])
    palette = got.pop("palette")  # added by the page: the report's palettes (palette.py)
    assert palette == {"quadrant": QUADRANT_COLORS, "update": list(RUN_COLORS)}
    return got, p


def test_one_offline_file_with_its_data(tmp_path):
    data = small_data()
    out = write_page(tmp_path / "sub" / "page.html", data, title="T <1>", back_href="../index.html")
    assert out == tmp_path / "sub" / "page.html"
    assert [p.name for p in (tmp_path / "sub").iterdir()] == ["page.html"]  # one file, nothing beside it
    html = out.read_text(encoding="utf-8")
    assert "http://" not in html and "https://" not in html and "//" + "cdn" not in html
    got, parsed = embedded(html)
    assert got == json.loads(json.dumps(data)) == data
    # nothing loaded from elsewhere: no src=, no <link>, no url() in the style, no import
    assert not [t for t, a in parsed.tags if "src" in a or t in ("link", "iframe", "img", "object", "embed")]
    js = resources.files("entropylens.report").joinpath("viewer.js").read_text(encoding="utf-8")
    css = resources.files("entropylens.report").joinpath("viewer.css").read_text(encoding="utf-8")
    assert js in html and css in html  # inlined, read from the package
    for asset in (js, css):
        assert "http" not in asset and "url(" not in asset and "@import" not in asset and "fetch(" not in asset
    assert "<title>T &lt;1&gt;</title>" in html and 'href="../index.html"' in html
    assert 'id="el-app"' in html and 'id="el-back"' in html


def test_hostile_texts_cannot_break_out(tmp_path):
    for s in HOSTILE:
        data = small_data(s)
        data["run"] = s
        data["selection"] = s
        html = render_page(data, title=s, back_href='x"><script>window.PWNED=1</script>')
        got, parsed = embedded(html)
        assert got == data, s
        # the data element ends at its own end tag: only two script end tags in the page, no "<!--" at all
        assert len(re.findall(r"</script", html, flags=re.I)) == 2, s
        assert "<!--" not in html, s
        start = html.index('id="el-data">')
        assert "<" not in html[start + len('id="el-data">') : html.index("</script>", start)], s
        assert 'href="x&quot;&gt;&lt;script&gt;' in html  # the back link escaped


def test_a_real_runs_page_data_reads_back(tmp_path):
    from entropylens.read.run_decoder import decoder_for_run

    root = build(tmp_path / "runs")
    con = connect(root)
    sel = responses.select(con, "a")
    data = responses.page_data(con, "a", sel, decoder_for_run(root, "a"), method="grpo")
    path = write_page(tmp_path / "rep" / page_name("a"), data)
    got, _ = embedded(path.read_text(encoding="utf-8"))
    assert got == json.loads(json.dumps(data))
    assert got["steps"] and all(r["rows"] for s in got["steps"] for r in s["responses"])
    assert path.stat().st_size < 200_000


NAMES = [
    "grpo-s0",
    "a",
    "A",
    "a/b",
    "a\\b",
    "a b",
    "a_b",
    "a-b",
    "a--b",
    "a---b",
    "a-b-",
    "-a",
    "../etc/passwd",
    "..",
    ".",
    "",
    " ",
    "ü",
    "u",
    "Ü",
    "run.1",
    "run.1.",
    "x" * 60,
    "x" * 61,
    "x" * 300,
    "con",
    "CON",
    "nul:",
    "a:b",
    "a*b",
    "a?b",
    'a"b',
    "a<b>",
    "a|b",
    "\x00",
    "\n",
    "日本語",
    "run 1",
    "run%201",
    "responses-a",
    "a--0123456789",
]


def test_page_names_are_safe_stable_and_distinct():
    names = [page_name(n) for n in NAMES]
    for n, f in zip(NAMES, names):
        assert re.fullmatch(r"responses-[a-z0-9][a-z0-9._-]*\.html", f), (n, f)
        assert len(f) <= 100 and ".." not in f.removesuffix(".html") and page_name(n) == f
    assert len(set(names)) == len(NAMES)
    assert len({f.lower() for f in names}) == len(NAMES)  # also on a case-insensitive file system
    assert page_name("grpo-s0") == "responses-grpo-s0.html"  # a plain name stays readable
    assert page_name("erc_dapo.v2") == "responses-erc_dapo.v2.html"
    assert page_name("My Run").startswith("responses-my-run--")


def test_assets_are_package_data():
    text = (resources.files("entropylens.report") / "viewer.js").read_text(encoding="utf-8")
    assert "el-data" in text and "</script" not in text.lower() and "<!--" not in text
    assert "</style" not in (resources.files("entropylens.report") / "viewer.css").read_text(encoding="utf-8").lower()
    from pathlib import Path

    pyproject = (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text()
    assert re.search(r'"entropylens.report" = \[[^\]]*"viewer\.js"[^\]]*"viewer\.css"', pyproject)


@pytest.mark.parametrize("run", ["a", "Weird / run"])
def test_write_page_title_default(tmp_path, run):
    data = small_data()
    data["run"] = run
    html = write_page(tmp_path / page_name(run), data).read_text(encoding="utf-8")
    assert f"<title>entropylens responses: {run}</title>" in html
    assert 'href="index.html"' in html
