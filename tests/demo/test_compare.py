"""The claims lab's methods table on hand-made numbers: one line a method with its settings and what
differs from the baseline, two-sided Welch tests with Holm's correction, the markdown section, the
path figure, and the token-entropy shares beside the 80/20 paper."""

import json
import math

import duckdb
import pandas as pd
import pytest

from entropylens.demo.toy import beside, claims, compare, methods, rules
from entropylens.demo.toy.config import config_for


def _recorded(name: str, **over) -> dict:
    """A run.json config as train() writes it (method = the run's name, loss_method = the loss)."""
    cfg = config_for(name, **over)
    return {**cfg.to_dict(), "method": name, "loss_method": cfg.method}


def _agg(finals: dict[str, list[float]], rewards: dict[str, list[float]] | None = None, bad=None, over=None) -> dict:
    """claims.by_config's shape: per method, per measure, one value a seed."""
    agg = {}
    for name, hs in finals.items():
        n = len(hs)
        st = methods.settings(_recorded(name, **(over or {}).get(name, {})))
        agg[name] = {
            "h0": [1.2] * n,
            "h_final": list(hs),
            "r_final": list((rewards or {}).get(name, [0.5] * n)),
            "destabilised": list((bad or {}).get(name, [False] * n)),
            "settings": [st] * n,
        }
    return agg


def test_two_sided_welch_hand_worked():
    # a = 1..5, b = 0, .5, 1, 1.5, 2 (test_claims_rules.test_welch_hand_worked): t = 2.529822, df = 5.882353,
    # one-sided p = 0.0227, so two-sided p = 2 x 0.0227 = 0.0454 (< 0.05: the means differ)
    one = rules.welch([1, 2, 3, 4, 5], [0, 0.5, 1, 1.5, 2])
    two = rules.welch_two_sided([1, 2, 3, 4, 5], [0, 0.5, 1, 1.5, 2])
    assert (two.t, two.df, two.sides) == (one.t, one.df, 2)
    assert two.p == pytest.approx(2 * one.p) and 0.044 < two.p < 0.046 and two.holds
    rev = rules.welch_two_sided([0, 0.5, 1, 1.5, 2], [1, 2, 3, 4, 5])  # the other direction: same p
    assert rev.p == pytest.approx(two.p) and rev.diff == -2.0
    assert "two-sided p = 0.045" in two.text()
    assert rules.welch_two_sided([1.0], [0.0, 0.1]).p == 1.0  # one seed: no test
    assert rules.welch_two_sided([1.0, 1.0], [1.0, 1.0]).p == 1.0  # same constant: no difference
    assert rules.welch_two_sided([1.0, 1.0], [0.0, 0.0]).p == 0.0  # different constants


def test_holm_hand_worked():
    # m = 4, sorted 0.01 < 0.05/4 = 0.0125: rejected; next 0.03 < 0.05/3 = 0.0167? no: stop (0.04, 0.5 kept)
    assert rules.holm([0.01, 0.04, 0.03, 0.5]) == [True, False, False, False]
    # 0.001 < 0.0167, 0.012 < 0.025, 0.02 < 0.05: all three
    assert rules.holm([0.02, 0.001, 0.012]) == [True, True, True]
    # 0.04 alone passes at 5%, but not among two (0.04 > 0.05/2 = 0.025)
    assert rules.holm([0.04]) == [True] and rules.holm([0.04, 0.9]) == [False, False]
    assert rules.holm([]) == []


def test_table_lists_each_method_with_its_settings_and_what_differs():
    agg = _agg(
        {
            "grpo": [0.05, 0.06, 0.04, 0.05, 0.055],
            "erc_dapo": [0.30, 0.32, 0.31, 0.29, 0.33],
            "entropy_bonus_0.003": [0.05, 0.07, 0.04, 0.06, 0.05],
            "gspo": [0.05, 0.06, 0.04, 0.05, 0.055],
        },
        over={"gspo": {"lr": 2e-4}},
    )
    rows = compare.method_rows(agg, "grpo", order=["erc_dapo", "grpo", "entropy_bonus_0.003", "gspo"])
    assert [r["method"] for r in rows] == ["grpo", "erc_dapo", "entropy_bonus_0.003", "gspo"]  # baseline first
    by = {r["method"]: r for r in rows}
    assert by["grpo"]["differs"] == "baseline" and "entropy_test" not in by["grpo"]
    assert by["grpo"]["settings"] == "loss grpo, eps 0.2 / 0.2, agg token-mean"
    assert by["erc_dapo"]["settings"] == "loss dapo, eps 0.2 / 0.28, agg token-mean, erc (0.95, 1.05)"
    assert by["erc_dapo"]["differs"] == (
        "loss dapo (grpo: grpo); eps 0.2 / 0.28 (grpo: 0.2 / 0.2); erc (0.95, 1.05) (grpo: -)"
    )
    assert by["entropy_bonus_0.003"]["differs"] == "entropy_coef 0.003 (grpo: -)"
    # a training setting that differs is named too, with the baseline's value
    assert "lr 0.0002 (grpo: 0.0007)" in by["gspo"]["differs"]
    assert by["erc_dapo"]["description"] == methods.REGISTRY["erc_dapo"].description
    assert "arXiv 2512.05591" in by["erc_dapo"]["paper"]
    # ERC's final entropy is far above GRPO's (Welch t ~ 38): higher, and it holds after Holm over the 6 tests
    assert by["erc_dapo"]["entropy_verdict"] == "higher (holds after Holm)"
    assert by["entropy_bonus_0.003"]["entropy_verdict"] == "no difference at 5%"
    assert by["erc_dapo"]["reward_verdict"] == "no difference at 5%"  # equal rewards: t = 0
    assert compare.n_tests(rows) == 6
    table = compare.markdown(compare.as_json(rows), "grpo")
    assert len(table) == 2 + len(rows)  # header, rule, one line a method
    line = next(x for x in table if x.startswith("| erc_dapo |"))
    assert "| loss dapo, eps 0.2 / 0.28, agg token-mean, erc (0.95, 1.05) |" in line
    # means 0.31 (erc_dapo) - 0.051 (grpo) = +0.259
    assert "erc (0.95, 1.05) (grpo: -)" in line and "higher (holds after Holm): +0.259" in line
    assert "0.310 ± 0.016 (n = 5)" in line  # final entropy, mean ± sd over the 5 stable seeds


def test_destabilised_seeds_leave_entropy_not_reward_and_holm_can_refuse():
    # bonus: 2 of 5 seeds blew up to high entropy: final entropy over the 3 stable seeds only, reward over all 5
    grpo = [0.05, 0.06, 0.04, 0.05, 0.055]  # mean 0.051, var 0.000055
    agg = _agg(
        {
            "grpo": grpo,
            "entropy_bonus_0.001": [0.9, 0.95, 0.05, 0.06, 0.05],
            "dapo": [0.07, 0.075, 0.06, 0.08, 0.055],
            "gppo": [0.07, 0.08, 0.06, 0.085, 0.055],
        },
        rewards={
            "entropy_bonus_0.001": [0.1, 0.1, 0.9, 0.9, 0.9],
            "grpo": [0.9, 0.91, 0.89, 0.9, 0.9],
            "dapo": [0.9] * 5,
            "gppo": [0.9] * 5,
        },
        bad={"entropy_bonus_0.001": [True, True, False, False, False]},
    )
    rows = {r["method"]: r for r in compare.method_rows(agg, "grpo")}
    b = rows["entropy_bonus_0.001"]
    assert (b["stable"], b["seeds"], b["destabilised"]) == (3, 5, "2/5")
    assert b["entropy_test"].n_a == 3 and b["reward_test"].n_a == 5
    # dapo: mean 0.068, var 0.000107; t = 0.017 / sqrt(0.000107/5 + 0.000055/5) = 0.017 / 0.005701 = 2.982,
    # df = 0.0000324^2 / (0.0000214^2/4 + 0.000011^2/4) = 7.24, two-sided p = 0.0197: below 5%, but 6 tests
    # (3 methods x entropy, reward) under Holm: the smallest p must be below 0.05 / 6 = 0.0083 and none is
    # (gppo's entropy p = 0.012 is the smallest), so no difference holds after Holm
    d = rows["dapo"]["entropy_test"]
    assert d.t == pytest.approx(2.982, rel=1e-3) and d.df == pytest.approx(7.24, rel=1e-2)
    assert d.p == pytest.approx(2 * rules.t_sf(2.982, 7.244), rel=1e-2) and 0.019 < d.p < 0.020
    assert rows["dapo"]["entropy_verdict"] == "higher (not after Holm)"
    assert 0.0083 < rows["gppo"]["entropy_test"].p < 0.05
    assert rows["gppo"]["entropy_verdict"] == "higher (not after Holm)"
    assert rows["dapo"]["reward_verdict"] == "no difference at 5%"


def test_seeds_with_different_settings_are_flagged():
    agg = _agg({"grpo": [0.05, 0.06], "dapo": [0.05, 0.06]})
    agg["dapo"]["settings"][1] = methods.settings(_recorded("dapo", lr=1e-3))
    rows = compare.as_json(compare.method_rows(agg, "grpo"))
    line = next(x for x in compare.markdown(rows) if x.startswith("| dapo |"))
    assert "(seeds used different settings)" in line


def test_markdown_section_and_not_run_claims(tmp_path):
    agg = _agg({"grpo": [0.05, 0.06, 0.04], "gspo": [0.05, 0.06, 0.05]})
    rows = compare.method_rows(agg, "grpo")
    metrics = {f"{n}-s{i}": {"config": n, "seed": i} for n in agg for i in range(3)}
    res = claims.regime_result(
        "paper",
        metrics,
        [],
        seeds=3,
        steps=4,
        workers=1,
        minutes=None,
        core_minutes=1.0,
        configs=("grpo", "gspo"),
        rows=rows,
    )
    assert res["command"].endswith("--methods grpo,gspo") and res["compare"]["tests"] == 2
    (tmp_path / "paper-claims-paper.json").write_text(json.dumps(res, default=float))
    text = claims.write_markdown(tmp_path).read_text()
    assert "## Every method against grpo" in text and "### paper (REDUCED: 3 seeds x 4 steps)" in text
    assert "- **gspo**: " + methods.REGISTRY["gspo"].description in text
    assert "| gspo | loss gspo, eps 0.0003 / 0.0004, agg seq-mean-token-mean |" in text
    assert "![methods-entropy](paper-claims-paper-methods-entropy.png)" in text
    assert "Tests in the table: 2 (Holm's correction over these)" in text
    # a claim whose configs were not run says so
    c = claims.not_run(claims.claim_erc(agg), agg)
    assert c.verdict == "not run (erc_dapo, dapo not in this lab)"
    assert claims.not_run(claims.claim_collapse(agg), agg).verdict != "not run"


def test_method_paths_one_panel_a_method_with_the_baseline_on_each():
    from entropylens.demo.toy.lab_plots import method_paths

    df = pd.DataFrame(
        [
            dict(run=f"{m}-s{s}", method=m, step=t, old_entropy=1.0 - 0.1 * t * (m == "grpo") + 0.01 * s)
            for m in ("grpo", "dapo", "gspo")
            for s in range(2)
            for t in range(6)
        ]
    )
    fig = method_paths(
        df, "old_entropy", order=["dapo", "gspo", "grpo"], cols=2, labels={"dapo": "final 1.005 (2/2 stable seeds)"}
    )
    shown = [ax for ax in fig.axes if ax.get_visible()]
    # grpo's mean path 1.005 - 0.1 t; its last 5 steps t = 1..5 average t = 3: 1.005 - 0.3 = 0.705
    assert [ax.get_title() for ax in shown] == [
        "grpo: final 0.705 (n = 2)",
        "dapo: final 1.005 (2/2 stable seeds)",
        "gspo: final 1.005 (n = 2)",
    ]
    assert [len(ax.get_lines()) for ax in shown] == [1, 2, 2]  # the baseline's grey line beside each other method
    grey = shown[1].get_lines()[0]
    assert list(grey.get_ydata()) == pytest.approx([1.005 - 0.1 * t for t in range(6)])
    assert len(fig.axes) == 4 and not fig.axes[3].get_visible()  # the empty slot is not drawn


def test_token_entropy_shares_hand_worked():
    con = duckdb.connect()
    con.execute("CREATE TABLE steps AS SELECT * FROM (VALUES ('a', 0), ('a', 1), ('b', 0), ('b', 1)) t(run, step)")
    # run a: step 0 entropies 0.005, 0.5, 0.8, 1.0, 2.0 (pos 0-4), each in two updates (counted once);
    # step 1 (the last 5 steps include both steps: max step 1): 0.001 x 4 and 0.7
    rows = [("a", 0, u, 0, p, h, None) for u in (0, 1) for p, h in enumerate([0.005, 0.5, 0.8, 1.0, 2.0])]
    rows += [("a", 1, 0, 0, p, h, None) for p, h in enumerate([0.001, 0.001, 0.001, 0.001, 0.7])]
    rows += [("b", 0, 0, 0, p, 1.0, p < 1) for p in range(5)] + [("b", 1, 0, 0, p, 1.0, p < 1) for p in range(5)]
    con.execute(
        "CREATE TABLE tokens (run VARCHAR, step INT, update INT, seq INT, pos INT, old_entropy DOUBLE, "
        "token_kept BOOLEAN)"
    )
    con.executemany("INSERT INTO tokens VALUES (?, ?, ?, ?, ?, ?, ?)", rows)
    out = beside.token_entropy_shares(con, {"a": "grpo", "b": "forking"})
    a = out["grpo"]
    # first step: above 0.672: 0.8, 1.0, 2.0 -> 3/5; below 0.01: 0.005 -> 1/5;
    # p80 (linear): sorted .005 .5 .8 1 2, position 0.8 x 4 = 3.2 -> 1.0 + 0.2 x (2.0 - 1.0) = 1.2
    assert a["first"]["above"] == pytest.approx([0.6, 0.0]) and a["first"]["below"] == pytest.approx([0.2, 0.0])
    assert a["first"]["p80"][0] == pytest.approx(1.2) and a["first"]["tokens"] == [5]
    # last steps (steps 0 and 1, distinct tokens): above 4/10, below 5/10
    assert a["last"]["above"][0] == pytest.approx(0.4) and a["last"]["below"][0] == pytest.approx(0.5)
    assert "kept" not in a
    assert out["forking"]["kept"] == pytest.approx([0.2, 0.0])  # 1 of 5 tokens kept by the mask
    assert math.isclose(beside.FORKING_PAPER["p80"], 0.672)


def test_cui_summary_is_the_report_tables_per_method(tmp_path):
    """The claims lab's Cui et al. numbers are covlaw.tables' per-run rows, averaged over a method's seeds."""
    from entropylens.demo.toy import train
    from entropylens.read.query import connect
    from entropylens.report import covlaw

    tiny = dict(steps=6, prompts=4, group=4, minibatches=2, epochs=1, sft_steps=5)  # 6 steps: a meaningful fit
    for s in range(2):
        train(config_for("grpo", seed=s, **tiny), tmp_path, run=f"grpo-s{s}")
    con = connect(tmp_path)
    out = beside.cui_summary(con, {"grpo-s0": "grpo", "grpo-s1": "grpo"})["grpo"]
    t = covlaw.tables(con)
    law, fit = t["law"], t["fit"]
    assert out["runs"] == 2 and out["law_runs"] == int(law["meaningful"].sum())
    assert out["law_r"][0] == pytest.approx(law.loc[law["meaningful"], "corr"].mean())
    good = fit[fit["meaningful"]]
    if len(good):
        assert out["a"][0] == pytest.approx(good["a"].mean())
        assert out["ceiling"][0] == pytest.approx((good["b"] - good["a"]).mean())
    q = t["quadrants"]
    for quad, (agree, n) in out["quadrants"].items():
        rows = q[q["quadrant"] == quad]
        assert (agree, n) == (int(rows["agrees"].sum()), len(rows))
    res = {"regime": "fast", "seeds": 2, "steps": 6, "reduced": True, "cui": {"grpo": out}}
    text = "\n".join(beside.cui_markdown([res], lambda r: r["regime"]))
    assert "## Cui et al.'s covariance law and entropy-performance fit" in text
    assert sum(line.startswith("| fast | grpo |") for line in text.splitlines()) == 1
