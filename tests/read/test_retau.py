"""Quadrants at any tau after the fact (read/retau.py): a run re-split at tau equals the same run recorded at tau."""

from __future__ import annotations

import pytest
from retau_runs import STEPS, B, T, record  # noqa: F401 - B, T: the runs' shape

from entropylens.read.query import QueryError, connect, run_analysis, run_sql
from entropylens.schema import QUADRANTS, quadrant_slug

QCOLS = [f"{p}_{quadrant_slug(q)}" for q in QUADRANTS for p in ("n", "clip_frac")] + ["n_za"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("retau")
    for tau in (0.3, 0.5, 0.7):
        record(root / f"at{tau}", "r", tau)
    return root


def _steps(con):
    return con.execute(f"SELECT step, update, {', '.join(QCOLS)} FROM steps ORDER BY step, update").df()


@pytest.mark.parametrize("tau", [0.3, 0.7])
def test_resplit_at_tau_equals_the_run_recorded_at_tau(runs, tau):
    recorded = connect(runs / f"at{tau}")
    resplit = connect(runs / "at0.5", tau=tau)
    a, b = _steps(recorded), _steps(resplit)
    assert (a[[c for c in QCOLS if c.startswith("n_")]].sum().sum()) > 0
    assert a.equals(b) or ((a - b).abs().max().max() < 1e-6), (a, b)
    # the quadrant shares (the report's figure) and every token's quadrant
    sa = run_analysis(recorded, "quadrant_share_by_step")
    sb = run_analysis(resplit, "quadrant_share_by_step")
    assert sa["share"].tolist() == pytest.approx(sb["share"].tolist(), abs=1e-12)
    q = "SELECT step, update, seq, pos, quadrant FROM tokens ORDER BY ALL"
    assert run_sql(recorded, q).equals(run_sql(resplit, q))
    assert run_sql(resplit, "SELECT tau FROM runs").iloc[0, 0] == pytest.approx(tau)
    # the split changed something: at 0.5 the shares differ
    s5 = run_analysis(connect(runs / "at0.5"), "quadrant_share_by_step")
    assert not s5["share"].tolist() == pytest.approx(sb["share"].tolist(), abs=1e-9)


def test_quadrant_macro_on_every_connection(runs):
    con = connect(runs / "at0.5")
    got = run_sql(
        con,
        "SELECT count(*) FILTER (WHERE quadrant(advantage, prob, 0.5) <> quadrant) AS n, count(*) AS rows FROM tokens",
    )
    assert got["n"].iloc[0] == 0 and got["rows"].iloc[0] > 0
    lit = run_sql(
        con, "SELECT quadrant(1.0, 0.6, 0.5) AS a, quadrant(-1.0, 0.4, 0.5) AS b, quadrant(0.0, 0.9, 0.5) AS c"
    )
    assert lit.iloc[0].tolist() == ["PA&HP", "NA&LP", "ZA"]


def test_bad_tau_is_one_line(runs):
    with pytest.raises(QueryError, match="tau 1.5 is not in"):
        connect(runs / "at0.5", tau=1.5)


def test_cli_tau_on_analyze_show_check(runs):
    import json

    from cli_calls import err, ok, runner
    from entropylens.cli.main import app

    got = json.loads(ok("analyze", runs / "at0.5", "quadrant_share_by_step", "--tau", "0.7", "-f", "json"))
    want = json.loads(ok("analyze", runs / "at0.7", "quadrant_share_by_step", "-f", "json"))
    assert [(r["step"], r["quadrant"], r["tokens"]) for r in got] == [
        (r["step"], r["quadrant"], r["tokens"]) for r in want
    ]
    assert "--tau 1.5: not in (0, 1]" in err("analyze", runs / "at0.5", "quadrant_share_by_step", "--tau", "1.5")
    assert "--tau" in err("analyze", runs / "at0.5", "quadrant_share_by_step", "--tau", "0.7", "--engine", "spark")
    shown = ok("show", runs / "at0.5", "--step", "0", "--seq", "0", "--color", "quadrant", "--tau", "0.7")
    recorded = ok("show", runs / "at0.7", "--step", "0", "--seq", "0", "--color", "quadrant")
    assert shown == recorded
    res = runner.invoke(app, ["check", str(runs / "at0.5"), "--tau", "0.999"])
    assert "note: run=r step=0 rule=thin_quadrant" in res.stdout and "try --tau" in res.stdout, res.output


@pytest.mark.parametrize(
    "sql, mean",
    [
        ("SELECT quadrnt FROM tokens", "`quadrant`"),
        ("SELECT * FROM token", "`tokens`"),
        ("SELECT quadrnt(advantage, prob, 0.5) FROM tokens", "`quadrant`"),
        ("SELECT t.entrpy FROM tokens AS t", "`entropy`"),
    ],
)
def test_sql_slips_name_the_closest_names_the_views_and_schema(runs, sql, mean):
    from cli_calls import err

    line = err("query", runs / "at0.5", sql)
    assert f"did you mean {mean}" in line and "views: runs, steps, sequences, tokens" in line, line
    assert "`entropylens schema`" in line and "\n" not in line
    other = err("query", runs / "at0.5", "SELECT 1 / 'a'")  # not a name: no hint
    assert "did you mean" not in other and "entropylens schema" not in other


def test_a_replanned_connection_keeps_its_tau(runs):
    from entropylens.read import lockdown

    con = connect(runs / "at0.5", tau=0.7)
    q = "SELECT step, update, seq, pos, quadrant FROM tokens ORDER BY ALL"
    before = run_sql(con, q)
    assert lockdown.replan(con)  # as after a compaction removed the files the views read
    assert run_sql(con, q).equals(before) and run_sql(connect(runs / "at0.7"), q).equals(before)


def test_report_at_tau_is_the_report_of_the_run_recorded_at_tau(runs, tmp_path):
    """`report --tau 0.7` on the run recorded at 0.5 writes the report of the run recorded at 0.7: report.md
    the same line for line (captions, tables, every quadrant count), but one line that says the split was
    given after the fact."""
    from cli_calls import ok

    ok("report", runs / "at0.5", "--tau", "0.7", "--out", tmp_path / "resplit")
    ok("report", runs / "at0.7", "--out", tmp_path / "recorded")
    a = (tmp_path / "resplit" / "report.md").read_text().splitlines()
    b = (tmp_path / "recorded" / "report.md").read_text().splitlines()
    assert len(a) == len(b)
    differ = [(x, y) for x, y in zip(a, b) if x != y]
    assert len(differ) == 1, differ  # the run's description: the sentence about tau, then the same words
    x, y = differ[0]
    assert x.startswith("Quadrants split at tau = 0.7 (given after the fact)") and x.endswith(" " + y), differ
