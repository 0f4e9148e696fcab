"""The token viewer's data: which responses to show, and each one's tokens at every update of its step.

A *response* is a sequence's token rows at one step (``analyses/responses.sql``: one line per run, step,
rank and sequence, with its reward, advantage, length, entropy, clipped and ERC-dropped token rows and
entropy effect). The report's responses pages (entropylens/report/viewer.py) and ``entropylens show``
(entropylens/report/show.py) read them through this module; nothing here draws.

Selection (:func:`select`): the candidates are a run's responses, or those with at least one token row
matching a SQL ``where`` on the tokens (plus the response's ``reward`` and ``length``); from steps spread
over the run (the last and the first, then the middle, the quarters, ...: :func:`step_order`), each step gives its most telling responses, one
per rule of :data:`RULES` in turn (highest reward, lowest reward, most clipped, largest |entropy
effect|, most ERC-dropped, highest mean entropy), until ``n`` responses are chosen. The page's size is
then held under ``max_bytes`` (the embedded JSON, measured): the later rules' picks go first, then
those of the later-visited steps.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..read.query import QueryError, render_analysis, run_sql
from ..read.views import sql_str

if TYPE_CHECKING:
    import pandas as pd

# Per-token columns a viewer shows, in the order of each embedded row. "pos" first.
TOKEN_COLUMNS: tuple[str, ...] = (
    "pos",
    "token_id",
    "prob",
    "logprob",
    "old_logprob",
    "ratio",
    "advantage",
    "quadrant",
    "clip",
    "clipped",
    "entropy",
    "old_entropy",
    "entropy_ratio",
    "erc_kept",
    "dual_clipped",
    "token_kept",
    "seq_kept",
    "is_weight",
    "grad_coef",
    "logit_grad_norm",
    "entropy_effect",
    "entropy_effect_dropped",
    "sampler_logprob",
    "sampler_log_ratio",
    "is_masked",
)
_INT_COLUMNS = {"pos", "token_id", "clip"}
_BOOL_COLUMNS = {"clipped", "erc_kept", "dual_clipped", "token_kept", "seq_kept", "is_masked"}
_NA: object
try:
    from pandas import NA as _PANDAS_NA

    _NA = _PANDAS_NA
except ImportError:  # pragma: no cover
    _NA = object()


@dataclass(frozen=True)
class Metric:
    """A colouring of the tokens: ``scale`` is "sequential" (low -> high), "diverging" (around
    ``center``), "log" (a ratio: around 1 on a log axis) or "categorical" (``categories``: value -> label)."""

    key: str
    label: str
    scale: str
    center: float = 0.0
    categories: tuple[tuple[object, str], ...] = ()


METRICS: tuple[Metric, ...] = (
    Metric("entropy", "entropy H(pi_theta), nats", "sequential"),
    Metric("old_entropy", "sampling entropy H(pi_old), nats", "sequential"),
    Metric("prob", "sampling probability p", "sequential"),
    Metric("ratio", "importance ratio r = pi_theta / pi_old", "log", 1.0),
    Metric("entropy_ratio", "entropy ratio H(pi_theta) / H(pi_old)", "log", 1.0),
    Metric(
        "quadrant",
        "quadrant (advantage sign x probability)",
        "categorical",
        categories=(
            ("PA&HP", "PA&HP"),
            ("PA&LP", "PA&LP"),
            ("NA&HP", "NA&HP"),
            ("NA&LP", "NA&LP"),
            ("ZA", "ZA: advantage 0"),
        ),
    ),
    Metric(
        "clip",
        "clip status",
        "categorical",
        categories=(
            ("kept", "inside the clip range"),
            ("low", "r < 1 - eps_low, kept (A > 0)"),
            ("high", "r > 1 + eps_high, kept (A < 0)"),
            ("clipped low", "clipped, low side"),
            ("clipped high", "clipped, high side"),
        ),
    ),
    Metric(
        "erc",
        "ERC decision",
        "categorical",
        categories=(("kept", "kept (rho inside the band)"), ("dropped", "dropped by ERC"), (None, "no ERC")),
    ),
    Metric("logit_grad_norm", "logit-gradient norm ||dLoss/dz||", "sequential"),
    Metric("grad_coef", "dLoss/dlogp (grad_coef)", "diverging", 0.0),
    Metric("entropy_effect", "entropy effect g s / T^2", "diverging", 0.0),
    Metric("entropy_effect_dropped", "entropy effect taken away", "diverging", 0.0),
    Metric("sampler_log_ratio", "mismatch log pi_old - log pi_sampler", "diverging", 0.0),
)
METRIC_KEYS: tuple[str, ...] = tuple(m.key for m in METRICS)

# (rule label, summary column, descending); a rule whose column is null or 0 for every candidate of the
# step picks nothing there
RULES: tuple[tuple[str, str, bool], ...] = (
    ("highest reward", "reward", True),
    ("lowest reward", "reward", False),
    ("most clipped", "clipped", True),
    ("largest |entropy effect|", "abs_entropy_effect", True),
    ("most ERC-dropped", "erc_dropped", True),
    ("highest mean entropy", "mean_entropy", True),
)
SUMMARY_COLUMNS: tuple[str, ...] = (
    "reward",
    "advantage",
    "length",
    "tokens",
    "updates",
    "mean_entropy",
    "max_entropy",
    "clipped",
    "erc_dropped",
    "entropy_effect",
    "entropy_effect_dropped",
)
DEFAULT_N = 40  # responses per run
DEFAULT_MAX_BYTES = 4_000_000  # the embedded data of one run's page
LOG_SCALE_FLOOR = 1.01  # a ratio scale spans at least 1/1.01 .. 1.01 (viewer.js: LOG_FLOOR; show.py)
PAGE_DATA_OVERHEAD = 20_000  # bytes of a page's data besides its responses (metrics, texts, per-step lists)
FORKING_SHARE = 0.2  # "forking" tokens: the top 20% of a response by sampling entropy (Wang et al. 2025)


def responses(con, run: str | None = None, step: int | None = None, steps=None):
    """``analyses/responses.sql`` on ``con``, restricted to one run and step (or ``steps``, a list) where
    given (a DataFrame). The restriction filters the analysis's lines (the same lines as the whole table's
    there); a step filter lets DuckDB read only the row groups of those steps."""
    conds = []
    if run is not None:
        conds.append(f"run = {sql_str(run)}")
    if step is not None:
        conds.append(f"step = {int(step)}")
    if steps is not None:
        conds.append(f"step IN ({', '.join(str(int(s)) for s in steps)})" if len(steps) else "false")
    where = f" WHERE {' AND '.join(conds)}" if conds else ""
    df = run_sql(con, f"SELECT * FROM ({render_analysis('responses')}) AS r{where} ORDER BY run, step, rank, seq")
    df["abs_entropy_effect"] = df["entropy_effect"].abs()
    return df


def check_where(where: str) -> str:
    """``where`` as one SQL predicate (no statement separator, no comment that could hide the rest): or a
    QueryError naming the problem."""
    w = (where or "").strip()
    if not w:
        raise QueryError("--where: the condition is empty")
    if ";" in w or "--" in w or "/*" in w:
        raise QueryError(f"--where {where!r}: one condition, without ';' or comments")
    depth = 0
    for ch in w:
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if depth < 0:
            break
    if depth != 0:
        raise QueryError(f"--where {where!r}: unbalanced parentheses")
    return w


def matching(con, run: str, where: str, step: int | None = None) -> set[tuple[int, int, int]]:
    """(step, rank, seq) of the run's responses with at least one token row where ``where`` holds: a
    predicate over the tokens view's columns and the response's ``reward`` and ``length``."""
    import duckdb

    w = check_where(where)
    at = f" AND t.step = {int(step)}" if step is not None else ""
    sql = (
        f"SELECT DISTINCT t.step, t.rank, t.seq FROM (SELECT t.*, r.reward, r.length FROM tokens AS t "
        f"JOIN ({render_analysis('responses')}) AS r ON r.run = t.run AND r.step = t.step AND r.rank = t.rank "
        f"AND r.seq = t.seq) AS t WHERE t.run = {sql_str(run)}{at} AND ({w})"
    )
    try:
        if len(duckdb.extract_statements(sql)) != 1:
            raise QueryError(f"--where {where!r}: one condition, not a statement")
    except duckdb.Error as e:
        raise QueryError(f"--where {where!r}: {str(e).splitlines()[0]}") from None
    try:
        df = run_sql(con, sql)
    except QueryError as e:
        raise QueryError(f"--where {where!r}: {str(e).removeprefix('SQL error: ')}") from None
    return {(int(a), int(b), int(c)) for a, b, c in df.itertuples(index=False)}


@dataclass
class Selection:
    """The responses chosen for one run: ``rows`` (the responses analysis's lines, plus ``why``: the
    rules that chose each) and what the choice was (``text`` says it in one sentence)."""

    run: str
    rows: pd.DataFrame
    candidates: int
    steps_with_candidates: int
    n: int
    where: str | None
    max_bytes: int
    dropped_for_size: int = 0  # chosen, then left out by page_data to keep the page under max_bytes
    data_bytes: int = 0  # the page data's size (page_data)

    @property
    def text(self) -> str:
        if not self.candidates:
            return f"No response matches --where {self.where}." if self.where else "No responses recorded."
        steps = self.rows["step"].nunique() if len(self.rows) else 0
        what = f"{len(self.rows)} of {self.candidates} responses at {steps} step{'s' if steps != 1 else ''}"
        if self.where:
            what += f" (those matching --where {self.where})"
        rules = ", ".join(r for r, _, _ in RULES)
        text = (
            f"{what}, chosen at steps spread over the run, one per rule in turn: {rules} "
            f"(entropylens report --responses N --where SQL)."
        )
        if self.dropped_for_size:
            text += (
                f" {self.dropped_for_size} more were left out to keep the page's data under "
                f"{self.max_bytes / 1e6:.1f} MB."
            )
        return text


def step_order(steps: list[int]) -> list[int]:
    """The sorted ``steps`` in the order a selection visits them: the last and the first, then the middle,
    then the quarters, ... (each pass halves the spacing), so any prefix is spread over the run."""
    n = len(steps)
    order: list[int] = []
    seen: set[int] = set()
    k = 2
    while len(order) < n:
        for i in sorted({round(j * (n - 1) / (k - 1)) for j in range(k)} if n > 1 else {0}, reverse=k == 2):
            if i not in seen:
                seen.add(i)
                order.append(i)
        k = 2 * k - 1
    return [steps[i] for i in order]


def _pick_step(df, budget: int) -> list[tuple[int, list[str]]]:
    """Indexes of ``df`` (one step's candidates) chosen by the rules in turn, up to ``budget``; each with
    the rules that pointed at it."""
    chosen: dict[int, list[str]] = {}
    order: list[int] = []
    for label, col, desc in RULES:
        if len(order) >= budget:
            break
        vals = df[col]
        if vals.isna().all() or (col in ("clipped", "erc_dropped", "abs_entropy_effect") and not (vals > 0).any()):
            continue
        ranked = vals.dropna().sort_values(ascending=not desc, kind="stable").index
        for i in ranked:
            if i in chosen:
                continue
            chosen[i] = [label]
            order.append(i)
            break
        top = ranked[0]
        if top in chosen and label not in chosen[top]:
            chosen[top].append(label)
    return [(i, chosen[i]) for i in order]


def response_counts(con, run: str | None = None) -> dict[str, dict[int, int]]:
    """{run: {step: responses}}: how many lines the responses analysis has per run and step (its distinct
    (step, rank, seq) of token rows), without computing them: one pass over four key columns. A line per
    key only while no sequences row is there twice (see :func:`select`)."""
    at = f" WHERE run = {sql_str(run)}" if run is not None else ""
    # rank * 2^33 + seq is one BIGINT per (rank, seq) pair (a NULL as a value outside each one's range)
    key = "coalesce(CAST(rank AS BIGINT), 65536) * 8589934592 + coalesce(CAST(seq AS BIGINT), 2147483648)"
    df = run_sql(con, f"SELECT run, step, count(DISTINCT {key}) AS n FROM tokens{at} GROUP BY run, step")
    out: dict[str, dict[int, int]] = {}
    for r, s, k in df.itertuples(index=False):
        out.setdefault(str(r), {})[int(s)] = int(k)
    return out


def _sequences_repeated(con, run: str) -> bool:
    """Whether a sequences row of ``run`` is there twice (same step, rank, seq): the responses analysis then
    has a line per copy (its join), which :func:`response_counts` does not count."""
    sql = (
        f"SELECT count(*) AS n FROM (SELECT step FROM sequences WHERE run = {sql_str(run)} "
        "GROUP BY step, rank, seq HAVING count(*) > 1) AS d"
    )
    return int(run_sql(con, sql)["n"].iloc[0]) > 0


def select(
    con,
    run: str,
    *,
    n: int = DEFAULT_N,
    where: str | None = None,
    max_bytes: int = DEFAULT_MAX_BYTES,
    table=None,
    counts: dict[int, int] | None = None,
) -> Selection:
    """The responses of ``run`` a page embeds (see the module's docstring); ``max_bytes`` is applied by
    :func:`page_data`. ``table``: the run's responses analysis if already computed. Without ``table`` and
    ``where`` only the steps the selection visits are read (a few batches of steps in :func:`step_order`'s
    order; the same choice as from the whole table): the number of candidates and the steps come from
    :func:`response_counts` (``counts``: the run's {step: responses} from it, if already computed)."""
    import pandas as pd

    if n < 1:
        raise QueryError(f"--responses {n}: at least 1")
    lazy = table is None and where is None and not _sequences_repeated(con, run)
    if lazy:
        per = response_counts(con, run).get(run, {}) if counts is None else counts
        steps = sorted(per)
        candidates = sum(per.values())
        lazy = candidates > 0  # nothing recorded: the (empty) table says so as before
    if lazy:
        df = None
    else:
        df = responses(con, run) if table is None else table
        if where is not None:
            keep = matching(con, run, where)
            mask = [(int(s), int(r), int(q)) in keep for s, r, q in zip(df["step"], df["rank"], df["seq"])]
            df = df[mask]
        df = df.reset_index(drop=True)
        steps = sorted(int(s) for s in df["step"].unique())
        candidates = len(df)
        if df.empty:
            return Selection(run, df.iloc[0:0].assign(why=[]), 0, len(steps), n, where, max_bytes)
    per_step = min(len(RULES), n)
    visit = step_order(steps)
    read: set[int] = set()
    batch = -(-n // per_step) + 1  # steps read at a time: enough when every step gives per_step responses
    chosen: list[tuple[int, list[str], int]] = []  # (index, why, rule rank)
    for j, s in enumerate(visit):
        if len(chosen) >= n:
            break
        if lazy and s not in read:
            more = visit[j : j + batch]
            got = responses(con, run, steps=more)
            df = got if df is None else pd.concat([df, got], ignore_index=True)
            read.update(more)
            batch *= 2
        assert df is not None
        part = df[df["step"] == s]
        chosen += [(i, why, k) for k, (i, why) in enumerate(_pick_step(part, min(per_step, n - len(chosen))))]
    assert df is not None
    order = {s: k for k, s in enumerate(visit)}
    kept = {i: (why, k) for i, why, k in chosen}
    rows = df.loc[sorted(kept)].copy()
    rows["why"] = [kept[i][0] for i in rows.index]
    # which go first when the page is over its size bound: the later rules' picks, then the later-visited steps'
    rows["priority"] = [kept[i][1] * len(steps) + order[int(rows.at[i, "step"])] for i in rows.index]
    sel = Selection(run, df.iloc[0:0].assign(why=[]), candidates, len(steps), n, where, max_bytes)
    sel.rows = rows.sort_values(["step", "rank", "seq"]).reset_index(drop=True)
    return sel


def token_rows(con, run: str, step: int, keys: list[tuple[int, int]] | None = None):
    """The token rows of ``run`` at ``step`` (every update), ``keys`` = (rank, seq) pairs to keep (all
    when None): TOKEN_COLUMNS plus rank, seq, update; sorted by rank, seq, update, pos."""
    cols = ", ".join(f"t.{c}" for c in TOKEN_COLUMNS)
    sql = (
        f"SELECT t.rank, t.seq, t.update, {cols} FROM tokens AS t WHERE t.run = {sql_str(run)} AND t.step = {int(step)}"
    )
    if keys:
        pairs = " OR ".join(f"(t.rank = {int(r)} AND t.seq = {int(q)})" for r, q in keys)
        sql += f" AND ({pairs})"
    df = run_sql(con, sql + " ORDER BY t.rank, t.seq, t.update, t.pos")
    df["quadrant"] = df["quadrant"].astype(object)
    return df


def texts(con, run: str, rows) -> dict[tuple[int, int, int], str | None]:
    """sequences.text of the responses in ``rows`` (responses analysis lines): (step, rank, seq) -> text."""
    out: dict[tuple[int, int, int], str | None] = {}
    pairs = {(int(g), int(q)) for g, q in zip(rows["gen_step"].fillna(-1), rows["seq"]) if g >= 0}
    if not pairs:
        return out
    cond = " OR ".join(f"(step = {g} AND seq = {q})" for g, q in sorted(pairs))
    df = run_sql(con, f"SELECT step, rank, seq, text FROM sequences WHERE run = {sql_str(run)} AND ({cond})")
    by_gen = {(int(s), int(r), int(q)): t for s, r, q, t in df.itertuples(index=False)}
    by_gen_seq = {(int(s), int(q)): t for s, r, q, t in df.itertuples(index=False)}
    for g, s, r, q in zip(rows["gen_step"], rows["step"], rows["rank"], rows["seq"]):
        if g != g or g is None:
            continue
        t = by_gen.get((int(g), int(r), int(q)), by_gen_seq.get((int(g), int(q))))
        out[(int(s), int(r), int(q))] = t if isinstance(t, str) else None
    return out


def category(metric: str, row: dict):
    """The category a categorical metric gives one token row (a dict of TOKEN_COLUMNS): quadrant -> its
    name; clip -> "kept" (inside the clip range), "low" / "high" (outside it, gradient kept: A > 0 below,
    A < 0 above), "clipped low" / "clipped high" (PPO-clip removed the gradient); erc -> "kept", "dropped"
    or None (no ERC). The page's script computes the same (entropylens/report/viewer.js)."""
    if metric == "quadrant":
        return row.get("quadrant")
    if metric == "clip":
        sides: dict[int | None, str] = {-1: "low", 1: "high"}
        side = sides.get(row.get("clip"))
        if side is None:
            return "kept"
        return f"clipped {side}" if row.get("clipped") else side
    if metric == "erc":
        kept = row.get("erc_kept")
        return None if kept is None else ("kept" if kept else "dropped")
    raise ValueError(f"{metric!r} is not a categorical metric")


def forking(old_entropy) -> list[bool]:
    """The response's "forking" tokens: the top FORKING_SHARE of its positions by sampling entropy
    (k = ceil(0.2 n) of the n positions with a value; ties at the k-th value included)."""
    vals = [float(v) for v in old_entropy]
    finite = sorted((v for v in vals if v == v), reverse=True)
    if not finite:
        return [False] * len(vals)
    k = max(1, math.ceil(FORKING_SHARE * len(finite)))
    cut = finite[k - 1]
    return [v == v and v >= cut for v in vals]


def _scalar(v, integer: bool = False):
    """One summary value: None for null / NaN, else an int or a float32's shortest form."""
    if v is None or v is _NA or (isinstance(v, float) and v != v):
        return None
    if integer:
        return int(v)
    return _float_values([v])[0]


def _float_values(values) -> list:
    """float32 values in their shortest round-trip form (Arrow's float -> string cast, vectorised): as
    Python floats, which JSON prints in that same short form; null / NaN -> None, infinities -> "inf" /
    "-inf" (JSON has no infinity)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    arr = pa.array(np.asarray(values, dtype=np.float32), from_pandas=True)
    out: list[float | str | None] = []
    for x in pc.cast(arr, pa.string()).to_pylist():
        if x is None or x == "nan":
            out.append(None)
        elif x in ("inf", "-inf"):
            out.append(x)
        else:
            out.append(float(x))
    return out


def column_values(df) -> dict[str, list]:
    """The TOKEN_COLUMNS of a token-rows frame as embedded values: float32 columns in their shortest
    round-trip form (:func:`_float_values`), ints, bools, the quadrant's name; null -> None."""
    import pyarrow as pa

    out: dict[str, list] = {}
    for c in TOKEN_COLUMNS:
        col = df[c]
        if c in _INT_COLUMNS:
            out[c] = [None if v is None or v != v else int(v) for v in pa.array(col, from_pandas=True).to_pylist()]
        elif c in _BOOL_COLUMNS:
            out[c] = pa.array(col.astype(object).where(col.notna(), None), type=pa.bool_()).to_pylist()
        elif c == "quadrant":
            out[c] = [None if v is None or v != v or v is _NA else str(v) for v in col.astype(object)]
        else:
            out[c] = _float_values(col.astype("float32"))
    return out


def response_data(line, tokens_df, values: dict[str, list], decoder, text: str | None) -> dict:
    """One response's embedded form (entropylens/report/viewer.py's page format): ``tokens_df`` its token rows
    (all updates, sorted by update and pos), ``values`` their :func:`column_values`, aligned with them."""
    import numpy as np

    upd = tokens_df["update"].to_numpy()
    updates = sorted(int(u) for u in np.unique(upd))
    first = np.flatnonzero(upd == updates[0]) if updates else np.arange(0)
    pos = [values["pos"][i] for i in first]
    ids = [values["token_id"][i] for i in first]
    old_h = [values["old_entropy"][i] for i in first]
    rows = {str(u): [[values[c][i] for c in TOKEN_COLUMNS] for i in np.flatnonzero(upd == u)] for u in updates}
    ints = ("length", "tokens", "updates", "clipped", "erc_dropped")
    return {
        "seq": int(line["seq"]),
        "rank": int(line["rank"]),
        "group": _scalar(line["group"], True),
        "gen_step": _scalar(line["gen_step"], True),
        "why": list(line.get("why", []) or []),
        "text": text,
        "summary": {c: _scalar(line[c], c in ints) for c in SUMMARY_COLUMNS},
        "pos": pos,
        "tokens": decoder.tokens(ids),
        "forking": [p for p, f in zip(pos, forking([np.nan if v is None else float(v) for v in old_h])) if f],
        "rows": rows,
    }


def page_data(con, run: str, sel: Selection, decoder, *, method: str | None = None) -> dict:
    """The page format of entropylens/report/viewer.py for the responses of ``sel``."""
    from ..token_text import HOW_TO_GET_TEXT

    rows = sel.rows
    txt = texts(con, run, rows) if len(rows) else {}
    built: list[tuple[int, int, dict, int]] = []  # (step, priority, response, bytes)
    for s in sorted(int(x) for x in rows["step"].unique()) if len(rows) else []:
        lines = rows[rows["step"] == s]
        toks = token_rows(con, run, s, [(int(r), int(q)) for r, q in zip(lines["rank"], lines["seq"])])
        for _, line in lines.iterrows():
            part = toks[(toks["rank"] == line["rank"]) & (toks["seq"] == line["seq"])]
            r = response_data(
                line, part, column_values(part), decoder, txt.get((s, int(line["rank"]), int(line["seq"])))
            )
            built.append((s, int(line.get("priority", 0)), r, len(dumps(r).encode()) + 1))
    keep = sorted(built, key=lambda b: b[1])
    total = sum(b[3] for b in keep)
    while keep and total > sel.max_bytes - PAGE_DATA_OVERHEAD:
        total -= keep.pop()[3]
        sel.dropped_for_size += 1
    kept = {id(b[2]) for b in keep}
    steps = []
    for s in sorted({b[0] for b in built}):
        out = [b[2] for b in built if b[0] == s and id(b[2]) in kept]
        if out:
            steps.append(
                {"step": s, "updates": sorted({u for r in out for u in map(int, r["rows"])}), "responses": out}
            )
    sel.data_bytes = total
    kept_keys = {(b[0], b[2]["rank"], b[2]["seq"]) for b in keep}
    if len(rows):
        sel.rows = rows[
            [(int(a), int(b), int(c)) in kept_keys for a, b, c in zip(rows["step"], rows["rank"], rows["seq"])]
        ].reset_index(drop=True)
    return {
        "run": run,
        "method": method,
        "columns": list(TOKEN_COLUMNS),
        "summary_columns": list(SUMMARY_COLUMNS),
        "metrics": [
            {
                "key": m.key,
                "label": m.label,
                "scale": m.scale,
                "center": m.center,
                "categories": [[v, label] for v, label in m.categories],
            }
            for m in METRICS
        ],
        "has_text": bool(decoder.has_text),
        "text_source": decoder.source,
        "text_hint": "" if decoder.has_text else HOW_TO_GET_TEXT,
        "separator": getattr(decoder, "separator", ""),  # shown between two tokens (word-level vocabularies)
        "selection": sel.text,
        "where": sel.where,
        "candidates": sel.candidates,
        "max_bytes": sel.max_bytes,
        "forking_share": FORKING_SHARE,
        "steps": steps,
    }


def dumps(data: dict) -> str:
    """The page data as compact JSON, safe inside a <script> element."""
    return json.dumps(data, separators=(",", ":"), ensure_ascii=False).replace("</", "<\\/")
