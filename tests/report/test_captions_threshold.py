"""Captions state the runs' HP / LP threshold tau, and the entropy caption compares every method."""

import pandas as pd

from entropylens.report import captions, runset
from entropylens.report.figures import figure


def _entropy_df():
    rows = []
    # 10 steps per method; the last step (the last 10%) at 0.30 + a per-method offset
    for m, last in (("grpo", 0.30), ("dapo", 0.31), ("ce_gppo", 0.50), ("erc_dapo", 0.45)):
        for s in range(10):
            rows.append({"run": f"{m}-s0", "method": m, "step": s, "old_entropy": 1.0 if s < 9 else last})
    return pd.DataFrame(rows)


def test_entropy_caption_compares_every_method_of_the_run_set():
    text = captions.entropy(_entropy_df())
    tail = text[text.index("last 10% of steps") :]
    for m, v in (("ce_gppo", "0.5"), ("dapo", "0.31"), ("erc_dapo", "0.45"), ("grpo", "0.3")):
        assert f"{m}-s0 {v}" in tail, text  # ERC included; one entry per run
    assert "CE-GPPO is above GRPO / DAPO" in text  # no config recorded: the runs differ only in the method
    only = captions.entropy(_entropy_df().query("method in ['erc_dapo', 'dapo']"))  # no CE-GPPO: still compared
    assert "last 10% of steps: dapo-s0 0.31; erc_dapo-s0 0.45." in only


def test_entropy_caption_calls_a_small_gap_level():
    df = _entropy_df()
    # CE-GPPO's tail 0.318 against DAPO's 0.31: a gap of 0.008 nats, 2.6% of 0.31 (under the 5% of LEVEL)
    df.loc[(df.method == "ce_gppo") & (df.step == 9), "old_entropy"] = 0.318
    text = captions.entropy(df)
    # compared with the higher of GRPO (0.30) and DAPO (0.31): it names DAPO
    assert (
        "CE-GPPO's lowest is above the higher of GRPO / DAPO (dapo-s0 0.31) by only 0.008 nats (under 5%): level"
    ) in text, text
    assert "the paper's direction" not in text
    # 0.33 against 0.31: a gap of 0.02, 6.5%: above
    df.loc[(df.method == "ce_gppo") & (df.step == 9), "old_entropy"] = 0.33
    assert "CE-GPPO is above GRPO / DAPO, the paper's direction" in captions.entropy(df)


def _rs(taus: dict):
    """The report's RunSet of runs with these taus (method grpo)."""
    runs = pd.DataFrame(
        {
            "run": list(taus),
            "method": "grpo",
            "config": None,
            "tau": list(taus.values()),
            "eps_low": 0.2,
            "eps_high": 0.2,
        }
    )
    return runset.build(runs)


def test_captions_state_tau():
    assert captions.tau_text(_rs({"a": 0.5, "b": 0.5})) == "tau = 0.5"
    assert captions.tau_text(_rs({"b": 0.3, "a": 0.5})) == "tau: a (grpo) 0.5, b (grpo) 0.3"
    assert captions.tau_text({"a": 0.5, "b": 0.5}) == "tau = 0.5"
    assert captions.tau_text({"b": 0.3, "a": 0.5}) == "tau = 0.5 (a), 0.3 (b)"
    assert captions.tau_text({}) == "tau"
    clipped = pd.DataFrame(
        {
            "run": ["a", "a"],
            "method": ["grpo", "grpo"],
            "side": ["low", "high"],
            "bin": [0, 1],
            "prob_lo": [0.0, 0.5],
            "prob_hi": [0.5, 1.0],
            "tokens": [3, 1],
            "share": [1.0, 1.0],
            "lp_share": [1.0, 0.0],
        }
    )
    assert "clipped tokens with p < tau = 0.3: a (grpo) 100.0% of 3 low-side" in figure("clipped_prob").observe(
        clipped, _rs({"a": 0.3})
    )
    quad = pd.DataFrame(
        {
            "run": "a",
            "method": "grpo",
            "step": 0,
            "quadrant": ["PA&HP", "PA&LP"],
            "tokens": [3, 1],
            "share": [0.75, 0.25],
        }
    )
    assert "LP: p < tau = 0.3" in figure("quadrant_share").observe(quad, _rs({"a": 0.3}))
    # ratio_vs_prob splits at each run's own tau: p = 0.4 is HP under tau = 0.3
    pts = pd.DataFrame({"run": "a", "prob": [0.2, 0.4], "ratio": [2.0, 1.0], "eps_low": 0.2, "eps_high": 0.2})
    text = figure("ratio_vs_prob").observe(pts, _rs({"a": 0.3}))
    assert "p < tau = 0.3 vs p >= tau: a (grpo) 100.0% vs 0.0%" in text


def test_report_captions_state_the_runs_tau(tmp_path):
    from fixture_runs import build

    from entropylens.report.build import write_report

    runs = build(tmp_path / "runs")  # tau = 0.5 in both runs
    md = (write_report(runs, tmp_path / "rep").parent / "report.md").read_text()
    for analysis in (
        "quadrant_share_by_step",
        "clip_by_quadrant",
        "clipped_prob_distribution",
        "grad_share_by_quadrant",
        "ratio_vs_prob",
    ):
        line = next(x for x in md.splitlines() if f"(analysis: `{analysis}`)" in x)
        assert "tau = 0.5" in line, line


def test_clip_caption_with_no_clipped_token_draws_no_conclusion():
    # a run where nothing was clipped: "low 0.0% vs high 0.0%" is not read as differing from the paper
    df = pd.DataFrame(
        {
            "quadrant": ["PA&HP", "PA&LP", "NA&HP", "NA&LP"],
            "tokens": [10, 5, 8, 2],
            "clipped_frac": [0.0, 0.0, 0.0, 0.0],
        }
    )
    text = captions.clip_by_quadrant(df, _rs({"a": 0.5}))
    assert "No token was clipped in these runs" in text and "differs from the paper" not in text
    # one clipped low-probability token (PA&LP: 1 of 5; NA&LP none): low 1/7 = 14.3% against high 0%: no remark
    df.loc[1, "clipped_frac"] = 0.2
    text = captions.clip_by_quadrant(df, _rs({"a": 0.5}))
    assert "14.3% vs 0.0%" in text and "differs" not in text and "No token" not in text


def test_entropy_budget_caption_explains_a_sign_by_p_against_exp_minus_h():
    """A run at H = 3.5 nats (exp(-H) = 0.0302) split at tau = 0.5: PA&LP tokens (p in [0.03, 0.5)) lie above
    exp(-H) and lower entropy, against the law's + for PA&LP: the caption says why."""
    rows = [
        {
            "run": "a",
            "method": "grpo",
            "step": s,
            "quadrant": q,
            "effect": e,
            "dropped": 0.0,
            "step_effect": -0.4,
            "entropy": 3.5,
        }
        for s in range(2)
        for q, e in (("PA&HP", -0.1), ("PA&LP", -0.2), ("NA&HP", 0.1), ("NA&LP", -0.2))
    ]
    text = captions.entropy_budget(pd.DataFrame(rows), _rs({"a": 0.5}))
    assert "law's sign in 3 of 4" in text, text
    assert "-delta p_a (log p_a + H)" in text and "exp(-H) = 0.0302, below tau = 0.5" in text, text
    assert "between 0.0302 and 0.5 are LP by tau" in text
    agree = [dict(r, effect=-r["effect"]) if r["quadrant"] == "PA&LP" else r for r in rows]
    assert "Why the signs differ" not in captions.entropy_budget(pd.DataFrame(agree), _rs({"a": 0.5}))
