"""`entropylens show`: the step's response list and one response token by token, through Typer's runner,
on the hand-built runs of fixture_runs.py (values known by construction) and a longer hand-built run."""

import json
import math

import numpy as np
import pytest
from cli_calls import err, ok, runner
from entropylens.cli.main import app
from fixture_runs import build, step_row
from rich.console import Console
from rich.style import Style
from rich.text import Text

from entropylens.read.query import connect
from entropylens.record.writing.parquet import write_sequences, write_steps, write_tokens
from entropylens.report import responses as R
from entropylens.report import show
from entropylens.token_text import HOW_TO_GET_TEXT, make_decoder

COLOUR_ENV = {
    "FORCE_COLOR": "1",
    "COLORTERM": "truecolor",
    "TERM": "xterm-256color",
    "NO_COLOR": None,
    "COLUMNS": "120",
}
# the longer run: one response of 10 recorded positions (5 and 6 not sampled) out of a length of 12
LONG_POS = [0, 1, 2, 3, 4, 7, 8, 9, 10, 11]
LONG_H_OLD = [0.1, 0.9, 0.2, 0.8, 0.8, 0.3, 0.4, 0.5, 0.6, 0.7]  # top 20%: k=2, the tie at 0.8 too
LONG_FORKS = {1, 3, 4}  # indexes of the forking tokens
LONG_ERC = [True, False, True, True, True, True, True, False, True, True]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return build(tmp_path_factory.mktemp("show"))


@pytest.fixture(scope="module")
def long_run(tmp_path_factory):
    """Run "long" (grpo): step 3, updates 0 and 1; seq 7 (update 0 only) with the positions LONG_POS, token
    ids 10..19 and an inline vocabulary in run.json (id i -> "w{i}"); seq 8: two tokens, at both updates."""
    d = tmp_path_factory.mktemp("long") / "long"
    d.mkdir()
    vocab = [f"w{i}" for i in range(30)]
    (d / "run.json").write_text(
        json.dumps(
            {
                "run": "long",
                "method": "grpo",
                "status": "finished",
                "eps_low": 0.2,
                "eps_high": 0.2,
                "schema_version": 1,
                "config": {"method": "grpo", "tokenizer": {"class": "vocabulary", "vocab": vocab}},
            }
        )
    )
    n = len(LONG_POS) + 2
    old = np.log(np.full(n, 0.5, np.float32))
    ratio = np.array([1.0, 1.1, 0.9, 1.3, 0.7, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0], np.float32)
    arrs = {
        "update": np.zeros(n, np.int16),
        "seq": np.array([7] * len(LONG_POS) + [8, 8], np.int32),
        "group": np.zeros(n, np.int32),
        "pos": np.array(LONG_POS + [0, 1], np.int32),
        "token_id": np.array(list(range(10, 20)) + [20, 21], np.int32),
        "old_logprob": old,
        "logprob": old + np.log(ratio),
        "advantage": np.ones(n, np.float32),
        "quadrant": np.full(n, 1, np.int8),
        "clip": np.zeros(n, np.int8),
        "clipped": np.zeros(n, bool),
        "entropy": np.array(LONG_H_OLD + [1.0, 1.0], np.float32) * 1.1,
        "old_entropy": np.array(LONG_H_OLD + [1.0, 1.0], np.float32),
        "erc_kept": np.array(LONG_ERC + [True, True]),
    }
    write_tokens(d, 3, 0, 0, arrs)
    write_tokens(d, 3, 0, 1, {k: v[-2:] for k, v in arrs.items()} | {"update": np.ones(2, np.int16)})  # seq 8 only
    write_steps(d, 3, 0, [step_row(0, n, 1.0, 1.0, 0.0), step_row(1, 2, 1.0, 1.0, 0.0)])
    write_sequences(
        d,
        3,
        0,
        0,
        {
            "seq": np.array([7, 8], np.int32),
            "group": np.zeros(2, np.int32),
            "reward": np.array([1.0, 0.0], np.float32),
            "advantage": np.array([1.0, 1.0], np.float32),
            "length": np.array([12, 2], np.int32),
            "text": ["the recorded completion", None],
        },
    )
    return d


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    """A tiny local Hugging Face tokenizer: ids 3..6 are 'The', ' cat', ' sat', ' down'."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<unk>": 1, "x": 2, "The": 3, "Ġcat": 4, "Ġsat": 5, "Ġdown": 6}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    d = tmp_path_factory.mktemp("tok")
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>").save_pretrained(d)
    return d


def flat(s: str) -> str:
    return " ".join(s.split())


def table_rows(out: str, ncols: int) -> list[list[str]]:
    """The data lines of a rich table printed as text: ``ncols`` cells that are all numbers or '-'."""

    def number(c):
        try:
            float(c)
            return True
        except ValueError:
            return c == "-"

    return [
        cells
        for cells in (line.split() for line in out.splitlines())
        if len(cells) == ncols and all(number(c) for c in cells)
    ]


def coloured(*args) -> Text:
    """``entropylens show ARGS`` on a (forced) truecolor terminal, its output parsed back into styled Text."""
    res = runner.invoke(app, [str(a) for a in args], env=COLOUR_ENV)
    assert res.exit_code == 0, res.output
    assert "\x1b[" in res.stdout
    return Text.from_ansi(res.stdout)


def style_at(text: Text, i: int) -> Style:
    st = Style()
    for span in text.spans:
        if span.start <= i < span.end:
            st += span.style if isinstance(span.style, Style) else Style.parse(span.style)
    return st


def token_style(text: Text, token: str) -> Style:
    plain = text.plain
    assert plain.count(token) == 1, (token, plain)
    return style_at(text, plain.index(token))


def bg(style: Style) -> str | None:
    return None if style.bgcolor is None else style.bgcolor.get_truecolor().hex


# --------------------------------------------------------------------------------------------- the list
def test_list_matches_the_responses_analysis(runs):
    expected = R.responses(connect(runs), "a", 0)
    out = ok("show", runs, "--run", "a", "--step", "0")
    assert "run a · step 0: 2 responses" in out
    rows = table_rows(out, len(show.LIST_COLUMNS))
    assert len(rows) == 2
    for cells, line in zip(rows, expected.to_dict("records")):
        assert cells == [show.fmt(line[c]) for _, c in show.LIST_COLUMNS]
    # by construction (fixture_runs.py): seq 0 holds t0, t1 (t1 clipped, at both updates), seq 1 t2, t3
    # ERC-dropped "-": the fixture has no ERC (not applicable, as in the viewer), not 0
    assert rows[0] == ["0", "0", "0", "0.25", "1", "2", "2", "2", "0.75", "2", "-", "-0.2"]
    assert rows[1] == ["0", "1", "0", "0.75", "-1", "2", "2", "2", "1.5", "2", "-", "0.6"]
    for header in (
        "rank",
        "seq",
        "group",
        "reward",
        "advantage",
        "length",
        "tokens",
        "updates",
        "entropy",
        "clipped",
        "ERC-",
        "dropped",
        "effect",
    ):
        assert header in out


def test_list_defaults_last_step_and_only_run(runs):
    out = ok("show", runs, "--run", "a")  # no --step: the last step
    assert "run a · step 1: 2 responses" in out
    assert [r[1] for r in table_rows(out, len(show.LIST_COLUMNS))] == ["2", "3"]  # run-unique seq ids
    out = ok("show", runs / "b")  # no --run: PATH holds one run
    assert "run b · step 0" in out and len(table_rows(out, len(show.LIST_COLUMNS))) == 2


def test_list_where(runs):
    where = "quadrant = 'PA&LP' AND clipped"
    out = ok("show", runs, "--run", "a", "--step", "0", "--where", where)
    assert f"1 matching --where {where}" in flat(out)
    assert [r[1] for r in table_rows(out, len(show.LIST_COLUMNS))] == ["0"]
    assert R.matching(connect(runs), "a", where, 0) == {(0, 0, 0)}
    out = ok("show", runs, "--run", "a", "--step", "0", "--where", "reward > 0.5 AND entropy > 2")  # t3 at update 1
    assert [r[1] for r in table_rows(out, len(show.LIST_COLUMNS))] == ["1"]
    out = ok("show", runs, "--run", "a", "--step", "0", "--where", "reward > 5")
    assert "0 matching --where reward > 5" in flat(out) and not table_rows(out, len(show.LIST_COLUMNS))


# --------------------------------------------------------------------------------------------- one response
def test_response_without_text(runs):
    out = ok("show", runs, "--run", "a", "--step", "0", "--seq", "0")
    assert "⟨3⟩ ⟨4⟩" in out
    assert flat(HOW_TO_GET_TEXT) in flat(out)
    assert "update 1 (its updates: 0, 1)" in out  # the last update by default
    assert "reward 0.25" in out and "advantage 1" in out and "length 2" in out
    assert "colour: entropy H(pi_theta), nats 0.4" in flat(out) and "1.5 (this response's min .. max)" in flat(out)
    assert "forking: bold underlined: the top 20%" in flat(out) and "(1 of 2;" in out
    # the response across its step's updates: mean ratio (1 + 1.5) / 2, mean entropy ratio (1 + 1.2) / 2 and
    # (0.8 + 1.5) / 2, one clipped token (t1) at each update, no ERC, no sampler log-probs (mismatch '-')
    assert table_rows(out.replace(" (shown)", ""), 7) == [
        ["0", "2", "1.25", "1.1", "1", "0", "-"],
        ["1", "2", "1.25", "1.15", "1", "0", "-"],
    ]
    out0 = ok("show", runs, "--run", "a", "--step", "0", "--seq", "0", "--update", "0")
    assert "update 0 (its updates: 0, 1)" in out0
    assert "0.5" in out0.split("colour:")[1].split("\n")[0]  # update 0: H 0.5 .. 1.2


def test_response_with_tokenizer(runs, tokenizer_dir):
    out = ok("show", runs, "--run", "a", "--step", "0", "--seq", "0", "--tokenizer", tokenizer_dir)
    assert "The cat" in out and "⟨3⟩" not in out
    assert f"text: tokenizer {tokenizer_dir}" in flat(out)
    assert flat(HOW_TO_GET_TEXT) not in flat(out)
    assert "sat down" in ok("show", runs, "--run", "a", "--step", "0", "--seq", "1", "--tokenizer", tokenizer_dir)


def test_tokenizer_that_cannot_load(runs, tmp_path):
    res = runner.invoke(
        app,
        [
            "show",
            str(runs),
            "--run",
            "a",
            "--step",
            "0",
            "--seq",
            "0",
            "--tokenizer",
            str(tmp_path / "no-such-tokenizer"),
        ],
    )
    assert res.exit_code == 0, res.output
    assert "⟨3⟩ ⟨4⟩" in res.stdout and flat(HOW_TO_GET_TEXT) in flat(res.stdout)
    lines = [x for x in res.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("warning: tokenizer ") and "could not be loaded" in lines[0]


def test_response_text_from_run_json_and_gaps(long_run):
    out = ok("show", long_run, "--seq", "7")  # one run: no --run; one step: no --step
    assert "run long (grpo)" in out and "step 3" in out
    assert "w10 w11 w12 w13 w14 … w15 w16" in out  # positions 5, 6 were not recorded
    assert "(10 of 12 positions recorded)" in flat(out)
    assert "text: the run's vocabulary (run.json)" in out
    assert "update 0 (its updates: 0)" in out  # its last update, not the step's
    assert "update 1 (its updates: 0, 1)" in ok("show", long_run, "--seq", "8")
    assert "seq 7 has no token rows at update 1 of step 3; its updates: 0" in err(
        "show", long_run, "--seq", "7", "--update", "1"
    )


def test_forking_marks_and_colours(runs):
    text = coloured("show", runs, "--run", "a", "--step", "0", "--seq", "0")
    # forking: t1 (old entropy 1.0 of 0.5 / 1.0), not t0
    t0, t1 = token_style(text, "⟨3⟩"), token_style(text, "⟨4⟩")
    assert t1.bold and t1.underline
    assert not t0.bold and not t0.underline
    # entropy at update 1: 0.4 (t0, the low end) and 1.5 (t1, the high end)
    assert bg(t0) == show._hex(show.SEQUENTIAL[0]) and bg(t1) == show._hex(show.SEQUENTIAL[-1])
    # the colour follows --color: quadrant PA&HP / PA&LP; ratio 1 (the middle) / 1.5 (the top); null grey
    text = coloured("show", runs, "--run", "a", "--step", "0", "--seq", "0", "--color", "quadrant")
    assert bg(token_style(text, "⟨3⟩")) == show.CATEGORY_COLOURS["quadrant"]["PA&HP"]
    assert bg(token_style(text, "⟨4⟩")) == show.CATEGORY_COLOURS["quadrant"]["PA&LP"]
    assert token_style(text, "⟨4⟩").bold and "PA&HP" in text.plain and "NA&LP" in text.plain  # the legend
    text = coloured("show", runs, "--run", "a", "--step", "0", "--seq", "0", "--color", "ratio")
    assert bg(token_style(text, "⟨3⟩")) == show._hex(show.DIVERGING[2])
    assert bg(token_style(text, "⟨4⟩")) == show._hex(show.DIVERGING[-1])
    assert "log scale, 1 at the middle" in text.plain
    text = coloured("show", runs, "--run", "a", "--step", "0", "--seq", "0", "--color", "entropy_effect_dropped")
    assert bg(token_style(text, "⟨3⟩")) == show.NULL_COLOUR  # t0: gradient unchanged, null
    assert bg(token_style(text, "⟨4⟩")) == show._hex(show.DIVERGING[-1])  # +0.4, the top of -0.4 .. 0.4
    text = coloured("show", runs, "--run", "a", "--step", "0", "--seq", "0", "--color", "clip")
    assert bg(token_style(text, "⟨4⟩")) == show.CATEGORY_COLOURS["clip"]["clipped high"]


def test_recorded_text_without_a_tokenizer(long_run):
    """Without token text (the ⟨id⟩ fallback) the completion's sequences.text is shown where recorded."""
    con = connect(long_run)
    console = Console(record=True, width=100)
    console.print(show.show_response(con, "long", 3, 7, decoder=make_decoder(None)))
    out = console.export_text()
    assert "⟨10⟩ ⟨11⟩" in out and flat(HOW_TO_GET_TEXT) in flat(out)
    assert "recorded text (sequences.text): the recorded completion" in out
    console.print(show.show_response(con, "long", 3, 8, decoder=make_decoder(None)))
    assert "recorded text" not in console.export_text()  # seq 8 has none


def test_forking_on_a_recorded_console(long_run):
    """The library's renderable on a recorded truecolor console: the forking marks are the top 20% by
    sampling entropy (ties at the cut included), the ERC colours the kept / dropped tokens."""
    con = connect(long_run)
    dec = make_decoder([f"w{i}" for i in range(30)])
    for color in ("old_entropy", "erc"):
        console = Console(record=True, force_terminal=True, color_system="truecolor", width=100)
        console.print(show.show_response(con, "long", 3, 7, color=color, decoder=dec))
        text = Text.from_ansi(console.export_text(styles=True))
        styles = [token_style(text, f"w{10 + k} ") for k in range(len(LONG_POS) - 1)] + [token_style(text, "w19")]
        assert {k for k, st in enumerate(styles) if st.bold and st.underline} == LONG_FORKS
        assert R.forking(LONG_H_OLD) == [k in LONG_FORKS for k in range(len(LONG_POS))]
        if color == "erc":
            assert [bg(st) for st in styles] == [
                show.CATEGORY_COLOURS["erc"]["kept" if k else "dropped"] for k in LONG_ERC
            ]
            assert "dropped by ERC (2)" in flat(text.plain)
        else:  # sequential over 0.1 .. 0.9: the lowest at the bottom, the highest at the top
            assert bg(styles[0]) == show._hex(show.SEQUENTIAL[0]) and bg(styles[1]) == show._hex(show.SEQUENTIAL[-1])
            assert "(3 of 10;" in flat(text.plain)


def test_colour_scales():
    by = {m.key: m for m in R.METRICS}
    rows = [{"ratio": 0.5}, {"ratio": 1.0}, {"ratio": 2.0}, {"ratio": None}]
    s = show.Scale(by["ratio"], rows)
    assert [s.position(v) for v in (0.5, 1.0, 2.0)] == [0.0, 0.5, 1.0]  # symmetric in log space around 1
    assert s.colour(3) == show.NULL_COLOUR
    s = show.Scale(by["entropy_effect"], [{"entropy_effect": -0.1}, {"entropy_effect": 0.3}])
    assert s.position(0.0) == 0.5 and s.position(0.3) == 1.0 and math.isclose(s.position(-0.1), 1 / 3)
    s = show.Scale(by["entropy"], [{"entropy": 1.0}, {"entropy": 3.0}, {"entropy": 2.0}])
    assert [s.position(v) for v in (1.0, 2.0, 3.0)] == [0.0, 0.5, 1.0]


# --------------------------------------------------------------------------------------------- errors
@pytest.mark.parametrize(
    "args, says",
    [
        (["--run", "zz"], "runs here: a, b"),
        ([], "2 runs here (a, b): choose one with --run"),
        (["--run", "a", "--step", "9"], "it has token rows at steps 0..1 (2 steps)"),
        (["--run", "a", "--step", "0", "--seq", "8"], "the step has 2 responses"),
        (["--run", "a", "--step", "0", "--seq", "0", "--color", "foo"], "metrics: entropy, old_entropy, prob"),
        (
            ["--run", "a", "--step", "0", "--seq", "0", "--update", "4"],
            "update 4 is not at step 0 of run a; its updates: 0, 1",
        ),
        (["--run", "a", "--step", "1", "--seq", "2", "--rank", "3"], "not rank 3"),
        (["--run", "a", "--step", "0", "--rank", "3"], "its ranks: 0"),
        (["--run", "a", "--where", "nope = 1"], "--where 'nope = 1'"),
        (["--run", "a", "--where", "1 = 1; SELECT 1"], "without ';'"),
        (["--run", "a", "--color", "ratio"], "--color applies to one response: add --seq"),
        (["--run", "a", "--seq", "2", "--where", "clipped"], "leave it out with --seq"),
    ],
)
def test_errors(runs, args, says):
    assert says in err("show", runs, *args)


def test_path_errors(tmp_path):
    assert "does not exist" in err("show", tmp_path / "nope")
    assert "run" in err("show", tmp_path)  # a directory without runs


def test_help_is_true():
    out = flat(ok("show", "--help"))
    for opt in ("--run", "--step", "--seq", "--rank", "--update", "--color", "--where", "--tokenizer"):
        assert opt in out
    for key in R.METRIC_KEYS:
        assert key in out


def test_response_mismatch_column_and_colour(tmp_path):
    """tests/mismatch_runs.py's run m: seq 1 holds t2 (delta -0.05) and t3 (delta +0.3); the per-update table's
    mean |mismatch| = (0.05 + 0.3) / 2 = 0.175 (beside mean ratio (0.5 + 1) / 2, entropy ratio (0.9 + 1) / 2 at
    update 0 and (0.7 + 1.2) / 2 at 1, t2 clipped); the colour by sampler_log_ratio puts them on the two sides."""
    import mismatch_runs

    root = mismatch_runs.build(tmp_path / "runs")
    out = ok("show", root, "--run", "m", "--step", "0", "--seq", "1")
    assert table_rows(out.replace(" (shown)", ""), 7) == [
        ["0", "2", "0.75", "0.95", "1", "0", "0.175"],
        ["1", "2", "0.75", "0.95", "1", "0", "0.175"],
    ]
    text = coloured("show", root, "--run", "m", "--step", "0", "--seq", "1", "--color", "sampler_log_ratio")
    assert "mismatch log pi_old - log pi_sampler" in text.plain
    assert bg(token_style(text, "⟨5⟩")) != bg(token_style(text, "⟨6⟩"))
