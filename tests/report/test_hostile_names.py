"""Everything a user names reaches each output escaped for it: a real run (the Recorder, policy_loss) whose run
id holds HTML, `|`, rich markup, a right-to-left override (U+202E) and a C1 control, whose config values hold
HTML, `|` and NUL, and whose token text (a vocabulary) and response texts hold bidi controls, format-only
tokens (U+200B, U+2066, U+FEFF, ...), HTML and NUL; beside it a plain run.

- report.md, rendered by a CommonMark + tables parser (markdown-it, what many previewers use): no tag comes
  from a name, every table row has the header's cells, and each name reads as typed (its invisible
  characters as their code);
- index.html and the run's token-viewer page in headless Chromium: no script runs (no dialog, no flag set by
  an onerror handler), the token spans are drawn in their DOM order (x increasing along a line), a
  format-only token is a visible mark of non-zero width;
- `show`, `runs`, `query`, `check` and `watch` (typer's runner): no raw C0 (but the newline), DEL, C1,
  format or bidi character in their output, rich markup in a run id printed as typed.
"""

from __future__ import annotations

import os
import shutil
import unicodedata
import warnings
from pathlib import Path

import pytest
import torch
from cli_calls import ok, runner
from entropylens.cli.main import app

from entropylens import Recorder
from entropylens.alarms import NonFiniteWarning
from entropylens.report.escape import visible
from entropylens.report.viewer import page_name
from entropylens.rl.losses import policy_loss

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
needs_chromium = pytest.mark.skipif(
    CHROMIUM is None and not os.environ.get("CI"), reason="chromium not installed (CI installs it)"
)

# no '"' or '=' in a run's folder name here: the reader's handling of those is tested on its own
RUN = "x<img src onerror>|<b>[red]\u202egnp.exe\x85'"
PLAIN = "grpo-seed1"
CONFIGS = {
    RUN: {
        "method": "grpo",
        "note": "a|b<img src=x onerror=window.PWNED=3>\x00\u202eend",
        "kl_beta": "0.1|<script>window.PWNED=4</script>\x00",
    },
    PLAIN: {"method": "grpo", "note": "plain", "kl_beta": 0.1},
}
VOCAB = [
    " the",
    "\u202e",
    " cat",
    "\u200b",
    " dog",
    "\u2066",
    " x",
    "\ufeff",
    " \u05e9\u05dc\u05d5\u05dd",
    " \u05d0\u05d1",
    " y",
    "<img src=x onerror=window.PWNED=1>",
    "a\x00b",
    " \u202eabc",
    " |",
    "\x85",
    " end",
    "\u2028",
    "\u3164",
    " z",
]
FORMAT_ONLY = {
    1: "\\u202e",
    3: "\\u200b",
    5: "\\u2066",
    7: "\\ufeff",
    15: "\\x85",
    17: "\\u2028",
    18: "\\u3164",
}  # token id -> the mark the viewer draws for it
TEXT_TAIL = " <script>window.PWNED=2</script>\x00\u202e tail"
STEPS, B = 2, 4
T = len(VOCAB)
NAN_STEP = 1  # the hostile run's grad norm is NaN here: `check` prints a line naming the run


def record(root: Path, run: str) -> None:
    gen = torch.Generator().manual_seed(3)
    ids = torch.arange(T).repeat(B, 1)  # [B, T]: every response holds every token, in the vocabulary's order
    text = "".join(VOCAB) + TEXT_TAIL
    with Recorder(root, run, config=CONFIGS[run], tokenizer=VOCAB) as rec:
        for step in range(STEPS):
            mask = torch.ones(B, T, dtype=torch.bool)
            old_logp = (0.05 + 0.9 * torch.rand(B, T, generator=gen)).log()
            old_h = 0.3 + 2.0 * torch.rand(B, T, generator=gen)
            rewards = torch.tensor([1.0, 0.0, 1.0, 0.0])
            adv = rewards - 0.5
            seq_ids = torch.arange(B) + step * B
            rec.record_sequences(
                step,
                seq_ids=seq_ids,
                rewards=rewards,
                advantages=adv,
                lengths=torch.full((B,), T),
                group_ids=seq_ids // 2,
                texts=[text] * B,
            )
            logp = (old_logp + 0.2 * torch.randn(B, T, generator=gen)).clamp(max=0.0)
            out = policy_loss(logp, old_logp, adv, mask, method="grpo", entropy=old_h, old_entropy=old_h)
            rec.record_update(
                step,
                0,
                mask=mask,
                advantages=adv,
                logprobs=logp,
                old_logprobs=old_logp,
                entropy=old_h,
                old_entropy=old_h,
                tokens=ids,
                seq_ids=seq_ids,
                group_ids=seq_ids // 2,
                loss=out,
            )
            nan = run == RUN and step == NAN_STEP
            rec.record_step(step, update=0, grad_norm=float("nan") if nan else 0.5, lr=1e-3)


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    base = tmp_path_factory.mktemp("hostile")
    root = base / "runs"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NonFiniteWarning)  # the NaN grad norm, on purpose
        for run in (RUN, PLAIN):
            record(root, run)
    out = base / "report"
    ok("report", root, "--out", out)
    return root, out


def raw_invisible(text: str, keep: str = "\n") -> list[str]:
    """The characters of ``text`` that no output may carry raw: C0 (but ``keep``), DEL, C1, format (bidi
    included), line / paragraph separators."""
    return sorted(
        {f"U+{ord(c):04X}" for c in text if unicodedata.category(c) in ("Cc", "Cf", "Zl", "Zp", "Cs") and c not in keep}
    )


# ------------------------------------------------------------------------------------- the Recorder
@pytest.mark.parametrize("bad", ["a\x00b", "a/b", "two\nlines", "esc\x1b[31m"])
def test_recorder_refuses_a_run_id_with_a_slash_or_a_control_character(tmp_path, bad):
    with pytest.raises(ValueError) as e:
        Recorder(tmp_path, bad)
    assert "run id must be a plain directory name" in str(e.value) and repr(bad) in str(e.value)
    assert "\n" not in str(e.value) and not list(tmp_path.iterdir())  # one line; nothing created


# ------------------------------------------------------------------------------------- report.md
def _text(inline) -> str:
    """What an inline token renders as text (entities decoded)."""
    return "".join(c.content for c in inline.children or [] if c.type in ("text", "code_inline"))


def _table(tokens) -> list[list[str]]:
    """The rows of the first table, each a list of its cells' rendered text."""
    rows, row, inside = [], None, False
    for i, t in enumerate(tokens):
        inside = inside or t.type == "table_open"
        if not inside:
            continue
        if t.type == "tr_open":
            row = []
        elif t.type in ("th_open", "td_open"):
            row.append(_text(tokens[i + 1]))
        elif t.type == "tr_close":
            rows.append(row)
        elif t.type == "table_close":
            return rows
    return rows


def test_report_md_renders_no_tag_and_whole_table_rows(report):
    from markdown_it import MarkdownIt

    _, out = report
    md = (out / "report.md").read_text()
    assert raw_invisible(md) == []
    tokens = MarkdownIt("commonmark").enable("table").parse(md)
    inline = [c for t in tokens for c in (t.children or [])]
    assert [t.content for t in tokens + inline if t.type in ("html_inline", "html_block")] == []  # no tag
    assert all(c.attrs["src"].endswith(".png") for c in inline if c.type == "image")  # the figures only
    rows = _table(tokens)
    head = rows[0]
    assert len(rows) == 3 and all(len(r) == len(head) for r in rows), rows
    by_run = {r[head.index("run")]: dict(zip(head, r)) for r in rows[1:]}
    assert set(by_run) == {visible(RUN), PLAIN}  # as typed, its U+202E and U+0085 as their code
    assert "kl_beta=" + visible(CONFIGS[RUN]["kl_beta"]) in by_run[visible(RUN)]["hyperparameters"]
    assert f"| {PLAIN} |" in md  # an ordinary id stays as it is in the file
    paragraphs = [_text(t) for t in tokens if t.type == "inline"]
    assert any(visible(CONFIGS[RUN]["note"]) in p for p in paragraphs)  # the comparison names it as typed
    links, text = {}, None
    for c in inline:
        if c.type == "link_open":
            href, text = c.attrs["href"], ""
        elif c.type == "text" and text is not None:
            text += c.content
        elif c.type == "link_close":
            links[text], text = href, None
    assert links[visible(RUN)] == page_name(RUN) and links[PLAIN] == page_name(PLAIN)


# ------------------------------------------------------------------------------------- Chromium
def _open(browser, path: Path, ready: str | None = None):
    pg = browser.new_page(viewport={"width": 1300, "height": 1000})
    seen: list[str] = []
    pg.on("dialog", lambda d: (seen.append(f"dialog {d.message}"), d.dismiss()))
    pg.on("pageerror", lambda e: seen.append(f"error {e}"))
    pg.goto(path.as_uri())
    if ready:
        pg.wait_for_selector(ready)
    return pg, seen


@needs_chromium
def test_report_html_runs_no_script_and_shows_the_names_as_typed(report, browser):
    _, out = report
    pg, seen = _open(browser, out / "index.html")
    pg.wait_for_load_state("load")
    assert pg.evaluate("window.PWNED") is None and seen == []
    assert pg.eval_on_selector_all("img", "is => is.filter(i => !i.getAttribute('src').endsWith('.png')).length") == 0
    assert pg.locator("b:not(figcaption b)").count() == 0 and pg.locator("script").count() == 0
    head = pg.eval_on_selector_all("table tr th", "ts => ts.map(t => t.textContent)")
    rows = pg.eval_on_selector_all("table tr:has(td)", "rs => rs.map(r => [...r.cells].map(c => c.textContent))")
    assert len(rows) == 2 and all(len(r) == len(head) for r in rows)
    assert {r[head.index("run")] for r in rows} == {visible(RUN), PLAIN}
    assert raw_invisible(pg.evaluate("document.body.innerText"), keep="\n\t") == []  # tabs: innerText's cells
    pg.close()


def _spans(pg) -> list[dict]:
    return pg.eval_on_selector_all(
        "#el-text span.tk",
        """ss => ss.map(s => {
        const r = [...s.getClientRects()];
        return {pos: +s.dataset.pos, text: s.textContent, left: r[0].left, top: r[0].top,
                right: r[r.length - 1].right, bottom: r[r.length - 1].bottom,
                marks: [...s.querySelectorAll('.cc')].map(m => [m.textContent, m.getBoundingClientRect().width])};
    })""",
    )


@needs_chromium
def test_viewer_page_runs_no_script_draws_tokens_in_order_and_marks_format_only_tokens(report, browser):
    _, out = report
    pg, seen = _open(browser, out / page_name(RUN), 'body[data-ready="1"]')
    assert pg.evaluate("window.PWNED") is None and seen == []
    assert pg.locator("#el-text img, #el-completion img, #el-details img").count() == 0
    assert pg.text_content("#el-run") == visible(RUN)
    pg.click("#el-list tbody tr")
    spans = _spans(pg)
    assert [s["pos"] for s in spans] == list(range(T))
    for a, b in zip(spans, spans[1:]):  # each next token on a later line, or to the right on the same line
        assert b["top"] >= a["bottom"] - 1 or b["left"] >= a["right"] - 0.5, (a, b)
    for i, mark in FORMAT_ONLY.items():
        ((text, width),) = spans[i]["marks"]
        assert text == mark and width > 4, (i, spans[i])
    assert spans[12]["text"] == "a\\x00b" and spans[13]["text"] == " \\u202eabc"  # NUL, RLO within a token
    assert spans[11]["text"] == VOCAB[11] and spans[8]["text"] == VOCAB[8]  # HTML as text, Hebrew as it is
    assert raw_invisible(pg.text_content("#el-text")) == []
    completion = pg.text_content("#el-completion pre")
    assert raw_invisible(completion) == [] and completion.endswith(visible(TEXT_TAIL))
    pg.hover('#el-text span.tk[data-pos="1"]')
    assert pg.text_content('#el-details [data-role="token"]') == '"\\u202e"'
    assert raw_invisible(pg.evaluate("document.body.innerText"), keep="\n\t") == []  # tabs: innerText's cells
    pg.close()


# ------------------------------------------------------------------------------------- the terminal
def _cli(*args, code: int = 0) -> str:
    res = runner.invoke(app, [str(a) for a in args], env={"COLUMNS": "200"})
    assert res.exit_code == code, res.output
    return res.output


def test_terminal_output_carries_no_raw_control_bidi_or_markup(report):
    root, _ = report
    outputs = {
        "show list": _cli("show", root, "--run", RUN, "--step", 1),
        "show seq": _cli("show", root, "--run", RUN, "--step", 1, "--seq", B + 1),
        "runs": _cli("runs", root),
        "query": _cli("query", root, "SELECT run, json_extract_string(config, '$.note') AS note FROM runs"),
        "check": _cli("check", root, code=1),
        "watch": _cli("watch", root, "--interval", 0.1),
    }
    for name, text in outputs.items():
        assert raw_invisible(text) == [], name
        assert visible(RUN) in text.replace("\n", ""), (name, text)  # the run id as typed, [red] included
    assert visible(CONFIGS[RUN]["note"]) in outputs["query"]  # the config's NUL and RLO, visible
    seq = outputs["show seq"]
    for mark in FORMAT_ONLY.values():
        assert mark in seq
    assert "a\\x00b" in seq
    assert f"run={visible(RUN)} step={NAN_STEP} rule=nonfinite" in outputs["check"]


# ------------------------------------------------------------------------------------- the figures
def test_figure_legends_draw_names_as_typed_without_mathtext():
    """A '$' pair in a run id would be read as mathtext (drawn as math, or a parse error that loses the
    figure); a U+202E would reverse the rest of its legend entry."""
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from figure_frames import frames, spec

    from entropylens.report import plots

    runs = ["grpo cost $\\frac$", "grpo r\u202egnp.exe"]  # starting with the method: labelled by the id alone
    f = frames([spec(r, "grpo") for r in runs])
    fig = plots.entropy_vs_step(f["entropy_by_step"])
    fig.savefig(io.BytesIO(), format="png")  # no ParseFatalException from mathtext
    texts = [t.get_text() for t in fig.legends[0].get_texts()]
    assert sorted(texts) == sorted([r.replace("$", "\\$") for r in runs[:1]] + [visible(runs[1])])
    plt.close(fig)
