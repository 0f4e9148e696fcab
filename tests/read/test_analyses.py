"""Every analysis on hand-built runs whose answers are known by construction (tests/fixture_runs.py)."""

import math

import pytest

from entropylens.read.query import QueryError, analysis_info, connect, list_analyses, run_analysis
from fixture_runs import MEAN_ABS_LOG, build


@pytest.fixture(scope="module")
def con(tmp_path_factory):
    return connect(build(tmp_path_factory.mktemp("fixture")))


def rows(df, **where):
    for k, v in where.items():
        df = df[df[k].isna()] if v is None else df[df[k] == v]
    return df


def one(df, col, **where):
    r = rows(df, **where)
    assert len(r) == 1, (where, r)
    return r[col].iloc[0]


def test_every_sql_file_has_a_header_and_is_tested():
    info = analysis_info()
    tested = {n[len("test_"):] for n in globals() if n.startswith("test_")}
    for name, head in info.items():
        assert head.get("title") and head.get("columns") and head.get("figure") and "params" in head, name
        assert name in tested, f"analysis {name} has no test"
    assert [n for n, _ in list_analyses()] == sorted(info)


def test_entropy_by_step(con):
    df = run_analysis(con, "entropy_by_step")
    assert one(df, "old_entropy", run="a", step=0) == pytest.approx(1.75)  # (10*1 + 30*2) / 40
    assert one(df, "tokens", run="a", step=0) == 40
    assert one(df, "old_entropy", run="a", step=1) == pytest.approx(1.0)
    assert list(df.columns) == ["run", "method", "step", "entropy", "old_entropy", "tokens"]


def test_quadrant_share_by_step(con):
    df = run_analysis(con, "quadrant_share_by_step")
    # step 0 of run a: two update rows, each 1 token per quadrant, n_tokens 10 + 30 -> 2 / 40
    assert one(df, "tokens", run="a", step=0, quadrant="PA&LP") == 2
    assert one(df, "share", run="a", step=0, quadrant="PA&LP") == pytest.approx(2 / 40)
    assert one(df, "share", run="a", step=0, quadrant="ZA") == 0


def test_clip_by_quadrant(con):
    df = run_analysis(con, "clip_by_quadrant")  # the whole run: no step column, nothing to double-count
    assert list(df.columns) == ["run", "method", "quadrant", "tokens", "clip_low_frac", "clip_high_frac",
                                "clipped_frac"]
    assert one(df, "clip_high_frac", run="a", quadrant="PA&LP") == 1.0
    assert one(df, "tokens", run="a", quadrant="PA&LP") == 3
    assert one(df, "clip_low_frac", run="a", quadrant="NA&LP") == 1.0
    assert one(df, "clipped_frac", run="a", quadrant="PA&HP") == 0.0
    assert one(df, "tokens", run="b", quadrant="NA&HP") == 1


def test_clip_by_quadrant_by_step(con):
    per_step = run_analysis(con, "clip_by_quadrant_by_step")
    assert per_step["step"].notna().all()
    assert one(per_step, "tokens", run="a", step=0, quadrant="NA&HP") == 2
    # summing the per-step rows gives the whole-run count (the per-step and whole-run analyses agree)
    total = per_step.groupby(["run", "quadrant"])["tokens"].sum()
    whole = run_analysis(con, "clip_by_quadrant").set_index(["run", "quadrant"])["tokens"]
    assert (total.sort_index() == whole.sort_index()).all()


def test_ratio_vs_prob(con):
    df = run_analysis(con, "ratio_vs_prob", points=2)
    assert len(rows(df, run="a")) == 2 and len(rows(df, run="b")) == 2
    assert set(df["eps_low"]) == {0.2}
    full = run_analysis(con, "ratio_vs_prob")
    assert len(full) == 12 + 4
    t1 = full[(full["prob"].round(4) == 0.15) & (full["quadrant"] == "PA&LP")]
    assert t1["ratio"].round(5).unique().tolist() == [1.5] and t1["clipped"].all()


def test_clipped_prob_distribution(con):
    df = run_analysis(con, "clipped_prob_distribution")
    # run a: clipped high = t1 x3 (p 0.15 -> bin 1), clipped low = t2 x3 (p 0.12 -> bin 1)
    assert one(df, "tokens", run="a", side="high", bin=1) == 3
    assert one(df, "share", run="a", side="low", bin=1) == 1.0
    assert one(df, "lp_share", run="a", side="low", bin=1) == 1.0
    df5 = run_analysis(con, "clipped_prob_distribution", bins=5)
    assert one(df5, "prob_hi", run="a", side="high", bin=0) == pytest.approx(0.2)


def test_clipped_prob_distribution_uses_the_runs_own_tau(tmp_path):
    # run a again with tau 0.13 in run.json: clipped low t2 (p 0.12 < 0.13) is LP -> lp_share 1;
    # clipped high t1 (p 0.15 >= 0.13) is HP -> lp_share 0. (A fixed tau of 0.5 would give 1 and 1.)
    import json

    root = build(tmp_path)
    info = json.loads((root / "a" / "run.json").read_text())
    (root / "a" / "run.json").write_text(json.dumps({**info, "tau": 0.13}))
    df = run_analysis(connect(root), "clipped_prob_distribution")
    assert one(df, "lp_share", run="a", side="low", bin=1) == 1.0
    assert one(df, "lp_share", run="a", side="high", bin=1) == 0.0
    assert one(df, "lp_share", run="b", side="high", bin=1) == 1.0  # run b keeps tau 0.5


def test_grad_share_by_quadrant(con):
    df = run_analysis(con, "grad_share_by_quadrant")
    # step 0 of run a: grad_sq PA&HP 1+1, PA&LP 4+4, NA&LP 9+9, NA&HP 1+1 -> total 30
    assert one(df, "grad_sq", run="a", step=0, quadrant="NA&LP") == pytest.approx(18)
    assert one(df, "share", run="a", step=0, quadrant="PA&LP") == pytest.approx(8 / 30)
    assert one(df, "clipped_share", run="a", step=0, quadrant="PA&LP") == 1.0
    assert one(df, "clipped_share", run="a", step=0, quadrant="PA&HP") == 0.0


def test_entropy_ratio_by_step(con):
    df = run_analysis(con, "entropy_ratio_by_step")
    # step 0 of run a: rho = 1, 1.2, 0.9, 1 (u0) and 0.8, 1.5, 0.7, 1.2 (u1): 6 of 8 outside (0.95, 1.05)
    assert one(df, "outside_band", run="a", step=0) == pytest.approx(0.75)
    assert one(df, "p50", run="a", step=0) == pytest.approx(1.0)
    wide = run_analysis(con, "entropy_ratio_by_step", band_low=0.6, band_high=1.6)
    assert one(wide, "outside_band", run="a", step=0) == 0.0


def test_drift_by_prob_bin(con):
    df = run_analysis(con, "drift_by_prob_bin")
    for b, expected in MEAN_ABS_LOG.items():
        assert one(df, "mean_abs_log_ratio", run="a", bin=b) == pytest.approx(expected, rel=1e-5)
    assert one(df, "tokens", run="a", bin=1) == 6


def test_grad_norm_by_step(con):
    df = run_analysis(con, "grad_norm_by_step")
    assert one(df, "grad_norm", run="a", step=0) == pytest.approx(3.0)  # mean of 2 and 4
    assert one(df, "grad_norm_max", run="a", step=0) == pytest.approx(4.0)


def test_kl_by_step(con):
    df = run_analysis(con, "kl_by_step")
    assert one(df, "kl", run="a", step=0) == pytest.approx((10 * 0.01 + 30 * 0.03) / 40)


def test_reward_by_step(con):
    df = run_analysis(con, "reward_by_step")
    assert one(df, "reward", run="a", step=0) == pytest.approx(0.5)
    assert one(df, "reward", run="a", step=1) == pytest.approx((0.25 + 0.85) / 2)
    assert one(df, "sequences", run="b", step=0) == 2


def test_entropy_change_by_quadrant(con):
    df = run_analysis(con, "entropy_change_by_quadrant")
    # run a, step 0: next-update dH = t0 -0.1, t1 +0.3, t2 -0.2, t3 +0.4; mean 0.1
    assert one(df, "mean_dh", run="a", quadrant="PA&HP") == pytest.approx(-0.1, abs=1e-6)
    assert one(df, "relative_dh", run="a", quadrant="NA&HP") == pytest.approx(0.3, abs=1e-6)
    assert one(df, "tokens", run="a", quadrant="PA&LP") == 1
    assert rows(df, run="a")["agrees"].all()
    assert one(df, "predicted_sign", run="a", quadrant="NA&LP") == -1
    # run b sees each token once, at update 0 only: no drift to measure
    assert rows(df, run="b").empty


def test_run_summary(con):
    df = run_analysis(con, "run_summary")
    assert one(df, "steps", run="a") == 2
    assert one(df, "final_entropy", run="a") == pytest.approx(1.0)  # step 1
    assert one(df, "min_entropy", run="a") == pytest.approx(1.0)
    assert one(df, "clip_low_frac", run="a") == pytest.approx(0.25)
    assert one(df, "method", run="b") == "ce_gppo"


def test_run_summary_counts_scalar_only_steps(tmp_path):
    """A run that logs only scalars (record_step, no updates) has steps: 3, not 0."""
    from entropylens import Recorder
    from entropylens.read.query import connect

    with Recorder(tmp_path, run="s") as rec:
        for step in range(3):
            rec.record_step(step, lr=0.1, reward_mean=0.5 + step)
    df = run_analysis(connect(tmp_path), "run_summary")
    assert one(df, "steps", run="s") == 3 and one(df, "tokens", run="s") == 0
    assert one(df, "final_reward", run="s") == pytest.approx(2.5)


def test_run_summary_entropy_falls_back_to_the_current_policy_entropy(tmp_path):
    """A run that records only entropy= (no old_entropy) still has a final and minimum entropy: the
    token-weighted mean of the last step (0.8) and of the lowest step (0.5); a run with both uses old_entropy."""
    import torch

    from entropylens import Recorder
    from entropylens.read.query import connect

    lp = torch.full((2, 3), -1.0)
    kw = dict(mask=torch.ones(2, 3, dtype=torch.bool), advantages=torch.tensor([1.0, -1.0]), logprobs=lp,
              old_logprobs=lp)
    with Recorder(tmp_path, run="cur") as rec:
        for step, h in enumerate((0.5, 0.8)):
            rec.record_update(step, 0, entropy=torch.full((2, 3), h), **kw)
    with Recorder(tmp_path, run="both") as rec:
        rec.record_update(0, 0, entropy=torch.full((2, 3), 0.9), old_entropy=torch.full((2, 3), 0.3), **kw)
    df = run_analysis(connect(tmp_path), "run_summary")
    assert one(df, "final_entropy", run="cur") == pytest.approx(0.8)
    assert one(df, "min_entropy", run="cur") == pytest.approx(0.5)
    assert one(df, "final_entropy", run="both") == pytest.approx(0.3)


def test_errors(con, tmp_path):
    with pytest.raises(QueryError, match="unknown analysis 'nope'"):
        run_analysis(con, "nope")
    with pytest.raises(QueryError, match="has no parameter zz"):
        run_analysis(con, "drift_by_prob_bin", zz=1)
    with pytest.raises(QueryError, match="not a number"):
        run_analysis(con, "drift_by_prob_bin", bins="1; DROP TABLE x")
    with pytest.raises(QueryError, match="path does not exist"):
        connect(tmp_path / "missing")
    with pytest.raises(QueryError, match="no entropylens run"):
        connect(tmp_path)
    assert math.isfinite(run_analysis(con, "kl_by_step")["kl"].sum())


def test_entropy_budget_by_step(con):
    # steps rows carry the fixture's BUDGET per update; run a step 0 has two updates: sums double
    df = run_analysis(con, "entropy_budget_by_step")
    assert set(rows(df, run="a", step=0)["quadrant"]) == {"PA&HP", "PA&LP", "NA&HP", "NA&LP"}
    assert one(df, "effect", run="a", step=0, quadrant="PA&HP") == pytest.approx(-0.2)
    assert one(df, "effect", run="a", step=0, quadrant="NA&HP") == pytest.approx(0.6)
    assert one(df, "dropped", run="a", step=0, quadrant="PA&LP") == pytest.approx(0.8)
    assert one(df, "dropped", run="a", step=1, quadrant="NA&LP") == pytest.approx(-0.2)
    assert one(df, "step_dropped", run="a", step=0, quadrant="PA&LP") == pytest.approx(0.4)
    assert one(df, "dropped_clip_low", run="b", step=0, quadrant="NA&LP") == pytest.approx(-0.2)
    assert one(df, "dropped_clip_high", run="b", step=0, quadrant="NA&LP") == pytest.approx(0.4)
    assert math.isnan(one(df, "dropped_erc", run="b", step=0, quadrant="NA&LP"))  # no ERC: null
    assert math.isnan(one(df, "dropped_dual_clip", run="b", step=0, quadrant="NA&LP"))  # no dual-clip: null


def test_entropy_budget_by_prob_bin(con):
    # run a: 3 rows of each token. t0 (PA, p 0.95, bin 9) effect -0.1 x 3; t1 (PA, bin 1) dropped 0.4 x 3;
    # t2 (NA, bin 1) dropped -0.2 x 3; t3 (NA, bin 8) effect 0.3 x 3
    df = run_analysis(con, "entropy_budget_by_prob_bin")
    assert one(df, "effect", run="a", sign="PA", bin=9) == pytest.approx(-0.3)
    assert one(df, "dropped", run="a", sign="PA", bin=9) == 0
    assert one(df, "changed", run="a", sign="PA", bin=1) == 3
    assert one(df, "dropped", run="a", sign="PA", bin=1) == pytest.approx(1.2)
    assert one(df, "dropped", run="a", sign="NA", bin=1) == pytest.approx(-0.6)
    assert one(df, "effect_per_token", run="a", sign="NA", bin=8) == pytest.approx(0.3)
    assert one(df, "tokens", run="b", sign="NA", bin=8) == 1


def test_probe_vs_measured(con, tmp_path):
    # the fixture has no probes: an empty result with the header's columns; with a probes file, its rows
    from entropylens.record.writer import write_probes

    df = run_analysis(con, "probe_vs_measured")
    assert df.empty and "predicted_dh" in df.columns
    import shutil

    from fixture_runs import build

    root = build(tmp_path / "r")
    write_probes(root / "a", 1, 0, 0, [
        {"update": 0, "part": "step", "tokens": 0, "grad_norm": 1.0, "predicted_dh": -0.01, "measured_dh": -0.012,
         "entropy_before": 1.0, "optimizer": "Adam", "lr": 1e-3},
        {"update": 0, "part": "PA&LP", "tokens": 1, "grad_norm": 0.5, "predicted_dh": 0.004, "measured_dh": None,
         "entropy_before": 1.0, "optimizer": "Adam", "lr": 1e-3}])
    df = run_analysis(connect(root), "probe_vs_measured")
    assert one(df, "measured_dh", run="a", part="step") == pytest.approx(-0.012)
    assert one(df, "predicted_dh", run="a", part="PA&LP") == pytest.approx(0.004)
    assert math.isnan(one(df, "measured_dh", run="a", part="PA&LP"))
    shutil.rmtree(root)


def test_step_health(con):
    # run a step 0: updates of 10 and 30 tokens, old entropy 1 and 2 -> 1.75; KL 0.01 / 0.03 -> 0.025;
    # grad norm mean(2, 4) = 3; entropy budget BUDGET["entropy_effect"] 0.2 per update -> 0.4
    df = run_analysis(con, "step_health")
    assert one(df, "old_entropy", run="a", step=0) == pytest.approx(1.75)
    assert one(df, "kl", run="a", step=0) == pytest.approx(0.025)
    assert one(df, "grad_norm", run="a", step=0) == pytest.approx(3.0)
    assert one(df, "entropy_effect", run="a", step=0) == pytest.approx(0.4)
    assert math.isnan(one(df, "erc_drop_frac", run="a", step=0))


def test_responses(con):
    """Fixture run a, step 0 (updates 0 and 1), sequence 0 = tokens t0 (p 0.95, PA&HP, inside) and t1 (p 0.15,
    PA&LP, clipped high): clipped = t1 at both updates = 2; mean_entropy = mean old_entropy over the 4 token
    rows = (0.5 + 1.0 + 0.5 + 1.0) / 4 = 0.75; entropy_effect = 2 x (-0.1 + 0) = -0.2; dropped = 2 x 0.4 = 0.8
    (t0's null is left out); reward 0.25 from sequences."""
    df = run_analysis(con, "responses")
    row = df[(df.run == "a") & (df.step == 0) & (df.seq == 0)].iloc[0]
    assert (row.gen_step, row.reward, row.length, row.tokens, row.updates, row.clipped) == (0, 0.25, 2, 2, 2, 2)
    assert row.mean_entropy == pytest.approx(0.75) and row.max_entropy == pytest.approx(1.0)
    assert row.entropy_effect == pytest.approx(-0.2) and row.entropy_effect_dropped == pytest.approx(0.8)
    assert row.erc_dropped == 0  # no ERC: erc_kept is null, nothing dropped
    assert len(df) == 6  # a: 2 + 2, b: 2
