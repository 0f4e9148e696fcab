"""The token viewer: one self-contained HTML page per run, its responses read token by token.

:func:`write_page` writes the page of one run from :func:`entropylens.report.responses.page_data`'s dict: the
data embedded as JSON in ``<script type="application/json" id="el-data">``, the page's script
(``viewer.js``) and style (``viewer.css``, both package data) inlined. Nothing is fetched: the page
works offline, opened from disk.

The page format (the dict, see entropylens/report/responses.py): ``run``, ``method``, ``columns`` (the names of
each token row's values, "pos" first), ``metrics`` (key, label, scale: sequential / diverging / log /
categorical, center, categories), ``has_text`` / ``text_source`` / ``text_hint``, ``selection`` (how the
responses were chosen, one sentence), ``forking_share``, ``palette`` (added here, from palette.py) and ``steps``: per step its ``updates`` and
``responses``, each with its ``summary``, ``pos`` (the recorded positions), ``tokens`` (a display string
per position), ``forking`` (positions) and ``rows`` ({update: [[value per column] per position]}).

The page's elements (stable ids, used by tests/report/test_viewer_browser.py): ``#el-step``, ``#el-update``,
``#el-metric`` (the choosers), ``#el-list`` (the step's responses: rows ``tr[data-seq][data-rank]``,
sortable by a click on a ``th[data-key]``), ``#el-text`` (the shown response: ``span.tk[data-pos]``,
class ``forking`` where marked), ``#el-legend``, ``#el-details`` (the hovered or clicked token: rows
``tr[data-col]`` whose ``td.v`` holds the value as embedded), ``#el-chart`` (metric vs position, SVG),
``#el-updates`` (ratio and entropy ratio across the step's updates: SVG and a table, rows
``tr[data-update]``). ``location.hash`` ``#step=S&seq=Q`` (optional ``rank``, ``update``, ``metric``) opens a
response, and follows navigation.
"""

from __future__ import annotations

import hashlib
import re
from importlib import resources
from pathlib import Path

from .escape import html_text
from .palette import QUADRANT_COLORS, RUN_COLORS
from .responses import dumps

_SLUG_OK = re.compile(r"[a-z0-9][a-z0-9._-]*\Z")
_MAX_SLUG = 60


def page_name(run: str) -> str:
    """The file name of ``run``'s responses page: ``responses-<run>.html`` where the run's name is a safe,
    lower-case file name already (letters, digits, ``.``, ``_``, ``-``; no ``--``); otherwise
    ``responses-<slug>--<hash>.html``, the hash of the run's name making distinct runs distinct names
    (also on case-insensitive file systems)."""
    run = str(run)
    if _SLUG_OK.match(run) and "--" not in run and len(run) <= _MAX_SLUG and not run.endswith("."):
        return f"responses-{run}.html"
    slug = re.sub(r"[^a-z0-9._]+", "-", run.lower())
    slug = re.sub(r"-{2,}", "-", slug).strip("-.")[:_MAX_SLUG].strip("-.") or "run"
    digest = hashlib.sha1(run.encode("utf-8", "surrogatepass")).hexdigest()[:10]
    return f"responses-{slug}--{digest}.html"


def _asset(name: str) -> str:
    return resources.files("entropylens.report").joinpath(name).read_text(encoding="utf-8")


def _embed_json(data: dict) -> str:
    """The page data as JSON that no text can break out of: every "<" written as \\u003c (JSON has "<"
    only inside strings), so neither "</script>" nor "<!--" (HTML's escaped script state) appears."""
    return dumps(data).replace("<", "\\u003c")


def render_page(data: dict, *, title: str | None = None, back_href: str = "index.html") -> str:
    """The HTML text of the page (see the module's docstring)."""
    css, js = _asset("viewer.css"), _asset("viewer.js")
    low_js, low_css = js.lower(), css.lower()
    if "</script" in low_js or "<!--" in low_js or "</style" in low_css:  # pragma: no cover - the assets' own check
        raise ValueError("viewer.js / viewer.css must not contain </script, <!-- or </style")
    e = html_text  # the run id and the title: control and bidi characters as their code, not raw
    # the report's palettes (palette.py): quadrants as in every figure, updates in the runs' colours
    data = {**data, "palette": {"quadrant": dict(QUADRANT_COLORS), "update": list(RUN_COLORS)}}
    run = str(data.get("run", ""))
    title = title or f"entropylens responses: {run}"
    return (
        "<!doctype html>\n"
        '<html lang="en"><head><meta charset="utf-8">\n'
        '<meta name="viewport" content="width=device-width, initial-scale=1">\n'
        f"<title>{e(title)}</title>\n"
        f"<style>\n{css}\n</style>\n"
        "</head>\n"
        f'<body data-back="{e(back_href)}">\n'
        '<header id="el-header">\n'
        f'<nav><a id="el-back" href="{e(back_href)}">&larr; report</a></nav>\n'
        f'<h1>Responses of <span id="el-run">{e(run)}</span> <small id="el-method"></small></h1>\n'
        '<p id="el-selection"></p>\n'
        '<p id="el-textsource"></p>\n'
        "</header>\n"
        '<noscript><p class="el-warn">This page draws its content with JavaScript: enable it to read the '
        "responses.</p></noscript>\n"
        '<div id="el-app"></div>\n'
        f'<script type="application/json" id="el-data">{_embed_json(data)}</script>\n'
        f"<script>\n{js}\n</script>\n"
        "</body></html>\n"
    )


def write_page(path, data: dict, *, title: str | None = None, back_href: str = "index.html") -> Path:
    """Writes the responses page of one run (``data``: :func:`entropylens.report.responses.page_data`) to
    ``path``, one self-contained HTML file; returns its path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render_page(data, title=title, back_href=back_href), encoding="utf-8")
    return path
