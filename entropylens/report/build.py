"""The paper-style report: analyses -> figures -> DIR/index.html, DIR/report.md and the PNGs.

The HTML opens from disk (no server, no network): images are relative files, styles are inline.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..read.query import connect, run_analysis, run_sql
from . import runset
from .escape import html_text, markdown, markdown_cell
from .figures import (  # the report's figures, declared there
    FIGURES,
    SECTIONS,
    CaptionFailure,
    CaptionWarning,
    Figure,
    figure,
)

if TYPE_CHECKING:
    import pandas as pd

    from ..read.query import Connection

DEFAULT_RESPONSES = 40  # responses per run on its responses page (responses.DEFAULT_N)
DEFAULT_PAGE_BYTES = 4_000_000  # the bound on one responses page's embedded data
STEP_LINK_FIGURES = tuple(f.name for f in FIGURES if f.step_links)  # figures that link to their steps
SUMMARY_COLUMNS = (
    "run",
    "method",
    "status",
    "steps",
    "tokens",
    "final_entropy",
    "min_entropy",
    "final_reward",
    "clip_low_frac",
    "clip_high_frac",
    "erc_drop_frac",
    "hyperparameters",
)
_HYPER_KEYS = (
    "eps_low",
    "eps_high",
    "beta1",
    "beta2",
    "erc",
    "dual_clip",
    "entropy_coef",
    "kl_beta",
    "top_entropy_quantile",
    "delta",
    "off_policy_mask_threshold",
    "importance_sampling_level",
    "lr",
    "seed",
)
_HYPER_DEFAULTS = {"top_entropy_quantile": 1.0, "importance_sampling_level": "token"}  # TRL's: not shown


def _hyper(row) -> str:
    try:
        cfg = json.loads(row["config"] or "{}")
    except (TypeError, json.JSONDecodeError):
        cfg = {}
    trl = cfg.get("trl_options") if isinstance(cfg.get("trl_options"), dict) else {}  # TRL's options of the run
    cfg = {
        **{k: v for k, v in trl.items() if k in _HYPER_KEYS},
        **cfg,
        "eps_low": row.get("eps_low"),
        "eps_high": row.get("eps_high"),
    }
    parts = []
    for k in _HYPER_KEYS:
        v = cfg.get(k)
        if k in _HYPER_DEFAULTS and v == _HYPER_DEFAULTS[k]:
            continue
        if isinstance(v, float) and v != v:
            continue
        if k in ("beta1", "beta2"):  # CE-GPPO's: shown for ce_gppo runs, 0 included (beta1 = 0 is a setting)
            if (cfg.get("loss_method") or cfg.get("method")) != "ce_gppo" or v is None:
                continue
        elif v is None or (v in (0, 0.0, [], ()) and k not in ("seed",)):
            continue
        parts.append(f"{k}={round(v, 4) if isinstance(v, float) else v}")
    return ", ".join(parts)


def summary_table(con: Connection, rs: runset.RunSet | None = None) -> pd.DataFrame:
    df = run_analysis(con, "run_summary")
    df["hyperparameters"] = [_hyper(r) for r in df.to_dict("records")]
    cols = list(SUMMARY_COLUMNS)
    if rs is not None and rs.grouped:  # which series each run is drawn in
        df.insert(1, "series", df["run"].astype(str).map(lambda r: rs.series.get(r, r)))
        cols.insert(1, "series")
    return df[cols]


def _fmt(v) -> str:
    if v is None or (isinstance(v, float) and v != v):
        return "-"
    if isinstance(v, float) and v.is_integer() and abs(v) < 1e15:
        return str(int(v))
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def _connect(path, runs, engine: str, tau: float | None = None):
    if engine == "spark":  # the same analyses on Spark (entropylens.read.spark); DuckDB is canonical
        from ..read.spark import connect as spark_connect

        if tau is not None:
            raise ValueError("tau (quadrants re-split after the fact) needs the duckdb engine")
        return spark_connect(path, runs=runs)
    if engine == "duckdb":
        con = connect(path, runs=runs, tau=tau)
        con.raw.execute("SET enable_progress_bar = false")  # no bar characters in logs and demo output (a SET: raw)
        return con
    raise ValueError(f"unknown engine {engine!r}: duckdb or spark")


def _frame(con, f: Figure, rs: runset.RunSet):
    """The figure's analysis with the report's columns added: ``series`` (the line / bar / panel a row
    belongs to) and the run's own ``tau`` (the HP / LP split some figures draw)."""
    df = run_analysis(con, f.analysis, **(f.params(rs) if f.params else {}))
    if "run" in df:
        runs = df["run"].astype(str)
        df["series"] = runs.map(lambda r: rs.series.get(r, r))
        if "tau" not in df:
            df["tau"] = runs.map(lambda r: rs.setting(r, "tau")[0])
    return df


def _render(con, out: Path, f: Figure, rs: runset.RunSet) -> tuple[str | None, str]:
    """One figure: its analysis, its PNG in ``out`` -> (png file name, measured caption); (None, '')
    for an opt-in figure whose analysis has no rows."""
    import matplotlib.pyplot as plt

    if f.optional and f.present is not None and run_sql(con, f.present).empty:  # what has_data would find, read cheaply
        return None, ""
    df = _frame(con, f, rs)
    if f.optional and (df.empty or (f.has_data is not None and not f.has_data(df))):
        return None, ""
    title = "run" if rs.group_by in (None, "run") else ("config" if rs.group_by == "config" else rs.group_by)
    fig = f.plot(df, band=rs.band, legend_title=title)
    png = f"{f.name}.png"
    fig.savefig(out / png, dpi=110)
    plt.close(fig)
    return png, f.observed(df, rs)


def open_report(path, runs: list[str] | None = None, engine: str = "duckdb", tau: float | None = None):
    """The connection the report's analyses run on (for :func:`render_figure`)."""
    return _connect(path, runs, engine, tau)


def render_figure(
    con, out_dir, name: str, *, group_by: str | None = None, band: str = "minmax", rs: runset.RunSet | None = None
) -> tuple[str | None, str]:
    """Figure ``name`` on an open connection (:func:`open_report`) into ``out_dir`` -> (png or None,
    caption), for :func:`write_report`'s ``done`` (a demo worker draws several on one connection)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rs = rs or runset.from_connection(con, group_by=group_by, band=band)
    return _render(con, out, figure(name), rs)


def render_figures(
    path,
    out_dir,
    names,
    *,
    runs: list[str] | None = None,
    engine: str = "duckdb",
    group_by: str | None = None,
    band: str = "minmax",
    tau: float | None = None,
) -> dict:
    """The figures ``names`` only (a part of a report drawn in another process, e.g. by a demo worker):
    {name: (png or None, caption)}, for :func:`write_report`'s ``elsewhere`` / ``done``."""
    con = _connect(path, runs, engine, tau)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rs = runset.from_connection(con, group_by=group_by, band=band)
    return {f.name: _render(con, out, f, rs) for f in FIGURES if f.name in set(names)}


def write_report(
    path: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    runs: list[str] | None = None,
    engine: str = "duckdb",
    group_by: str | None = None,
    band: str = "minmax",
    elsewhere: tuple[str, ...] = (),
    done: Mapping[str, tuple[str | None, str]] | Callable[[], Mapping[str, tuple[str | None, str]]] | None = None,
    on_summary: Callable[[pd.DataFrame], object] | None = None,
    responses: int = DEFAULT_RESPONSES,
    where: str | None = None,
    tokenizer: Any = None,
    max_page_bytes: int = DEFAULT_PAGE_BYTES,
    tau: float | None = None,
    con: Connection | None = None,
) -> Path:
    """Runs every figure's analysis over the runs under ``path``; writes index.html, report.md and
    one PNG per figure into ``out_dir``, and (unless ``responses=0``) a token viewer page per run
    (``responses-<run>.html``, entropylens/report/viewer.py) whose steps the entropy, clip and
    entropy-budget figures link to.

    Figures, legends and captions are per run unless ``group_by`` groups them. Every threshold a figure or
    caption uses is each run's own (runset.py). A measured caption that raises (here or in the process that
    drew its figure) is replaced by a row count that says so, with a
    :class:`~entropylens.report.figures.CaptionWarning` (an error in the tests).

    Args:
        path: the runs, as :func:`~entropylens.read.query.connect` takes them (a run directory, a directory
            of runs or above, or an object-store URL).
        out_dir: the report's folder, made if missing.
        runs: only these runs (run ids, or run directory names); None (default): every run found.
        engine: "duckdb" (default) or "spark" (the same analyses on pyspark, entropylens.read.spark).
        group_by: "method", "config" (seeds of one config), or a config key such as "lr" or "seed": the runs
            that share its value are drawn as one series, their mean with a ``band`` over the runs. None
            (default): one series per run.
        band: the band over a group's runs: "minmax" (default) or "sd" (+-1 sd).
        elsewhere: names of figures drawn into ``out_dir`` by another process (:func:`render_figures`, with
            the same group_by / band), not drawn here. Default: none.
        done: those figures' {name: (png or None, caption)}: a dict, or a callable called once the others
            are drawn here. Needed with ``elsewhere``.
        on_summary: called with the run table (:func:`summary_table`), e.g. to print it too; None: not called.
        responses: how many responses per run its token viewer page shows, token by token, chosen by
            responses.select (0: no pages). Default 40.
        where: only responses with a token row where this SQL condition holds; None (default): any.
        tokenizer: a tokenizer object or a local path that decodes the tokens, in place of the one a run
            names; None (default): the run's own.
        max_page_bytes: the bound on each page's embedded data, in bytes (default 4,000,000).
        tau: every quadrant split at this tau in place of each run's recorded one, recomputed from the
            token rows (read/retau.py; the duckdb engine only); the report says so. None (default): each
            run's own.
        con: the connection to draw on, opened by the caller (:func:`open_report` with the same runs, engine
            and tau), in place of opening one here; None (default): one is opened.

    Returns:
        The path of index.html.

    Raises:
        ValueError: when engine is neither "duckdb" nor "spark", tau comes with the spark engine, band is
            neither "minmax" nor "sd", or group_by is a config key that no run records.
        QueryError: when ``path`` holds no readable runs (as :func:`~entropylens.read.query.connect`), or
            ``where`` is not one valid condition.
    """
    con = _connect(path, runs, engine, tau) if con is None else con
    rs = runset.from_connection(con, group_by=group_by, band=band)
    if responses and where is not None and rs.method:  # a bad --where fails now, before any figure is drawn
        from .responses import matching

        matching(con if engine == "duckdb" else _connect(path, runs, "duckdb", tau), next(iter(rs.method)), where)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    summary = summary_table(con, rs)
    if on_summary is not None:
        on_summary(summary)
    drawn = {f.name: _render(con, out, f, rs) for f in FIGURES if f.name not in set(elsewhere)}
    if elsewhere:
        theirs = done() if callable(done) else done
        if theirs is None:
            raise TypeError("write_report: elsewhere= needs done= (those figures' drawings)")
        drawn.update(theirs)
        for _, caption in theirs.values():  # a caption that failed in the process that drew it: warned here too
            if isinstance(caption, CaptionFailure):
                warnings.warn(CaptionWarning(caption.why + "; the report shows a row count in its place"), stacklevel=2)
    notes = _run_notes(con if engine == "duckdb" else None)
    rendered, not_shown = [], []
    for f in FIGURES:
        png, caption = drawn[f.name]
        if png is not None and notes.get(f.name) and not isinstance(caption, CaptionFailure):
            caption = f"{caption} {notes[f.name]}".strip()
        if png is None:
            not_shown.append(f)
        else:
            rendered.append((f, png, caption))
    about = comparison_text(rs)
    if tau is not None:
        about = (
            f"Quadrants split at tau = {tau:g} (given after the fact), not at each run's recorded tau: "
            "tokens and the steps' per-quadrant counts recomputed from the token rows. " + about
        ).strip()
    pages = (
        response_pages(
            path,
            out,
            list(rs.method),
            n=responses,
            where=where,
            tokenizer=tokenizer,
            max_bytes=max_page_bytes,
            runs_filter=runs,
            con=con if engine == "duckdb" else None,
            tau=tau,
        )
        if responses
        else []
    )
    remove_stale_pages(out, {p.file for p in pages})
    _write_markdown(out / "report.md", summary, rendered, not_shown, about, pages)
    index = out / "index.html"
    index.write_text(_html(summary, rendered, not_shown, about, pages))
    return index


@dataclass(frozen=True)
class ResponsePage:
    run: str
    file: str  # the page's file name in the report's folder
    steps: tuple[int, ...]  # the steps it holds
    responses: int
    text: str  # how they were chosen (responses.Selection.text)


def response_pages(
    path,
    out: Path,
    runs: list[str],
    *,
    n: int,
    where: str | None,
    tokenizer,
    max_bytes: int,
    runs_filter=None,
    con=None,
    tau: float | None = None,
) -> list[ResponsePage]:
    """Each run's responses page (entropylens/report/viewer.py) in ``out``; ``con``: a DuckDB connection of the
    report's runs (one is opened when None, e.g. when the figures ran on Spark)."""
    from ..read.run_decoder import decoder_for_run
    from . import responses as resp
    from . import viewer

    con = con if con is not None else _connect(path, runs_filter, "duckdb", tau)
    methods = dict(run_sql_rows(con, "SELECT run, method FROM runs"))
    # without --where only the steps each selection visits are read (responses.select); with it, the whole table
    table = resp.responses(con) if where is not None else None
    counts = resp.response_counts(con) if where is None else {}
    pages = []
    for run in runs:
        sel = resp.select(
            con,
            run,
            n=n,
            where=where,
            max_bytes=max_bytes,
            table=table[table["run"] == run] if table is not None else None,
            counts=counts.get(run, {}) if where is None else None,
        )
        data = resp.page_data(con, run, sel, decoder_for_run(path, run, tokenizer=tokenizer), method=methods.get(run))
        name = viewer.page_name(run)
        viewer.write_page(out / name, data, title=f"entropylens responses: {run}")
        pages.append(ResponsePage(run, name, tuple(d["step"] for d in data["steps"]), len(sel.rows), sel.text))
    return pages


def remove_stale_pages(out: Path, keep: set[str]) -> list[str]:
    """Deletes the responses pages an earlier report left in ``out`` (``responses-*.html`` whose head names
    an entropylens responses page) that this report did not write (``keep``: file names), so a report
    written over another links only its own runs' pages. Other files are never touched. -> names removed."""
    removed = []
    for f in sorted(Path(out).glob("responses-*.html")):
        if f.name in keep or not f.is_file():
            continue
        with open(f, encoding="utf-8", errors="replace") as fh:
            head = fh.read(4096)
        if "<title>entropylens responses:" in head:
            f.unlink()
            removed.append(f.name)
    return removed


def run_sql_rows(con, sql: str) -> list[tuple]:
    from ..read.query import run_sql

    return list(run_sql(con, sql).itertuples(index=False, name=None))


def _step_links_md(pages) -> str:
    parts = [f"{markdown(p.run)}: " + " ".join(f"[{s}]({p.file}#step={s})" for s in p.steps) for p in pages if p.steps]
    return ("Responses at step: " + "; ".join(parts) + ".") if parts else ""


def _step_links_html(pages) -> str:
    e = html_text
    parts = [
        f"{e(p.run)}: " + " ".join(f'<a href="{e(p.file)}#step={s}">{s}</a>' for s in p.steps) for p in pages if p.steps
    ]
    return f'<p class="steps">Responses at step: {"; ".join(parts)}</p>' if parts else ""


CLIP_FIGURES = ("clip_by_quadrant", "ratio_vs_prob", "clipped_prob", "entropy_ratio", "clipping_removed")


def _run_notes(con) -> dict[str, str]:
    """{figure name: a sentence to add to its caption} from the run-level findings (run_findings.py): the
    clipping sections name the runs trained on-policy (every ratio 1), the quadrant share the thin quadrants."""
    if con is None:
        return {}
    from .run_findings import on_policy, thin_quadrants

    out = {}
    by_advice: dict[str | None, list[str]] = {}  # the advice is in each run's trainer's settings
    for f in on_policy(con):
        by_advice.setdefault(f.signal, []).append(f.run)
    parts = []
    for advice, runs in by_advice.items():
        listed = ", ".join(runs[: runset.MAX_LISTED]) + (
            f" and {len(runs) - runset.MAX_LISTED} more" if len(runs) > runset.MAX_LISTED else ""
        )
        parts.append(f"On-policy ({listed}): {advice}.")
    if parts:
        for name in CLIP_FIGURES:
            out[name] = " ".join(parts)
    thin = thin_quadrants(con)
    if thin:
        out["quadrant_share"] = (
            "Thin quadrants: " + "; ".join(f"{f.run}: {f.signal}" for f in thin[: runset.MAX_LISTED]) + "."
        )
    return out


def comparison_text(rs: runset.RunSet) -> str:
    """One paragraph above the figures: how many runs, what differs between them, how they are drawn."""
    n = len(rs.method)
    key = rs.controlled_in()
    if n == 1:
        text = "One run."
    elif key is not None:
        vals = rs.factors()[key]
        text = (
            f"{n} runs, a controlled comparison in {key} ({', '.join(runset.fmt(v) for v in vals)}): every other "
            "recorded setting is the same" + (" (seeds aside)." if "seed" in rs.factors() else ".")
        )
    else:
        text = f"{n} runs. " + rs.differs_text()
    if rs.grouped:
        text += " " + rs.band_text()
    else:
        text += " One line, bar or panel per run."
    return text


def _not_shown_text(not_shown) -> str:
    """One sentence naming the optional figures these runs hold no data for, or ''."""
    if not not_shown:
        return ""
    names = "; ".join(f"{f.title} (`{f.analysis}`: no data in these runs)" for f in not_shown)
    hints = " ".join(dict.fromkeys(f.when_empty for f in not_shown if f.when_empty))
    return f"Not shown: {names}." + (f" {hints}" if hints else "")


def when_empty(analysis: str) -> str:
    """How to record the data an opt-in analysis needs ('' for the others)."""
    return next((f.when_empty for f in FIGURES if f.analysis == analysis and f.when_empty), "")


def _write_markdown(path: Path, summary, rendered, not_shown=(), about: str = "", pages=()) -> None:
    cols = list(summary.columns)
    lines = ["# entropylens report", "", "## Runs", ""] + ([markdown(about), ""] if about else [])
    lines.append("| " + " | ".join(cols) + " |")
    lines.append("|" + "---|" * len(cols))
    for row in summary.to_dict("records"):
        lines.append("| " + " | ".join(markdown_cell(_fmt(row[c])) for c in cols) + " |")
    lines.append("")
    section = ""
    for f, png, seen in rendered:
        if f.section != section:  # a section's heading and paragraph, before its first figure
            section = f.section
            sec_title, sec_text = SECTIONS[section]
            lines += [f"## {sec_title}", "", sec_text, ""]
        level = "###" if section else "##"
        lines += [
            f"{level} {f.title}",
            "",
            f"![{f.title}]({png})",
            "",
            f"*{f.caption}* {markdown(seen)} (analysis: `{f.analysis}`)",
            "",
        ]
        if f.step_links and _step_links_md(pages):
            lines += [_step_links_md(pages), ""]
    if not_shown:
        lines += [_not_shown_text(not_shown), ""]
    if pages:
        lines += ["## Responses, token by token", ""]
        lines += [f"- [{markdown(p.run)}]({p.file}): {markdown(p.text)}" for p in pages] + [""]
    path.write_text("\n".join(lines))


def _html(summary, rendered, not_shown=(), about: str = "", pages=()) -> str:
    e = html_text
    cols = list(summary.columns)
    head = "".join(f"<th>{e(c)}</th>" for c in cols)
    rows = "".join(
        "<tr>" + "".join(f"<td>{e(_fmt(r[c]))}</td>" for c in cols) + "</tr>" for r in summary.to_dict("records")
    )
    figs, section = "", ""
    for f, png, seen in rendered:
        if f.section != section:  # a section's heading and paragraph, before its first figure
            section = f.section
            sec_title, sec_text = SECTIONS[section]
            figs += (
                f'<h2 class="section" id="section-{e(section)}">{e(sec_title)}</h2><p class="section">{e(sec_text)}</p>'
            )
        h = "h3" if section else "h2"
        figs += (
            f'<figure id="{e(f.name)}"><{h}>{e(f.title)}</{h}><img src="{e(png)}" alt="{e(f.title)}">'
            f"<figcaption>{e(f.caption)} <b>{e(seen)}</b> <code>entropylens analyze PATH {e(f.analysis)}</code>"
            "</figcaption>" + (_step_links_html(pages) if f.step_links else "") + "</figure>"
        )
    if not_shown:
        figs += f"<p>{e(_not_shown_text(not_shown).replace('`', ''))}</p>"
    toc = " · ".join(f'<a href="#{e(f.name)}">{e(f.title)}</a>' for f, *_ in rendered)
    if pages:
        items = "".join(f'<li><a href="{e(p.file)}">{e(p.run)}</a>: {e(p.text)}</li>' for p in pages)
        figs += f'<section id="responses"><h2>Responses, token by token</h2><ul>{items}</ul></section>'
        toc += ' · <a href="#responses">Responses</a>'
        pages_line = (
            "<p>Responses token by token (coloured by entropy, ratio, quadrant, clip, ERC, gradient): "
            + " · ".join(f'<a href="{e(p.file)}">{e(p.run)}</a>' for p in pages)
            + "</p>"
        )
    else:
        pages_line = ""
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>entropylens report</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1150px; color: #222; }}
table {{ border-collapse: collapse; font-size: 13px; }} td, th {{ border: 1px solid #ccc; padding: 3px 6px; }}
th {{ background: #f3f3f3; }} figure {{ margin: 2em 0; }} img {{ max-width: 100%; }}
figcaption {{ color: #444; font-size: 14px; }} nav {{ font-size: 13px; margin: 1em 0; }}
p.steps {{ font-size: 13px; color: #444; }}
h2.section {{ border-top: 2px solid #ccc; padding-top: 0.8em; margin-top: 2em; }} p.section {{ font-size: 14px; }}
</style></head>
<body><h1>entropylens report</h1>
<nav>{toc}</nav>
<h2>Runs</h2><p id="comparison">{e(about)}</p><table><tr>{head}</tr>{rows}</table>
{pages_line}
{figs}
</body></html>
"""
