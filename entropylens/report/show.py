"""`entropylens show`: the token viewer in a terminal (rich renderables; the CLI prints them).

- :func:`list_step`: one step's recorded responses, one line each (the ``responses`` analysis:
  entropylens/report/responses.py), optionally only those with a token matching a SQL ``where``.
- :func:`show_response`: one response at one update, each token's text on a background colour from a
  metric of :data:`entropylens.report.responses.METRICS`, the forking tokens (top 20% by sampling entropy) bold
  and underlined, a legend, a header, and the response across its step's updates.

Colour scales (over the shown response's own values at the shown update): "sequential" low -> high;
"diverging" symmetric around the metric's centre (0); "log" (ratios) symmetric around 1 on a log axis;
"categorical" a fixed colour per category (:func:`entropylens.report.responses.category`). A null value is grey.
Nothing here prints; the errors a user can cause are one-line :class:`~entropylens.read.query.QueryError`.
"""

from __future__ import annotations

import math

from ..read.query import QueryError, run_sql
from ..read.views import sql_str
from . import responses as R
from .escape import terminal as _t  # every name / text a user gave, as printed: no raw control or bidi character
from .escape import token
from .palette import QUADRANT_COLORS

NULL_COLOUR = "#808080"  # a token without a value for the metric
# low -> high (viridis' stops); diverging: blue (below the centre) -> near white -> red (above)
SEQUENTIAL = ((68, 1, 84), (59, 82, 139), (33, 145, 140), (94, 201, 98), (253, 231, 37))
DIVERGING = ((33, 102, 172), (103, 169, 207), (247, 247, 247), (239, 138, 98), (178, 24, 43))
CATEGORY_COLOURS: dict[str, dict] = {
    "quadrant": dict(QUADRANT_COLORS),  # the report's one quadrant palette (palette.py), as in every figure
    "clip": {
        "kept": "#e0e0e0",
        "low": "#9ecae1",
        "high": "#fdd0a2",
        "clipped low": "#2171b5",
        "clipped high": "#d94801",
    },
    "erc": {"kept": "#a1d99b", "dropped": "#de2d26", None: NULL_COLOUR},
}
LEGEND_STEPS = 9  # swatches in a continuous legend
FORK_STYLE = "bold underline"


# ------------------------------------------------------------------------------------- values
def _num(v) -> float | None:
    """A cell as a float; None for null / NaN (inf stays)."""
    if v is None:
        return None
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return None if f != f else f


_INTS = {"pos", "token_id", "clip"}
_BOOLS = {"clipped", "erc_kept", "dual_clipped", "token_kept", "seq_kept"}


def _cell(col: str, v):
    """One token cell as plain Python (what responses.category reads): None for null / NaN, bool, int,
    the quadrant's name, else a float."""
    import pandas as pd

    if v is None or (not isinstance(v, str) and pd.isna(v)):
        return None
    if col == "quadrant":
        return str(v)
    if col in _BOOLS:
        return bool(v)
    if col in _INTS:
        return int(v)
    return float(v)


def fmt(v, digits: int = 4) -> str:
    """Compact: whole numbers as integers, others to ``digits`` significant digits, '-' for null."""
    f = _num(v)
    if f is None:
        return "-"
    if math.isinf(f):
        return "inf" if f > 0 else "-inf"
    if f.is_integer() and abs(f) < 1e15:
        return str(int(f))
    return f"{f:.{digits}g}"


def metric_for(color: str) -> R.Metric:
    for m in R.METRICS:
        if m.key == color:
            return m
    raise QueryError(f"unknown --color {color!r}; metrics: {', '.join(R.METRIC_KEYS)}")


# ------------------------------------------------------------------------------------- checks
def runs_of(con) -> list[str]:
    return [str(r) for r in run_sql(con, "SELECT run FROM runs ORDER BY run")["run"]]


def pick_run(con, run: str | None = None) -> str:
    """``run``, checked against the runs on ``con``; None: the only run there."""
    names = runs_of(con)
    if run is None:
        if len(names) == 1:
            return names[0]
        if not names:
            raise QueryError("no run here")
        raise QueryError(f"{len(names)} runs here ({', '.join(map(_t, names))}): choose one with --run")
    if run not in names:
        raise QueryError(f"unknown run {run!r}; runs here: {', '.join(map(_t, names)) or 'none'}")
    return run


def steps_of(con, run: str) -> list[int]:
    """The steps of ``run`` with token rows, ascending."""
    df = run_sql(con, f"SELECT DISTINCT step FROM tokens WHERE run = {sql_str(run)} ORDER BY step")
    return [int(s) for s in df["step"]]


def _has_tokens(con, run: str, step: int) -> bool:
    df = run_sql(con, f"SELECT 1 AS x FROM tokens WHERE run = {sql_str(run)} AND step = {int(step)} LIMIT 1")
    return len(df) > 0


def _steps_line(con, run: str) -> str:
    steps = steps_of(con, run)
    if not steps:
        return "it has no token rows at all"
    if len(steps) == 1:
        return f"it has token rows at step {steps[0]} only"
    return f"it has token rows at steps {steps[0]}..{steps[-1]} ({len(steps)} steps)"


def pick_step(con, run: str, step: int | None = None) -> int:
    """``step`` if ``run`` has token rows there; None: the run's last step with token rows."""
    if step is not None:
        if not _has_tokens(con, run, step):
            raise QueryError(f"run {_t(run)} has no token rows at step {int(step)}; {_steps_line(con, run)}")
        return int(step)
    last = run_sql(con, f"SELECT max(step) AS s FROM steps WHERE run = {sql_str(run)}")["s"]
    s = _num(last.iloc[0]) if len(last) else None
    if s is not None and _has_tokens(con, run, int(s)):
        return int(s)
    steps = steps_of(con, run)  # the last steps recorded no token rows (sampling, a run still writing)
    if not steps:
        raise QueryError(f"run {_t(run)} has no token rows")
    return steps[-1]


# ------------------------------------------------------------------------------------- the list
LIST_COLUMNS = (  # (header, responses analysis column)
    ("rank", "rank"),
    ("seq", "seq"),
    ("group", "group"),
    ("reward", "reward"),
    ("advantage", "advantage"),
    ("length", "length"),
    ("tokens", "tokens"),
    ("updates", "updates"),
    ("mean\nentropy", "mean_entropy"),
    ("clipped", "clipped"),
    ("ERC-\ndropped", "erc_dropped"),
    ("entropy\neffect", "entropy_effect"),
)


def list_step(con, run: str | None, step: int | None, *, where: str | None = None, rank: int | None = None):
    """A rich Table of the step's responses (one line each, the columns of :data:`LIST_COLUMNS`); run None:
    the only run; step None: the run's last step with token rows; ``where``: only the responses with a
    token row where it holds (:func:`entropylens.report.responses.matching`); ``rank``: only that rank's."""
    from rich import box
    from rich.table import Table
    from rich.text import Text

    run = pick_run(con, run)
    step = pick_step(con, run, step)
    df = R.responses(con, run, step)
    total = len(df)
    if rank is not None:
        if int(rank) not in set(int(r) for r in df["rank"]):
            ranks = ", ".join(str(r) for r in sorted(set(int(r) for r in df["rank"])))
            raise QueryError(f"no response of rank {int(rank)} at step {step} of run {_t(run)}; its ranks: {ranks}")
        df = df[df["rank"] == int(rank)]
    title = f"run {_t(run)} · step {step}: {total} response{'s' if total != 1 else ''}"
    if rank is not None:
        title += f", {len(df)} of rank {int(rank)}"
    if where:
        keep = R.matching(con, run, where, step)
        df = df[[(step, int(r), int(q)) in keep for r, q in zip(df["rank"], df["seq"])]]
        title += f"; {len(df)} matching --where {_t(where)}"
    # the title as a Text: a run id's "[red]" is not read as rich markup
    table = Table(
        title=Text(title),
        title_justify="left",
        box=box.SIMPLE_HEAD,
        header_style="bold",
        pad_edge=False,
        caption=(
            "rank: the training process that recorded the response (seq counts within it, --rank picks "
            "one); mean entropy: sampling entropy H(pi_old) over the tokens, nats; clipped / ERC-dropped: "
            "token rows whose gradient PPO-clip / ERC removed, over the step's updates; entropy "
            "effect: summed over them. One response: --seq SEQ"
        ),
        caption_justify="left",
    )
    for header, _ in LIST_COLUMNS:
        table.add_column(header, justify="right", no_wrap=True)
    for line in df.to_dict("records"):
        table.add_row(*(fmt(line[c]) for _, c in LIST_COLUMNS))
    return table


# ------------------------------------------------------------------------------------- colours
def _hex(rgb) -> str:
    return "#{:02x}{:02x}{:02x}".format(*(max(0, min(255, round(c))) for c in rgb))


def _ramp(stops, t: float) -> str:
    """The colour at ``t`` in [0, 1] along ``stops`` (linear in RGB)."""
    t = min(1.0, max(0.0, t))
    x = t * (len(stops) - 1)
    i = min(int(x), len(stops) - 2)
    f = x - i
    return _hex(tuple(a + (b - a) * f for a, b in zip(stops[i], stops[i + 1])))


def _text_colour(bg: str) -> str:
    """Black or white, whichever reads on ``bg``."""
    r, g, b = (int(bg[k : k + 2], 16) / 255 for k in (1, 3, 5))
    return "black" if 0.299 * r + 0.587 * g + 0.114 * b > 0.55 else "white"


class Scale:
    """A metric's colour for each token row of one response (``rows``: dicts of TOKEN_COLUMNS)."""

    def __init__(self, metric: R.Metric, rows: list[dict]):
        self.metric = metric
        self.values = [self._value(r) for r in rows]
        if metric.scale == "categorical":
            self.colours = CATEGORY_COLOURS[metric.key]
            return
        vals = [v for v in self.values if v is not None]
        finite = [v for v in vals if math.isfinite(v)]
        self.lo = min(finite) if finite else None
        self.hi = max(finite) if finite else None
        self.half: float | None  # every scale but sequential: the span around the middle
        if metric.scale == "sequential":
            self.half = None
        elif metric.scale == "log":
            logs = [abs(math.log(v)) for v in finite if v > 0]
            # the scale spans 1/e^half .. e^half, at least 1/1.01 .. 1.01 (the page's floor): on-policy noise
            # (r = 1 to float32 rounding at a step's first update) is not coloured as a signal
            self.half = max(logs + [math.log(R.LOG_SCALE_FLOOR)])
        else:
            self.half = max((abs(v - metric.center) for v in finite), default=0.0)

    def _value(self, row: dict):
        if self.metric.scale == "categorical":
            return R.category(self.metric.key, row)
        v = _num(row.get(self.metric.key))
        if v is not None and self.metric.scale == "log" and v <= 0:
            return None  # no place on a log axis
        return v

    def position(self, v: float) -> float:
        """Where ``v`` sits on the scale, 0..1."""
        m = self.metric
        if m.scale == "sequential":
            if math.isinf(v):
                return 1.0 if v > 0 else 0.0
            lo, hi = self.lo, self.hi
            assert lo is not None and hi is not None  # v is finite (values hold no NaN), so finite ones exist
            return 0.5 if hi == lo else (v - lo) / (hi - lo)
        half = self.half
        assert half is not None  # set for every scale but sequential
        x = math.log(v) if m.scale == "log" else v - m.center
        if math.isinf(x):
            return 1.0 if x > 0 else 0.0
        return 0.5 if half == 0 else 0.5 + x / (2 * half)

    def colour_of(self, v) -> str:
        if self.metric.scale == "categorical":
            return self.colours.get(v, NULL_COLOUR)
        if v is None:
            return NULL_COLOUR
        return _ramp(SEQUENTIAL if self.metric.scale == "sequential" else DIVERGING, self.position(v))

    def colour(self, i: int) -> str:
        return self.colour_of(self.values[i])

    def legend(self):
        from rich.text import Text

        m = self.metric
        out = Text.assemble(("colour: ", "dim"), (m.label, "bold"))
        out.append("  ")
        if m.scale == "categorical":
            counts: dict = {}
            for v in self.values:
                counts[v] = counts.get(v, 0) + 1
            for value, label in m.categories:
                bg = self.colours.get(value, NULL_COLOUR)
                name = "none" if value is None else str(value)
                out.append(f" {name} ", style=f"{_text_colour(bg)} on {bg}")
                what = label.removeprefix(f"{name}: ") if label != name else ""
                out.append(f" {what + ' ' if what else ''}({counts.get(value, 0)})  ")
            return out
        if self.lo is None:
            out.append(" null ", style=f"{_text_colour(NULL_COLOUR)} on {NULL_COLOUR}")
            out.append(" no value in this response")
            return out
        half = self.half  # None exactly for sequential
        if m.scale == "sequential" or half is None:
            ends = (fmt(self.lo, 3), fmt(self.hi, 3))
        elif m.scale == "log":
            ends = (fmt(math.exp(-half), 3), fmt(math.exp(half), 3))
        else:
            ends = (fmt(m.center - half, 3), fmt(m.center + half, 3))
        out.append(ends[0] + " ")
        stops = SEQUENTIAL if m.scale == "sequential" else DIVERGING
        for k in range(LEGEND_STEPS):
            out.append("  ", style=f"on {_ramp(stops, k / (LEGEND_STEPS - 1))}")
        out.append(" " + ends[1])
        if m.scale == "log":
            out.append(f"  (log scale, 1 at the middle; this response: {fmt(self.lo, 3)} .. {fmt(self.hi, 3)})")
        elif m.scale == "diverging":
            out.append(f"  ({fmt(m.center)} at the middle; this response: {fmt(self.lo, 3)} .. {fmt(self.hi, 3)})")
        else:
            out.append("  (this response's min .. max)")
        if any(v is None for v in self.values):
            out.append("  ")
            out.append(" null ", style=f"{_text_colour(NULL_COLOUR)} on {NULL_COLOUR}")
        return out


# ------------------------------------------------------------------------------------- one response
def _shown(s: str, token_id: int) -> str:
    """A token's text as printed: a newline as ↵ and a line break, a tab as itself, every other control,
    format (bidi included) or separator character as its code, a token of default-ignorable characters only
    as their codes (entropylens/report/escape.py: token), an empty text as its id."""
    if s == "":
        return f"⟨{token_id}⟩"
    return token(s, keep="\n\t").replace("\n", "↵\n")


def _separator(decoder) -> str:
    """What joins two tokens: the decoder's own (nothing for a tokenizer, whose tokens carry their spaces;
    a space for a word-level vocabulary and the ⟨id⟩ fallback)."""
    return getattr(decoder, "separator", " ")


def _per_update(df, shown: int):
    from rich import box
    from rich.table import Table

    table = Table(
        title="this response across the step's updates",
        title_justify="left",
        box=box.SIMPLE_HEAD,
        header_style="bold",
        pad_edge=False,
    )
    for name in ("update", "tokens", "mean ratio", "mean entropy ratio", "clipped", "ERC-dropped", "mean |mismatch|"):
        table.add_column(name, justify="right", no_wrap=True)
    for u in sorted(int(x) for x in df["update"].unique()):
        part = df[df["update"] == u]
        erc = part["erc_kept"]
        dropped = int((erc.notna() & (erc == False)).sum())  # noqa: E712 - a nullable boolean column
        table.add_row(
            f"{u} (shown)" if u == shown else str(u),
            str(len(part)),
            fmt(part["ratio"].astype(float).mean()),
            fmt(part["entropy_ratio"].astype(float).mean()),
            str(int(part["clipped"].fillna(False).astype(bool).sum())),
            str(dropped),
            fmt(part["sampler_log_ratio"].astype(float).abs().mean()),  # NULL without a sampler
            style="bold" if u == shown else None,
        )
    return table


def show_response(
    con,
    run: str | None,
    step: int | None,
    seq: int,
    *,
    rank: int | None = None,
    update: int | None = None,
    color: str = "entropy",
    decoder=None,
):
    """One response (run, step, seq; ``rank`` where several ranks recorded that seq at the step) at
    ``update`` (None: the last of the step's updates with rows for it) as a rich Group: the header, its
    tokens coloured by ``color`` (a key of METRICS) with the forking tokens marked, the legend, and the
    response across the step's updates. ``decoder``: a token_text Decoder (None: ids as ⟨id⟩)."""
    from rich.console import Group
    from rich.style import Style
    from rich.text import Text

    from ..token_text import HOW_TO_GET_TEXT, Decoder

    metric = metric_for(color)
    decoder = decoder if decoder is not None else Decoder()
    run = pick_run(con, run)
    step = pick_step(con, run, step)
    seq = int(seq)
    table = R.responses(con, run, step)
    here = table[table["seq"] == seq]
    if here.empty:
        seqs = sorted(int(q) for q in table["seq"])
        span = f"seq {seqs[0]}..{seqs[-1]}" if seqs else "none"
        raise QueryError(
            f"no response seq {seq} at step {step} of run {_t(run)}; the step has {len(table)} "
            f"response{'s' if len(table) != 1 else ''} ({span}; list them without --seq)"
        )
    ranks = sorted(int(r) for r in here["rank"])
    if rank is None:
        if len(ranks) > 1:
            raise QueryError(
                f"seq {seq} at step {step} was recorded by ranks {', '.join(map(str, ranks))}: choose one with --rank"
            )
        rank = ranks[0]
    elif int(rank) not in ranks:
        raise QueryError(
            f"seq {seq} at step {step} of run {_t(run)} is recorded by rank{'s' if len(ranks) > 1 else ''} "
            f"{', '.join(map(str, ranks))}, not rank {int(rank)}"
        )
    rank = int(rank)
    line = here[here["rank"] == rank].iloc[0].to_dict()
    rows = R.token_rows(con, run, step, [(rank, seq)])
    mine = sorted(int(u) for u in rows["update"].unique())
    if update is None:
        update = mine[-1]
    elif int(update) not in mine:
        at_step = [
            int(u)
            for u in run_sql(
                con,
                f'SELECT DISTINCT "update" AS u FROM tokens WHERE run = {sql_str(run)} AND step = {step} ORDER BY u',
            )["u"]
        ]
        if int(update) not in at_step:
            raise QueryError(
                f"update {int(update)} is not at step {step} of run {_t(run)}; its updates: "
                f"{', '.join(map(str, at_step))}"
            )
        raise QueryError(
            f"seq {seq} has no token rows at update {int(update)} of step {step}; its updates: "
            f"{', '.join(map(str, mine))}"
        )
    update = int(update)
    part = rows[rows["update"] == update]
    cells = [
        {c: _cell(c, v) for c, v in zip(R.TOKEN_COLUMNS, r)}
        for r in part[list(R.TOKEN_COLUMNS)].itertuples(index=False, name=None)
    ]
    ids = [int(c["token_id"]) for c in cells]
    pos = [int(c["pos"]) for c in cells]
    strings = decoder.tokens(ids) if decoder.has_text else [f"⟨{i}⟩" for i in ids]
    forks = R.forking([_num(c["old_entropy"]) if _num(c["old_entropy"]) is not None else float("nan") for c in cells])
    scale = Scale(metric, cells)
    sep = _separator(decoder)

    methods = run_sql(con, f"SELECT method FROM runs WHERE run = {sql_str(run)}")["method"]
    method = methods.iloc[0] if len(methods) and isinstance(methods.iloc[0], str) else None
    head = Text.assemble(
        ("run ", "dim"),
        (_t(run), "bold"),
        (f" ({_t(method)})" if method else ""),
        ("  step ", "dim"),
        (str(step), "bold"),
        ("  update ", "dim"),
        (str(update), "bold"),
        (f" (its updates: {', '.join(map(str, mine))})", "dim"),
        ("  rank ", "dim"),
        str(rank),
        ("  seq ", "dim"),
        (str(seq), "bold"),
        ("  group ", "dim"),
        fmt(line.get("group")),
        ("  reward ", "dim"),
        fmt(line.get("reward")),
        ("  advantage ", "dim"),
        fmt(line.get("advantage")),
        ("  length ", "dim"),
        fmt(line.get("length")),
    )
    n_len = _num(line.get("length"))
    if n_len is not None and len(cells) < n_len:
        head.append(f"  ({len(cells)} of {int(n_len)} positions recorded)", style="dim")
    source = (
        Text("text: " + _t(decoder.source), style="dim")
        if decoder.has_text
        else Text("no token text: " + HOW_TO_GET_TEXT, style="yellow")
    )
    if not decoder.has_text:  # the completion's text where the run recorded it (sequences.text)
        recorded = R.texts(con, run, here[here["rank"] == rank]).get((step, rank, seq))
        if recorded:
            source.append("\n")
            source.append("recorded text (sequences.text): ", style="dim")
            source.append(_t(recorded, keep="\n\t"))

    body = Text(overflow="fold")
    for k, (s, i) in enumerate(zip(strings, ids)):
        if k:
            if pos[k] != pos[k - 1] + 1:
                body.append(" … ", style="dim")
            elif sep:
                body.append(sep)
        bg = scale.colour(k)
        style = Style.parse(f"{_text_colour(bg)} on {bg}" + (f" {FORK_STYLE}" if forks[k] else ""))
        body.append(_shown(s, i), style=style)

    fork_note = Text.assemble(
        ("forking", FORK_STYLE),
        (
            f": bold underlined: the top {R.FORKING_SHARE:.0%} of this response's tokens by "
            f"sampling entropy H(pi_old) ({sum(forks)} of {len(forks)}; Wang et al. 2025)",
            "dim",
        ),
    )
    return Group(head, source, Text(""), body, Text(""), scale.legend(), fork_note, Text(""), _per_update(rows, update))
