"""entropylens/report/escape.py: a name escaped for Markdown renders (CommonMark + tables, markdown-it) as one
plain text that reads as typed, with nothing of it read as structure; ordinary names and the report's
measured sentences stay as they are; the terminal form writes every control, format and separator
character as its code."""

from __future__ import annotations

import pytest
from markdown_it import MarkdownIt

from entropylens.report.escape import code, drawn_as_nothing, markdown, markdown_cell, terminal, token, visible

HOSTILE = [
    "x<img src=x onerror=alert(1)>",
    "<script>alert(1)</script>",
    "<!-- c -->",
    "<?php x ?>",
    "<https://e.com>",
    "<a@b.c>",
    "[link](http://e.com)",
    "![img](x.png)",
    "[ref][1]",
    "`code`",
    "``a|b``",
    "*em* **strong**",
    "_em_ __strong__",
    "a\\*b",
    "a\\",
    "&lt;&amp;&#60;&#x3c;",
    "# heading",
    "> quote",
    "- item",
    "1. item",
    "a\nb\r\nc\rd",
    "a|b||c",
    "\\|",
    "tab\there",
    "nul\x00 esc\x1b[31m del\x7f nel\x85 csi\x9b",
    "rlo\u202egnp.exe lri\u2066 zw\u200b bom\ufeff ls\u2028",
]
ORDINARY = [
    "grpo-seed1",
    "grpo_lr_1e-3",
    "erc-dapo.s0",
    "lr=0.001",
    "PA&HP 42.4%",
    "p < tau = 0.5 vs p >= tau",
    "1.15 -> 0.359",
    "p in [0.2, 0.3) (mean |log rho| 0.136)",
    "(0.95, 1.05)",
    "[red]",
    "a-b_c.d",
]


def _render(md: str):
    return MarkdownIt("commonmark").enable("table").parse(md)


@pytest.mark.parametrize("s", HOSTILE)
def test_markdown_text_renders_as_one_plain_text_as_typed(s):
    tokens = _render("Run " + markdown(s) + " here.")
    assert [t.type for t in tokens] == ["paragraph_open", "inline", "paragraph_close"], tokens
    children = tokens[1].children
    assert {c.type for c in children} <= {"text"}, [(c.type, c.content) for c in children]
    want = "Run " + visible(s.replace("\r\n", " ").replace("\n", " ").replace("\r", " ")) + " here."
    assert "".join(c.content for c in children) == want


@pytest.mark.parametrize("s", HOSTILE)
def test_markdown_cell_keeps_the_row_s_cells(s):
    md = "| run | x |\n|---|---|\n| " + markdown_cell(s) + " | 1 |\n"
    tokens = _render(md)
    cells = [tokens[i + 1] for i, t in enumerate(tokens) if t.type == "td_open"]
    assert len(cells) == 2
    assert {c.type for c in cells[0].children} <= {"text"}
    want = visible(s.replace("\r\n", " ").replace("\n", " ").replace("\r", " ")).strip()
    assert "".join(c.content for c in cells[0].children) == want


@pytest.mark.parametrize("s", ORDINARY)
def test_ordinary_names_and_measured_sentences_stay_as_they_are(s):
    assert markdown(s) == s and terminal(s) == s and visible(s) == s
    assert markdown_cell(s) == s.replace("|", "\\|")


def test_terminal_writes_each_invisible_character_as_its_python_code():
    assert terminal("a\x00\x1b\x7f\x85\x9b\u202a\u202e\u2066\u2069\u200e\u200f\u061c\u200b\ufeff\u2028\U000e0001") == (
        "a\\x00\\x1b\\x7f\\x85\\x9b\\u202a\\u202e\\u2066\\u2069\\u200e\\u200f\\u061c\\u200b\\ufeff\\u2028\\U000e0001"
    )
    assert terminal("a\nb\tc", keep="\n\t") == "a\nb\tc" and terminal("a\nb\tc\r") == "a\\nb\\tc\\r"
    assert terminal("\ud800") == "\\ud800"  # a lone surrogate: printing it raw would fail to encode
    assert terminal("é ü 日本 שלום \u00a0") == "é ü 日本 שלום \u00a0"  # letters and spaces as they are
    assert code("\u202e") == "\\u202e"


def test_a_token_drawn_as_nothing_is_written_whole_as_its_codes():
    assert drawn_as_nothing("\u3164") and drawn_as_nothing("\ufe0f") and drawn_as_nothing("\u200b\u200d")
    assert not drawn_as_nothing("\u2764\ufe0f") and not drawn_as_nothing(" ") and not drawn_as_nothing("")
    assert token("\u3164") == "\\u3164" and token("\ufe0f") == "\\ufe0f"
    assert token("\u2764\ufe0f") == "\u2764\ufe0f"  # a variation selector beside its character stays
    assert token("a\u202eb\n", keep="\n") == "a\\u202eb\n"
