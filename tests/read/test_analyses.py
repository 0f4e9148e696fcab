"""Every analysis on hand-built runs whose answers are known by construction (tests/fixture_runs.py)."""

import math

import covlaw_runs
import pandas as pd
import pytest
from fixture_runs import MEAN_ABS_LOG, build

from entropylens.read.query import QueryError, analysis_info, connect, list_analyses, run_analysis


@pytest.fixture(scope="module")
def con(tmp_path_factory):
    return connect(build(tmp_path_factory.mktemp("fixture")))


@pytest.fixture(scope="module")
def law_con(tmp_path_factory):
    """Recorded runs of the Cui et al. laws (tests/covlaw_runs.py): 20 steps, and one of 1 step."""
    root = tmp_path_factory.mktemp("law")
    covlaw_runs.record_run(root, "law-20", 20)
    covlaw_runs.record_run(root, "law-1", 1, seed=1)
    return connect(root)


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
    tested = {n[len("test_") :] for n in globals() if n.startswith("test_")}
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
    assert list(df.columns) == [
        "run",
        "method",
        "quadrant",
        "tokens",
        "clip_low_frac",
        "clip_high_frac",
        "clipped_frac",
    ]
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
    kw = dict(
        mask=torch.ones(2, 3, dtype=torch.bool), advantages=torch.tensor([1.0, -1.0]), logprobs=lp, old_logprobs=lp
    )
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
    from entropylens.record.writing.parquet import write_probes

    df = run_analysis(con, "probe_vs_measured")
    assert df.empty and "predicted_dh" in df.columns
    import shutil

    from fixture_runs import build

    root = build(tmp_path / "r")
    write_probes(
        root / "a",
        1,
        0,
        0,
        [
            {
                "update": 0,
                "part": "step",
                "tokens": 0,
                "grad_norm": 1.0,
                "predicted_dh": -0.01,
                "measured_dh": -0.012,
                "entropy_before": 1.0,
                "optimizer": "Adam",
                "lr": 1e-3,
            },
            {
                "update": 0,
                "part": "PA&LP",
                "tokens": 1,
                "grad_norm": 0.5,
                "predicted_dh": 0.004,
                "measured_dh": None,
                "entropy_before": 1.0,
                "optimizer": "Adam",
                "lr": 1e-3,
            },
        ],
    )
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
    assert pd.isna(row.erc_dropped)  # no ERC: erc_kept is null, so ERC-dropped is not applicable (null, not 0)
    assert len(df) == 6  # a: 2 + 2, b: 2


# ---------------------------------------------------------------------------------- Cui et al. (covlaw)
# A tiny run "cov", step 0, two batches (update 0: 5 tokens; update 1: 2 tokens), log pi = logprob:
#   update 0: A = 2, 1, -1, -1, 0; L = -0.5, -2.5, -0.5, -3.5, -0.5
#     mean A = 1/5 = 0.2, mean L = -7.5/5 = -1.5
#     A - mean A = 1.8, 0.8, -1.2, -1.2, -0.2;  L - mean L = 1, -1, 1, -2, 1
#     c = 1.8, -0.8, -1.2, 2.4, -0.2  (PA&HP, PA&LP, NA&HP, NA&LP, ZA); sum 2.0
#   update 1: A = 1, -1; L = -0.5, -0.5 (PA&HP, NA&HP): L - mean L = 0 -> c = 0, 0
#   step 0: PA&HP 1.8 over 2 tokens (mean 0.9), NA&HP -1.2 over 2 (mean -0.6), step_cov = 2.0 / 7;
#   contribution PA&HP = 1.8 / 7. (Centred over the whole step instead: mean L = -10.5 / 7 = -1.5,
#   mean A = 0.2 / 7, and update 1's tokens would count: PA&HP 1.8 + (1 - 0.2/7)(1) -> not 1.8.)
# Step 1: update 0 only, A = 1, -1, L = -0.5, -2.5: mean A 0, mean L -1.5, c = 1 * 1, -1 * -1 = 1, 1 -> cov 1.
COV_A = {(0, 0): [2.0, 1.0, -1.0, -1.0, 0.0], (0, 1): [1.0, -1.0], (1, 0): [1.0, -1.0]}
COV_L = {(0, 0): [-0.5, -2.5, -0.5, -3.5, -0.5], (0, 1): [-0.5, -0.5], (1, 0): [-0.5, -2.5]}
COV_Q = {(0, 0): [1, 2, 3, 4, 0], (0, 1): [1, 3], (1, 0): [1, 4]}  # PA&HP=1, PA&LP=2, NA&HP=3, NA&LP=4, ZA=0
COV_H = {0: 1.5, 1: 1.2}  # steps' old_entropy_mean


@pytest.fixture(scope="module")
def cov_con(tmp_path_factory):
    import json

    import numpy as np

    from entropylens.record.writing.parquet import write_steps, write_tokens

    root = tmp_path_factory.mktemp("cov")
    d = root / "cov"
    d.mkdir()
    (d / "run.json").write_text(
        json.dumps(
            {
                "run": "cov",
                "method": "grpo",
                "status": "finished",
                "tau": 0.5,
                "schema_version": 1,
                "config": {"method": "grpo"},
            }
        )
    )
    for step in (0, 1):
        updates = [u for (s, u) in COV_A if s == step]
        for u in updates:
            a, lp = np.array(COV_A[step, u], np.float32), np.array(COV_L[step, u], np.float32)
            n = len(a)
            write_tokens(
                d,
                step,
                0,
                u,
                {
                    "update": np.full(n, u, np.int16),
                    "seq": np.arange(n, dtype=np.int32),
                    "group": np.zeros(n, np.int32),
                    "pos": np.zeros(n, np.int32),
                    "token_id": np.zeros(n, np.int32),
                    "logprob": lp,
                    "old_logprob": lp,
                    "advantage": a,
                    "quadrant": np.array(COV_Q[step, u], np.int8),
                },
            )
        write_steps(
            d,
            step,
            0,
            [{"update": u, "n_tokens": len(COV_A[step, u]), "old_entropy_mean": COV_H[step]} for u in updates],
        )
    return connect(root)


def test_covariance_by_quadrant(cov_con):
    df = run_analysis(cov_con, "covariance_by_quadrant")
    assert list(df.columns) == [
        "run",
        "method",
        "step",
        "quadrant",
        "tokens",
        "cov_sum",
        "cov_mean",
        "contribution",
        "step_cov",
    ]
    assert one(df, "cov_sum", step=0, quadrant="PA&HP") == pytest.approx(1.8)
    assert one(df, "tokens", step=0, quadrant="PA&HP") == 2
    assert one(df, "cov_mean", step=0, quadrant="PA&HP") == pytest.approx(0.9)
    assert one(df, "cov_sum", step=0, quadrant="PA&LP") == pytest.approx(-0.8)
    assert one(df, "cov_sum", step=0, quadrant="NA&HP") == pytest.approx(-1.2)
    assert one(df, "cov_mean", step=0, quadrant="NA&HP") == pytest.approx(-0.6)
    assert one(df, "cov_sum", step=0, quadrant="NA&LP") == pytest.approx(2.4)
    assert one(df, "cov_sum", step=0, quadrant="ZA") == pytest.approx(-0.2)
    assert one(df, "contribution", step=0, quadrant="PA&HP") == pytest.approx(1.8 / 7)
    assert set(rows(df, step=0)["step_cov"].round(9)) == {round(2.0 / 7, 9)}
    assert rows(df, step=0)["contribution"].sum() == pytest.approx(2.0 / 7)  # the parts add up
    assert one(df, "step_cov", step=1, quadrant="NA&LP") == pytest.approx(1.0)


def test_covariance_law_by_step(cov_con, law_con):
    import numpy as np

    df = run_analysis(cov_con, "covariance_law_by_step")
    assert one(df, "cov", step=0) == pytest.approx(2.0 / 7)  # = covariance_by_quadrant's step_cov
    assert one(df, "cov", step=1) == pytest.approx(1.0)
    # cov_prob: pi A in place of A, pi = exp(L), centred per batch (numpy on the same tiny table)
    num = 0.0
    for u in (0, 1):
        a, lp = np.array(COV_A[0, u]), np.array(COV_L[0, u])
        pa = np.exp(lp) * a
        num += ((pa - pa.mean()) * (lp - lp.mean())).sum()
    assert one(df, "cov_prob", step=0) == pytest.approx(num / 7, rel=1e-6)
    # measured: 1.2 - 1.5 at step 0 (none after the last step); one step in the fit: scale = -0.3 * -cov / cov^2
    assert one(df, "measured_dh", step=0) == pytest.approx(-0.3, rel=1e-6)
    assert math.isnan(one(df, "measured_dh", step=1))
    assert one(df, "steps", step=0) == 1
    assert one(df, "scale", step=0) == pytest.approx(0.3 / (2.0 / 7), rel=1e-6)
    assert one(df, "predicted_dh", step=0) == pytest.approx(-0.3, rel=1e-6)  # one point: fitted exactly
    # a recorded run of 20 steps (tests/covlaw_runs.py): the per-run correlation and scale equal numpy's
    law = run_analysis(law_con, "covariance_law_by_step")
    g = law[law["run"] == "law-20"].dropna(subset=["measured_dh"])
    x, y = -g["cov"].to_numpy(), g["measured_dh"].to_numpy()
    assert len(g) == 19 and (g["steps"] == 19).all()
    r = np.corrcoef(x, y)[0, 1]
    assert g["corr"].iloc[0] == pytest.approx(r, rel=1e-9)
    assert g["corr_prob"].iloc[0] == pytest.approx(np.corrcoef(-g["cov_prob"], y)[0, 1], rel=1e-9)
    assert g["scale"].iloc[0] == pytest.approx(np.linalg.lstsq(x[:, None], y, rcond=None)[0][0], rel=1e-9)
    assert r > 0.8  # built to follow dH = -ETA Cov: the law's direction, and the scale near ETA
    assert g["scale"].iloc[0] == pytest.approx(covlaw_runs.ETA, rel=0.2)


def test_entropy_performance_fit(law_con):
    import numpy as np

    from entropylens.report.covlaw import fit_entropy_performance

    df = run_analysis(law_con, "entropy_performance_fit")
    g = df[df["run"] == "law-20"]
    # rewards built as B_FIT - A_FIT exp(H_s) (float32 rewards): the fit recovers a and b
    assert len(g) == 20 and (g["steps"] == 20).all()
    assert g["a"].iloc[0] == pytest.approx(covlaw_runs.A_FIT, rel=1e-5)
    assert g["b"].iloc[0] == pytest.approx(covlaw_runs.B_FIT, rel=1e-5)
    assert g["rmse"].iloc[0] < 1e-6 and g["r2"].iloc[0] == pytest.approx(1.0, abs=1e-9)
    assert g["entropy"].to_numpy() == pytest.approx([covlaw_runs.entropy_at(s) for s in range(20)], rel=1e-6)
    # with noise: the SQL fit equals numpy's least squares (polyfit in exp(H)) and the library's
    rng = np.random.default_rng(0)
    h = np.linspace(0.3, 2.0, 40)
    r = 0.9 - 0.05 * np.exp(h) + rng.normal(0, 0.01, 40)
    slope, icpt = np.polyfit(np.exp(h), r, 1)
    fit = fit_entropy_performance(h, r)
    assert (fit.a, fit.b) == pytest.approx((-slope, icpt), rel=1e-9)
    assert fit.a == pytest.approx(0.05, rel=0.1) and fit.b == pytest.approx(0.9, rel=0.02)
    res = r - (icpt + slope * np.exp(h))
    assert fit.rmse == pytest.approx(np.sqrt(np.mean(res**2)), rel=1e-9)
    assert fit.r2 == pytest.approx(np.corrcoef(np.exp(h), r)[0, 1] ** 2, rel=1e-9)
    sql_fit = fit_entropy_performance(g["entropy"], g["reward"])  # the library and the SQL agree on a run
    assert (sql_fit.a, sql_fit.b, sql_fit.n) == pytest.approx((g["a"].iloc[0], g["b"].iloc[0], 20), rel=1e-9)
    # one step: no fit (a, b null), and the run keeps its row
    one_step = df[df["run"] == "law-1"]
    assert len(one_step) == 1 and one_step["steps"].iloc[0] == 1 and one_step["a"].isna().all()


# --- sampler-trainer mismatch (tests/mismatch_runs.py: run m with sampler log-probs, run n without) ----
# the quadrant / share analyses are checked at mismatch=0.1 (t1, t3 mismatched by |d|; t3 also masked)


@pytest.fixture(scope="module")
def mcon(tmp_path_factory):
    import mismatch_runs

    return connect(mismatch_runs.build(tmp_path_factory.mktemp("mismatch")))


def test_mismatch_by_step(mcon):
    df = run_analysis(mcon, "mismatch_by_step")
    assert list(df.columns) == [
        "run",
        "method",
        "step",
        "tokens",
        "mean_abs_log_ratio",
        "max_abs_log_ratio",
        "kl_k1",
        "kl_k3",
        "masked_frac",
        "clipped_mismatched_frac",
    ]
    # tests/mismatch_runs.py's run m: hand-written steps rows without n_sampled: they weigh by n_tokens
    assert one(df, "tokens", run="m", step=0) == 40
    assert one(df, "mean_abs_log_ratio", run="m", step=0) == pytest.approx((10 * 0.1 + 30 * 0.2) / 40)  # 0.175
    assert one(df, "max_abs_log_ratio", run="m", step=0) == pytest.approx(0.9)  # max(0.5, 0.9)
    assert one(df, "masked_frac", run="m", step=0) == pytest.approx((10 * 0 + 30 * 0.1) / 40)  # 0.075
    assert one(df, "mean_abs_log_ratio", run="m", step=1) == pytest.approx(0.1)  # step 1: update 0 alone
    # run n has no sampler log-probs: NULL, never 0
    n = rows(df, run="n")
    assert (
        len(n) == 2
        and n[
            [
                "tokens",
                "mean_abs_log_ratio",
                "max_abs_log_ratio",
                "kl_k1",
                "kl_k3",
                "masked_frac",
                "clipped_mismatched_frac",
            ]
        ]
        .isna()
        .all()
        .all()
    )


# Two updates of one step whose counts differ: update 0 has 10 tokens, all scored by the sampler, 4 of them
# clipped (clipped_frac 0.4), 1 of those mismatched; update 1 has 30 tokens of which the sampler scored 6, 3
# clipped (clipped_frac 0.1) of which 2 scored, both mismatched. Step 1: an update without clipped tokens
# (its clipped_mismatched_frac NULL) beside one with 2 clipped, 1 mismatched.
POOL_ROWS = {
    0: [
        {
            "update": 0,
            "n_tokens": 10,
            "n_sampled": 10,
            "n_sampled_clipped": 4,
            "clipped_frac": 0.4,
            "sampler_abs_log_ratio_mean": 0.1,
            "sampler_abs_log_ratio_max": 0.5,
            "sampler_kl_k1": 0.01,
            "sampler_kl_k3": 0.02,
            "is_masked_frac": 0.0,
            "clipped_mismatched_frac": 0.25,
        },
        {
            "update": 1,
            "n_tokens": 30,
            "n_sampled": 6,
            "n_sampled_clipped": 2,
            "clipped_frac": 0.1,
            "sampler_abs_log_ratio_mean": 0.2,
            "sampler_abs_log_ratio_max": 0.9,
            "sampler_kl_k1": 0.03,
            "sampler_kl_k3": 0.04,
            "is_masked_frac": 0.1,
            "clipped_mismatched_frac": 1.0,
        },
    ],
    1: [
        {
            "update": 0,
            "n_tokens": 20,
            "n_sampled": 20,
            "n_sampled_clipped": 0,
            "clipped_frac": 0.0,
            "sampler_abs_log_ratio_mean": 0.1,
            "sampler_kl_k3": 0.02,
            "clipped_mismatched_frac": None,
        },
        {
            "update": 1,
            "n_tokens": 20,
            "n_sampled": 20,
            "n_sampled_clipped": 2,
            "clipped_frac": 0.1,
            "sampler_abs_log_ratio_mean": 0.3,
            "sampler_kl_k3": 0.04,
            "clipped_mismatched_frac": 0.5,
        },
    ],
}


def _pool_runs(root):
    """Run "w": POOL_ROWS as the recorder writes them (with the counts); run "h": the same rows written by
    hand without n_sampled / n_sampled_clipped."""
    import json

    from entropylens.record.writing.parquet import write_steps

    for run, drop in (("w", ()), ("h", ("n_sampled", "n_sampled_clipped"))):
        d = root / run
        d.mkdir(parents=True)
        (d / "run.json").write_text(
            json.dumps(
                {"run": run, "method": "grpo", "status": "finished", "schema_version": 4, "config": {"method": "grpo"}}
            )
        )
        for step, rs in POOL_ROWS.items():
            write_steps(d, step, 0, [{k: v for k, v in r.items() if k not in drop} for r in rs])
    return connect(root)


def test_mismatch_by_step_weighs_each_update_by_its_own_count(tmp_path):
    con = _pool_runs(tmp_path)
    df = run_analysis(con, "mismatch_by_step")
    # run w, step 0: the means are over the tokens with a sampler log-prob, 10 + 6 = 16 of the step's 40:
    #   mean_abs_log_ratio = (10 x 0.1 + 6 x 0.2) / 16 = 2.2 / 16 = 0.1375   (by n_tokens: 7 / 40 = 0.175)
    #   kl_k1 = (10 x 0.01 + 6 x 0.03) / 16 = 0.28 / 16 = 0.0175             (by n_tokens: 0.025)
    #   kl_k3 = (10 x 0.02 + 6 x 0.04) / 16 = 0.44 / 16 = 0.0275             (by n_tokens: 0.035)
    # clipped_mismatched_frac: mismatched / clipped tokens with a sampler log-prob = (1 + 2) / (4 + 2):
    #   (4 x 0.25 + 2 x 1.0) / 6 = 3 / 6 = 0.5                               (by n_tokens: 32.5 / 40 = 0.8125)
    # masked_frac is a share of all tokens: (10 x 0 + 30 x 0.1) / 40 = 0.075
    assert one(df, "tokens", run="w", step=0) == 40
    assert one(df, "mean_abs_log_ratio", run="w", step=0) == pytest.approx(0.1375)
    assert one(df, "kl_k1", run="w", step=0) == pytest.approx(0.0175)
    assert one(df, "kl_k3", run="w", step=0) == pytest.approx(0.0275)
    assert one(df, "clipped_mismatched_frac", run="w", step=0) == pytest.approx(0.5)
    assert one(df, "masked_frac", run="w", step=0) == pytest.approx(0.075)
    assert one(df, "max_abs_log_ratio", run="w", step=0) == pytest.approx(0.9)
    # step 1: update 0 has no clipped token (share NULL): it counts nothing -> 1 / 2 = 0.5 (a 0 share weighed by
    # n_tokens would give (20 x 0 + 20 x 0.5) / 40 = 0.25); the means weigh 20 and 20: (0.1 + 0.3) / 2 = 0.2
    assert one(df, "clipped_mismatched_frac", run="w", step=1) == pytest.approx(0.5)
    assert one(df, "mean_abs_log_ratio", run="w", step=1) == pytest.approx(0.2)
    # run h (no counts): n_tokens for the means, round(clipped_frac x n_tokens) = 4 and 3 clipped tokens for the
    # share, exact where the sampler scored every token:
    #   mean_abs_log_ratio = (10 x 0.1 + 30 x 0.2) / 40 = 0.175; clipped_mismatched_frac = (4 x 0.25 + 3 x 1) / 7
    assert one(df, "mean_abs_log_ratio", run="h", step=0) == pytest.approx(0.175)
    assert one(df, "clipped_mismatched_frac", run="h", step=0) == pytest.approx(4 / 7)
    # step_health's sampler_kl (the mismatch alarm's input) pools k3 the same way: 0.0275 (by n_tokens 0.035)
    health = run_analysis(con, "step_health")
    assert one(health, "sampler_kl", run="w", step=0) == pytest.approx(0.0275)
    assert one(health, "sampler_kl", run="h", step=0) == pytest.approx((10 * 0.02 + 30 * 0.04) / 40)  # 0.035


def _mismatch_quadrant_checks(df, per):
    import math as m

    # per = rows per token in a group (run-wide: 3 rows each, step 0: 2); delta t0..t3 = 0, .2, -.05, .3
    for q, d in (("PA&HP", 0.0), ("PA&LP", 0.2), ("NA&LP", -0.05), ("NA&HP", 0.3)):
        assert one(df, "sampled", quadrant=q, run="m") == per
        assert one(df, "mean_abs_log_ratio", quadrant=q, run="m") == pytest.approx(abs(d), abs=1e-6)
        assert one(df, "kl_k1", quadrant=q, run="m") == pytest.approx(-d, abs=1e-6)
        # k3 = exp(d) - 1 - d: t1 e^.2 - 1.2 = 0.0214028; t3 e^.3 - 1.3 = 0.0498588
        assert one(df, "kl_k3", quadrant=q, run="m") == pytest.approx(m.exp(d) - 1 - d, abs=1e-6)
        assert one(df, "mismatched_frac", quadrant=q, run="m") == (1.0 if abs(d) > 0.1 else 0.0)
    assert one(df, "masked_frac", quadrant="NA&HP", run="m") == 1.0  # t3 masked by the IS correction
    assert one(df, "masked_frac", quadrant="PA&LP", run="m") == 0.0
    # the clipped tokens t1 (PA&LP, mismatched) and t2 (NA&LP, |d| = .05: not)
    assert one(df, "clipped", quadrant="PA&LP", run="m") == per
    assert one(df, "clipped_mismatched_frac", quadrant="PA&LP", run="m") == 1.0
    assert one(df, "clipped_mismatched_frac", quadrant="NA&LP", run="m") == 0.0
    assert pd_isna(one(df, "clipped_mismatched_frac", quadrant="NA&HP", run="m"))  # none clipped there
    assert one(df, "unclipped_mismatched_frac", quadrant="NA&HP", run="m") == 1.0
    # entropy_effect t0..t3 = -0.1, 0, 0, 0.3: the mismatched NA&HP token t3 carries all its quadrant's
    assert one(df, "effect_mismatched", quadrant="NA&HP", run="m") == pytest.approx(0.3 * per)
    assert one(df, "abs_effect_mismatched_share", quadrant="NA&HP", run="m") == pytest.approx(1.0)
    assert one(df, "abs_effect", quadrant="PA&HP", run="m") == pytest.approx(0.1 * per)  # |-0.1| per row
    assert one(df, "abs_effect_mismatched_share", quadrant="PA&HP", run="m") == pytest.approx(0.0)
    n = rows(df, run="n")
    assert len(n) == 4 and (n["sampled"] == 0).all()
    assert (
        n[
            [
                "mean_abs_log_ratio",
                "kl_k1",
                "kl_k3",
                "mismatched_frac",
                "masked_frac",
                "clipped",
                "clipped_mismatched_frac",
                "effect",
                "abs_effect",
                "abs_effect_mismatched_share",
            ]
        ]
        .isna()
        .all()
        .all()
    )


def pd_isna(v):
    import pandas as pd

    return bool(pd.isna(v))


def test_mismatch_by_quadrant(mcon):
    df = run_analysis(mcon, "mismatch_by_quadrant", mismatch=0.1)
    _mismatch_quadrant_checks(df, per=3)  # steps 0 (updates 0, 1) and 1: each token three times
    assert one(df, "tokens", run="n", quadrant="PA&HP") == 3
    # a lower threshold makes t2 (|d| = 0.05) mismatched too
    low = run_analysis(mcon, "mismatch_by_quadrant", mismatch=0.01)
    assert one(low, "clipped_mismatched_frac", quadrant="NA&LP", run="m") == 1.0
    with pytest.raises(QueryError, match="mismatch"):
        run_analysis(mcon, "mismatch_by_quadrant", mismatch=-1)
    # the default is steps.clipped_mismatched_frac's: |d| > ln 2 or masked by the IS correction: t3 alone
    d = run_analysis(mcon, "mismatch_by_quadrant")
    assert one(d, "mismatched_frac", quadrant="NA&HP", run="m") == 1.0  # t3: |0.3| < ln 2, but masked
    assert one(d, "mismatched_frac", quadrant="PA&LP", run="m") == 0.0  # t1: 0.2 < ln 2
    assert one(d, "clipped_mismatched_frac", quadrant="PA&LP", run="m") == 0.0


def test_mismatch_by_quadrant_by_step(mcon):
    df = run_analysis(mcon, "mismatch_by_quadrant_by_step", mismatch=0.1)
    _mismatch_quadrant_checks(df[df["step"] == 0], per=2)  # step 0: updates 0 and 1
    assert one(df, "sampled", run="m", step=1, quadrant="PA&LP") == 1


def test_mismatch_shares_by_step(mcon):
    df = run_analysis(mcon, "mismatch_shares_by_step", mismatch=0.1)
    # step 0 of run m: t0..t3 at updates 0 and 1 (8 rows); mismatched (|d| > 0.1): t1, t3 -> 4 of 8
    assert one(df, "sampled", run="m", step=0) == 8 and one(df, "mismatched_frac", run="m", step=0) == 0.5
    # clipped t1 (mismatched), t2 (not): 2 of 4 clipped rows; the others t0 (not), t3 (mismatched): 2 of 4
    assert one(df, "clipped", run="m", step=0) == 4
    assert one(df, "clipped_mismatched_frac", run="m", step=0) == 0.5
    assert one(df, "unclipped_mismatched_frac", run="m", step=0) == 0.5
    # entropy_effect -0.1, 0, 0, 0.3 per update: effect 2 x 0.2 = 0.4; mismatched t1 + t3: 2 x 0.3 = 0.6
    assert one(df, "effect", run="m", step=0) == pytest.approx(0.4)
    assert one(df, "effect_mismatched", run="m", step=0) == pytest.approx(0.6)
    assert one(df, "abs_effect_mismatched_share", run="m", step=0) == pytest.approx(0.6 / 0.8)
    n = rows(df, run="n")
    assert (
        len(n) == 2
        and (n["sampled"] == 0).all()
        and n[["mismatched_frac", "clipped", "effect", "abs_effect_mismatched_share"]].isna().all().all()
    )
    # the report's figure pools mismatch_by_quadrant_by_step's rows (plots.mismatch_pooled) to the same shares
    from entropylens.report.plots import mismatch_pooled

    q = run_analysis(mcon, "mismatch_by_quadrant_by_step", mismatch=0.1)
    for step in (0, 1):
        p = mismatch_pooled(q[(q["run"] == "m") & (q["step"] == step)]).iloc[0]
        for a, b in (
            ("clipped_mm", "clipped_mismatched_frac"),
            ("unclipped_mm", "unclipped_mismatched_frac"),
            ("effect_mm", "abs_effect_mismatched_share"),
            ("mismatched", "mismatched_frac"),
        ):
            assert p[a] == pytest.approx(one(df, b, run="m", step=step)), (step, a)
