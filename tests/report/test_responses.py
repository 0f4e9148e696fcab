"""The token viewer's data (entropylens/report/responses.py, analyses/responses.sql): one line per response,
the selection rules, --where, the page's size bound, and the TRL-style join of later steps' tokens to
the step that generated the sequence."""

import json

import numpy as np
import pandas as pd
import pytest

from entropylens.read.query import QueryError, connect, run_analysis
from entropylens.record.writing.parquet import write_sequences, write_steps, write_tokens
from entropylens.report import responses as R


class Ids:  # no tokenizer: ids shown
    has_text, source = False, ""

    @staticmethod
    def tokens(ids):
        return [f"<{i}>" for i in ids]


def _run(
    root,
    name="r",
    steps=10,
    seqs=6,
    length=5,
    updates=(0, 1),
    run_unique=False,
    rewards=None,
    clipped_seq=None,
    long_seq=None,
):
    """A run whose answers are known: step s, sequence q has reward rewards(s, q) (default (q + s) / 10),
    every token of sequence ``clipped_seq`` (all steps) is clipped at update 1, ``long_seq`` = (q, n)
    gives sequence q n tokens. Seq ids per step 0..seqs-1, or run-unique (TRL) with ``run_unique``."""
    d = root / name
    d.mkdir(parents=True)
    (d / "run.json").write_text(
        json.dumps(
            {
                "run": name,
                "method": "grpo",
                "status": "finished",
                "eps_low": 0.2,
                "eps_high": 0.2,
                "tau": 0.5,
                "schema_version": 3,
                "config": {},
            }
        )
    )
    rewards = rewards or (lambda s, q: (q + s) / 10)
    for s in range(steps):
        base = s * seqs if run_unique else 0
        seq, pos, adv, old_h = [], [], [], []
        for q in range(seqs):
            n = long_seq[1] if long_seq and q == long_seq[0] else length
            seq += [base + q] * n
            pos += list(range(n))
            adv += [1.0 if q % 2 else -1.0] * n
            old_h += [0.1 * (p % 7) + 0.01 * q for p in range(n)]
        k = len(seq)
        for u in updates:
            clipped = np.array([u == 1 and clipped_seq is not None and sq - base == clipped_seq for sq in seq])
            write_tokens(
                d,
                s,
                0,
                u,
                {
                    "update": np.full(k, u, np.int16),
                    "seq": np.array(seq, np.int32),
                    "group": np.zeros(k, np.int32),
                    "pos": np.array(pos, np.int32),
                    "token_id": np.array([p % 32 for p in pos], np.int32),
                    "logprob": np.full(k, -1.0, np.float32),
                    "old_logprob": np.full(k, -1.0, np.float32),
                    "advantage": np.array(adv, np.float32),
                    "quadrant": np.ones(k, np.int8),
                    "clip": np.where(clipped, 1, 0).astype(np.int8),
                    "clipped": clipped,
                    "entropy": np.array(old_h, np.float32),
                    "old_entropy": np.array(old_h, np.float32),
                    "grad_coef": np.full(k, -0.1, np.float32),
                },
            )
        write_steps(d, s, 0, [{"update": u, "n_tokens": k} for u in updates])
        write_sequences(
            d,
            s,
            0,
            0,
            {
                "seq": np.arange(seqs, dtype=np.int32) + base,
                "group": np.zeros(seqs, np.int32),
                "reward": np.array([rewards(s, q) for q in range(seqs)], np.float32),
                "advantage": np.array([1.0 if q % 2 else -1.0 for q in range(seqs)], np.float32),
                "length": np.array(
                    [long_seq[1] if long_seq and q == long_seq[0] else length for q in range(seqs)], np.int32
                ),
                "text": [f"step {s} seq {q}" for q in range(seqs)],
            },
        )
    return root


def test_later_steps_tokens_join_the_generation_step_as_trl_numbers_them(tmp_path):
    """TRL with num_iterations 2: the sequences row sits at the generation step, the tokens come again at the
    next step under the same run-unique seq id: the response at step 1 takes reward and length from step 0."""
    root = tmp_path / "runs"
    d = root / "t"
    d.mkdir(parents=True)
    (d / "run.json").write_text(
        json.dumps({"run": "t", "method": "grpo", "status": "finished", "tau": 0.5, "schema_version": 3, "config": {}})
    )
    tok = {
        "update": np.zeros(2, np.int16),
        "seq": np.array([7, 7], np.int32),
        "group": np.zeros(2, np.int32),
        "pos": np.array([0, 1], np.int32),
        "token_id": np.array([1, 2], np.int32),
        "logprob": np.zeros(2, np.float32),
        "old_logprob": np.zeros(2, np.float32),
        "advantage": np.ones(2, np.float32),
        "quadrant": np.ones(2, np.int8),
        "clip": np.zeros(2, np.int8),
        "clipped": np.zeros(2, bool),
        "entropy": np.ones(2, np.float32),
        "old_entropy": np.ones(2, np.float32),
    }
    for s in (0, 1):
        write_tokens(d, s, 0, 0, tok)
        write_steps(d, s, 0, [{"update": 0, "n_tokens": 2}])
    write_sequences(
        d,
        0,
        0,
        0,
        {
            "seq": np.array([7], np.int32),
            "group": np.zeros(1, np.int32),
            "reward": np.array([0.5], np.float32),
            "advantage": np.ones(1, np.float32),
            "length": np.array([2], np.int32),
            "text": ["hi"],
        },
    )
    df = run_analysis(connect(root), "responses")
    assert df[["step", "gen_step", "reward", "length"]].values.tolist() == [[0, 0, 0.5, 2], [1, 0, 0.5, 2]]
    texts = R.texts(connect(root), "t", df)
    assert texts == {(0, 0, 7): "hi", (1, 0, 7): "hi"}


def test_step_order_spreads_any_prefix_over_the_run():
    assert R.step_order(list(range(10))) == [9, 0, 4, 2, 7, 1, 3, 6, 8, 5]
    assert sorted(R.step_order(list(range(10)))) == list(range(10))
    assert R.step_order([5]) == [5] and R.step_order([1, 2]) == [2, 1]


def test_selection_rules_pick_the_telling_responses(tmp_path):
    """Steps 0..9, 6 sequences each, reward (q + s) / 10, sequence 2 clipped (5 tokens at update 1), sequence
    5 the highest sampling entropy (old_entropy 0.01 q higher), no attribution (entropy_effect null), no ERC.
    Per step the rules give: highest reward = seq 5, lowest = seq 0, most clipped = seq 2, |entropy effect|
    and ERC nothing (null / zero for every candidate: skipped), highest mean entropy = seq 5, already chosen:
    the next, seq 4. So 4 per step; n = 12 takes steps 9, 0 and 4 (step_order)."""
    con = connect(_run(tmp_path / "runs", clipped_seq=2))
    sel = R.select(con, "r", n=12)
    got = {(int(s), int(q)): why for s, q, why in zip(sel.rows.step, sel.rows.seq, sel.rows.why)}
    assert sorted(got) == [(s, q) for s in (0, 4, 9) for q in (0, 2, 4, 5)]
    assert got[(9, 5)] == ["highest reward", "highest mean entropy"]
    assert got[(9, 0)] == ["lowest reward"] and got[(9, 2)] == ["most clipped"]
    assert got[(9, 4)] == ["highest mean entropy"]
    assert sel.candidates == 60 and sel.steps_with_candidates == 10
    # n = 4: the last step alone; n = 6: its 4, then the first step's first 2 (highest, lowest reward);
    # n = 40: all ten steps, 4 each
    assert set(R.select(con, "r", n=4).rows.step) == {9}
    assert sorted(zip(*[R.select(con, "r", n=6).rows[c] for c in ("step", "seq")]))[:2] == [(0, 0), (0, 5)]
    sel = R.select(con, "r", n=40)
    assert sorted(set(sel.rows.step)) == list(range(10)) and len(sel.rows) == 40
    assert "40 of 60 responses at 10 steps" in sel.text


def test_where_keeps_responses_with_a_matching_token(tmp_path):
    con = connect(_run(tmp_path / "runs", clipped_seq=2))
    assert R.matching(con, "r", "clipped AND update = 1", step=3) == {(3, 0, 2)}
    assert len(R.matching(con, "r", "reward >= 1.3")) == 3  # (q + s) / 10 >= 1.3: (9,4) (9,5) (8,5)
    sel = R.select(con, "r", n=40, where="clipped")
    assert set(sel.rows.seq) == {2} and len(sel.rows) == 10 and "matching --where clipped" in sel.text
    assert R.select(con, "r", n=40, where="reward > 5").text == "No response matches --where reward > 5."
    for bad, says in (
        ("1 = 1; DROP TABLE x", "without ';'"),
        ("clipped -- x", "without ';' or comments"),
        ("(clipped", "unbalanced"),
        ("nosuch > 1", "nosuch"),
        ("", "empty"),
    ):
        with pytest.raises(QueryError, match=says):
            R.select(con, "r", where=bad)


def test_forking_tokens_are_the_top_fifth_by_sampling_entropy():
    # 10 positions: k = ceil(0.2 * 10) = 2: the two highest (0.9, 0.8)
    vals = [0.1, 0.9, 0.2, 0.8, 0.3, 0.4, 0.5, 0.6, 0.7, 0.0]
    assert [i for i, f in enumerate(R.forking(vals)) if f] == [1, 3]
    assert [i for i, f in enumerate(R.forking([1.0, 1.0, 0.5])) if f] == [0, 1]  # k = 1; ties at 1.0 kept
    assert R.forking([float("nan")] * 3) == [False] * 3
    # NaN never marked, and not counted: 5 values -> k = 1
    assert R.forking([0.1, float("nan"), 0.3, 0.2, 0.0, 0.05]) == [False, False, True, False, False, False]


def test_categories_as_the_page_colours_them():
    assert R.category("clip", {"clip": 0, "clipped": False}) == "kept"
    assert R.category("clip", {"clip": 1, "clipped": True}) == "clipped high"
    assert R.category("clip", {"clip": -1, "clipped": False}) == "low"
    assert R.category("erc", {"erc_kept": None}) is None and R.category("erc", {"erc_kept": False}) == "dropped"
    assert R.category("quadrant", {"quadrant": "PA&LP"}) == "PA&LP"


def test_page_data_values_equal_the_rows_and_the_size_stays_bounded(tmp_path):
    """A large run (10 steps x 6 responses, one of 2000 tokens per step): the page data of 40 responses
    with a 300 kB bound stays under it, the long ones left out first; every embedded value is the float32
    of the Parquet row."""
    con = connect(_run(tmp_path / "runs", clipped_seq=2, long_seq=(5, 2000)))
    sel = R.select(con, "r", n=40, max_bytes=300_000)
    data = R.page_data(con, "r", sel, Ids())
    size = len(R.dumps(data).encode())
    assert size <= 300_000 and sel.dropped_for_size > 0
    assert "left out to keep the page's data under 0.3 MB" in sel.text
    assert all(r["seq"] != 5 for st in data["steps"] for r in st["responses"])  # 2000 tokens x 2 updates
    # no bound: all 40, the long ones included (over 1 MB)
    sel = R.select(con, "r", n=40, max_bytes=50_000_000)
    data = R.page_data(con, "r", sel, Ids())
    assert sel.dropped_for_size == 0 and len(R.dumps(data)) > 1_000_000
    resp = data["steps"][0]["responses"][0]
    cols = data["columns"]
    row = dict(zip(cols, resp["rows"]["1"][3]))
    got = (
        con.execute(
            "SELECT * FROM tokens WHERE run = 'r' AND step = ? AND seq = ? AND update = 1 AND pos = 3",
            [data["steps"][0]["step"], resp["seq"]],
        )
        .df()
        .iloc[0]
    )
    for c in cols:
        want = got[c]
        if c == "quadrant":
            assert row[c] == want
        elif pd.isna(want):
            assert row[c] is None
        elif isinstance(want, (bool, np.bool_)):
            assert row[c] is bool(want)
        else:
            assert np.float32(row[c]) == np.float32(want), c
    assert resp["tokens"][:3] == ["<0>", "<1>", "<2>"] and resp["text"].startswith("step ")
    assert resp["forking"] == [
        p for p, f in zip(resp["pos"], R.forking([0.1 * (p % 7) + 0.01 * resp["seq"] for p in resp["pos"]])) if f
    ]
    assert "</" not in R.dumps({"t": "</script><b>"})


def test_erc_dropped_is_null_without_erc_and_counts_over_the_updates_with_it(tmp_path):
    """A run without ERC (no erc_kept column) says "not applicable" (null, the page's "–") for ERC-dropped,
    never 0 in one table and "–" in the next; clipped sums the step's updates: sequence 2's 5 tokens are
    clipped at update 1 only -> 5, and sequence 0 has none -> 0."""
    con = connect(_run(tmp_path / "runs", clipped_seq=2))
    df = run_analysis(con, "responses")
    assert df["erc_dropped"].isna().all()
    at9 = df[df["step"] == 9].set_index("seq")
    assert int(at9.loc[2, "clipped"]) == 5 and int(at9.loc[0, "clipped"]) == 0


@pytest.mark.parametrize("run_unique", [False, True])
def test_selection_from_the_visited_steps_equals_the_one_from_the_whole_table(tmp_path, run_unique):
    """select() without a table reads only the steps it visits (response_counts gives the candidates and the
    steps): the same rows, reasons, priorities and text as the selection from the whole responses table,
    for any n (one batch of steps, several, every step), ties in reward included."""
    rng = np.random.default_rng(3)
    rewards = rng.integers(0, 3, (13, 7)) / 2  # many ties
    con = connect(
        _run(
            tmp_path / "runs",
            steps=13,
            seqs=7,
            run_unique=run_unique,
            rewards=lambda s, q: rewards[s, q],
            clipped_seq=3,
        )
    )
    table = R.responses(con, "r")
    assert R.response_counts(con) == {"r": {s: 7 for s in range(13)}}
    for n in (1, 5, 6, 7, 13, 30, 60, 91, 200):
        lazy, whole = R.select(con, "r", n=n), R.select(con, "r", n=n, table=table)
        assert (lazy.candidates, lazy.steps_with_candidates, lazy.text) == (
            whole.candidates,
            whole.steps_with_candidates,
            whole.text,
        ), n
        cols = ["step", "rank", "seq", "reward", "tokens", "updates", "clipped", "why", "priority"]
        assert lazy.rows[cols].astype(str).equals(whole.rows[cols].astype(str)), n
        a = R.page_data(con, "r", lazy, R_DECODER, method="grpo")
        b = R.page_data(con, "r", whole, R_DECODER, method="grpo")
        assert R.dumps(a) == R.dumps(b), n


def test_selection_reads_the_whole_table_where_a_sequences_row_is_there_twice(tmp_path):
    """A sequences row written twice (a copied file) gives the responses analysis a line per copy: the
    selection then counts from the whole table, as before."""
    root = _run(tmp_path / "runs", steps=3)
    d = root / "r" / "sequences" / "step=1" / "rank=0"
    (f,) = list(d.glob("part-0.parquet"))
    (d / "part-1.parquet").write_bytes(f.read_bytes())  # the same rows again, under a recorder's name
    con = connect(root)
    whole = R.select(con, "r", n=40, table=R.responses(con, "r"))
    assert R._sequences_repeated(con, "r")
    assert sum(R.response_counts(con)["r"].values()) < whole.candidates  # the counts alone would miss the copy
    assert R.select(con, "r", n=40).candidates == whole.candidates == len(R.responses(con, "r"))


R_DECODER = Ids()
