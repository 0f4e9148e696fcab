"""Run-level findings (report/run_findings.py): a thin quadrant with a suggested tau, and a run on-policy."""

from __future__ import annotations

import pytest
from retau_runs import record

from entropylens.read.query import connect
from entropylens.report.checks import notes
from entropylens.report.run_findings import (
    ON_POLICY_BY_FRAMEWORK,
    ON_POLICY_TEXT,
    on_policy,
    suggest_tau,
    thin_quadrants,
)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("findings")
    record(root / "two", "two", 0.5, updates=2)  # num_iterations 2: update 1 moves the ratio
    record(root / "one", "one", 0.5, updates=1)  # num_iterations 1: every ratio exactly 1
    record(root / "low", "low", 0.02, updates=2)  # p in [0.02, 0.98]: almost every token HP
    record(root / "recomputed", "recomputed", 0.5, updates=1, recompute_noise=2e-6)  # old log-probs from another pass
    record(root / "drift", "drift", 0.5, updates=1, recompute_noise=1e-3)  # a sampler 0.1% off: r != 1
    return root


def test_a_loop_at_num_iterations_1_is_on_policy_and_at_2_is_not(runs):
    found = on_policy(connect(runs))
    # "recomputed": every |log r| <= 2e-6 (float32 noise of a second pass) is still on-policy; "drift": up to
    # 1e-3 (r down to 0.999) is not, though no token leaves a 0.2 band
    mine = ON_POLICY_BY_FRAMEWORK[None]  # a loop of one's own: the advice names no one trainer's settings only
    assert [(f.run, f.rule, f.signal) for f in found] == [("one", "on_policy", mine), ("recomputed", "on_policy", mine)]
    assert "num_iterations > 1 or steps_per_generation > gradient_accumulation_steps" in ON_POLICY_TEXT
    assert ON_POLICY_BY_FRAMEWORK["trl"] == ON_POLICY_TEXT and "ppo_epochs > 1" in ON_POLICY_BY_FRAMEWORK["verl"]
    assert "more than one optimizer step per batch of rollouts" in mine


def test_the_advice_is_in_the_runs_trainers_settings(tmp_path):
    """A verl run trained on-policy is told verl's settings, a TRL run TRL's (run.json config.framework)."""
    for framework in ("verl", "trl"):
        record(tmp_path / framework, framework, 0.5, updates=1, config={"method": "grpo", "framework": framework})
    found = {f.run: f.signal for f in on_policy(connect(tmp_path))}
    assert found == {"verl": ON_POLICY_BY_FRAMEWORK["verl"], "trl": ON_POLICY_TEXT}


def test_thin_quadrant_names_the_quantiles_and_a_tau(runs):
    con = connect(runs / "low")
    found = thin_quadrants(con)
    assert {f.signal.split(" ")[0] for f in found} == {"PA&LP", "NA&LP"}, found
    p50 = float(con.execute("SELECT quantile_cont(prob, 0.5) FROM tokens WHERE advantage <> 0").fetchone()[0])
    f = next(f for f in found if f.signal.startswith("PA&LP"))
    assert (
        f.value
        == pytest.approx(
            float(
                con.execute(
                    "SELECT count(*) FILTER (WHERE quadrant = 'PA&LP') / count(*) FROM tokens WHERE advantage <> 0"
                ).fetchone()[0]
            )
        )
        and f.value < 0.01
    )
    assert f"p50 {p50:.3g}" in f.signal and f"try --tau {suggest_tau(p50)}" in f.signal
    assert "exp(-H)" not in f.signal  # no entropy recorded in this loop: no exp(-H) claimed
    # at the suggested tau no quadrant is thin
    assert notes(runs / "low", tau=float(suggest_tau(p50))) == []
    assert suggest_tau(0.4975) == "0.497" and suggest_tau(0.12345) == "0.123" and float(suggest_tau(0.0301)) <= 0.0301
    assert thin_quadrants(connect(runs / "two")) == []


def _single_query_findings(con):
    """The findings as one query over every run computed them before (quantiles and the moved count for every
    run, in full): what thin_quadrants / on_policy must still give."""
    from entropylens.report import run_findings as rf

    counts = ", ".join(f"count(*) FILTER (WHERE quadrant = '{q}') AS \"{q}\"" for q in rf.QUADRANTS)
    thin = rf._rows(
        con,
        f"""SELECT run, min(step) AS step, count(*) AS n, {counts},
               quantile_cont(prob, 0.05) AS p05, quantile_cont(prob, 0.5) AS p50, quantile_cont(prob, 0.95) AS p95,
               avg(coalesce(old_entropy, entropy)) AS h, any_value(r.tau) AS tau
        FROM tokens JOIN (SELECT run, tau FROM runs) AS r USING (run)
        WHERE advantage <> 0 AND prob IS NOT NULL GROUP BY run ORDER BY run""",
    )
    moved = rf._rows(
        con,
        f"""SELECT run, min(step) AS step, count(*) AS n,
               count(*) FILTER (WHERE NOT abs(logprob - old_logprob) <= {rf.ON_POLICY_TOL}) AS moved
        FROM tokens WHERE logprob IS NOT NULL AND old_logprob IS NOT NULL GROUP BY run ORDER BY run""",
    )
    return thin, moved


def test_findings_equal_the_single_query_over_every_run(runs):
    """thin_quadrants reads the quantiles only for the runs with a thin quadrant, on_policy counts only the runs
    without a moved token row: the same findings as computing both for every run."""
    con = connect(runs)
    thin, moved = _single_query_findings(con)
    want_thin = {
        (r["run"], q) for r in thin for q in ("PA&HP", "PA&LP", "NA&HP", "NA&LP") if r["n"] and r[q] / r["n"] < 0.01
    }
    got = thin_quadrants(con)
    assert {(f.run, f.signal.split(" ")[0]) for f in got} == want_thin and want_thin
    by_run = {r["run"]: r for r in thin}
    for f in got:
        r = by_run[f.run]
        assert f.step == r["step"] and f"p05 {r['p05']:.3g}, p50 {r['p50']:.3g}, p95 {r['p95']:.3g}" in f.signal
    want_on = [(r["run"], r["step"]) for r in moved if r["n"] and not r["moved"]]
    assert [(f.run, f.step) for f in on_policy(con)] == want_on and want_on
