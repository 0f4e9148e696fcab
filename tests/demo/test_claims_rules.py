"""The paper-claims rules on hand-made numbers: Student's t tail, Welch's test, spike flags, verdicts."""

import math

import pytest

from entropylens.demo.toy import claims, rules
from entropylens.demo.toy.config import REGIMES, ToyConfig, config_for


# ------------------------------------------------------------------ the t distribution
@pytest.mark.parametrize(
    "t, df, tail",
    [
        # printed tables of Student's t critical values: P(T > t) = tail
        (12.7062, 1, 0.025),
        (2.919986, 2, 0.05),
        (4.302653, 2, 0.025),
        (2.131847, 4, 0.05),
        (2.776445, 4, 0.025),
        (4.604095, 4, 0.005),
        (2.570582, 5, 0.025),
        (1.396815, 8, 0.10),
        (3.169273, 10, 0.005),
        (2.042272, 30, 0.025),
        (1.0, 1, 0.25),  # df 1 is Cauchy: P(T > 1) = 1/2 - atan(1)/pi = 1/4 exactly
    ],
)
def test_t_sf_matches_tables(t, df, tail):
    assert rules.t_sf(t, df) == pytest.approx(tail, rel=2e-5)
    assert rules.t_sf(-t, df) == pytest.approx(1 - tail, rel=2e-5)  # symmetric
    assert rules.t_ppf(1 - tail, df) == pytest.approx(t, rel=2e-5)


def test_t_sf_limits():
    assert rules.t_sf(0.0, 3) == pytest.approx(0.5)
    assert rules.t_sf(1.959964, math.inf) == pytest.approx(0.025, rel=1e-5)  # the normal limit
    assert rules.t_sf(1.959964, 1e7) == pytest.approx(0.025, rel=1e-4)
    assert rules.t_sf(math.inf, 4) == 0.0
    with pytest.raises(ValueError, match="df > 0"):
        rules.t_sf(1.0, 0)


def _t_tail_by_quadrature(t: float, df: float) -> float:
    """P(T > t) by Simpson's rule on the density, substituting x = t + u / (1 - u) (u in [0, 1)):
    an independent check of the continued fraction at fractional df."""
    c = math.exp(math.lgamma((df + 1) / 2) - math.lgamma(df / 2)) / math.sqrt(df * math.pi)

    def f(u):
        if u >= 1.0:
            return 0.0
        x = t + u / (1 - u)
        return c * (1 + x * x / df) ** (-(df + 1) / 2) / (1 - u) ** 2

    n = 20000
    h = 1.0 / n
    s = f(0.0) + f(1.0) + sum((4 if i % 2 else 2) * f(i * h) for i in range(1, n))
    return s * h / 3


@pytest.mark.parametrize("t, df", [(2.5298, 5.882), (1.3, 3.3), (0.4, 8.7), (3.0, 2.5)])
def test_t_sf_fractional_df_against_quadrature(t, df):
    assert rules.t_sf(t, df) == pytest.approx(_t_tail_by_quadrature(t, df), rel=1e-6)


def test_betainc_closed_forms():
    assert rules.betainc(1, 1, 0.3) == pytest.approx(0.3)  # uniform
    assert rules.betainc(3, 1, 0.6) == pytest.approx(0.6**3)  # I_x(a, 1) = x^a
    assert rules.betainc(1, 4, 0.2) == pytest.approx(1 - 0.8**4)  # I_x(1, b) = 1 - (1 - x)^b
    assert rules.betainc(2.5, 2.5, 0.5) == pytest.approx(0.5)  # symmetric
    assert rules.betainc(2, 3, 0.0) == 0.0 and rules.betainc(2, 3, 1.0) == 1.0


# ------------------------------------------------------------------ Welch and one-sample tests
def test_welch_hand_worked():
    # a = 1..5: mean 3, var 2.5 -> v/n = 0.5;  b = 0, .5, 1, 1.5, 2: mean 1, var 0.625 -> v/n = 0.125
    # t = (3 - 1) / sqrt(0.625) = 2.529822;  df = 0.625^2 / (0.5^2 / 4 + 0.125^2 / 4) = 0.390625 / 0.06640625
    #   = 5.882353;  one-sided p = P(T_5.88 > 2.53) ~ 0.0227 (below the pooled-df p at df 8, 0.0176: Welch is
    #   more conservative when variances differ)
    w = rules.welch([1, 2, 3, 4, 5], [0, 0.5, 1, 1.5, 2])
    assert w.diff == pytest.approx(2.0)
    assert w.t == pytest.approx(2.529822, rel=1e-6)
    assert w.df == pytest.approx(5.882353, rel=1e-6)
    assert w.p == pytest.approx(_t_tail_by_quadrature(2.529822, 5.882353), rel=1e-6)
    assert 0.02 < w.p < 0.025 and w.holds
    assert not rules.welch([0, 0.5, 1, 1.5, 2], [1, 2, 3, 4, 5]).holds  # one-sided: the other direction fails


def test_welch_two_se_is_not_the_rule_at_n5():
    # a = 1.0, 1.2, 1.4, 1.6, 1.8 (mean 1.4, var 0.1); b = a shifted down by a gap (same var 0.1).
    # se = sqrt(0.1/5 + 0.1/5) = 0.2, df = 0.04^2 / (2 x 0.02^2 / 4) = 8.
    # gap 0.38: t = 1.9 < 2 (a flat 2-SE rule would fail) but P(T_8 > 1.9) = 0.047 < 0.05: Welch holds;
    # gap 0.37: t = 1.85, P(T_8 > 1.85) = 0.0507: fails. The rule is the t distribution, not 2 SE.
    a = [1.0, 1.2, 1.4, 1.6, 1.8]
    w = rules.welch(a, [x - 0.38 for x in a])
    assert w.t == pytest.approx(1.9) and w.df == pytest.approx(8.0)
    assert w.p == pytest.approx(rules.t_sf(1.9, 8)) and w.holds
    assert not rules.welch(a, [x - 0.37 for x in a]).holds


def test_welch_degenerate_inputs():
    assert rules.welch([1.0], [0.0, 0.1]).p == 1.0  # one run: no test, never holds
    assert not rules.welch([], []).holds
    w = rules.welch([1.0, 1.0], [0.0, 0.0])  # no spread at all, different means
    assert w.holds and w.t == math.inf
    assert not rules.welch([1.0, 1.0], [1.0, 1.0]).holds
    assert rules.welch([1.0, float("nan"), 2.0], [0.0, 0.5]).n_a == 2  # NaN dropped


def test_one_sample_hand_worked():
    # xs = 0.8, 0.7, 0.75, 0.72, 0.78: mean 0.75, deviations .05 -.05 0 -.03 .03, squares sum .0068,
    # var .0017, sd .041231, se .018439; t = (0.75 - 0.5) / .018439 = 13.558, df 4, p ~ 8.5e-5
    t = rules.one_sample([0.8, 0.7, 0.75, 0.72, 0.78], 0.5)
    assert t.t == pytest.approx(13.558, rel=1e-4) and t.df == 4
    assert t.p == pytest.approx(rules.t_sf(13.558, 4), rel=1e-3) and t.p < 1e-4 and t.holds
    assert "n = 5" in t.text() and "too few" not in t.text()
    assert not rules.one_sample([0.6], 0.5).holds  # one seed: no test


# ------------------------------------------------------------------ spike flags
def test_spikes_against_rolling_median():
    base = [1.0, 1.2, 0.8, 1.1, 0.9, 1.0, 1.3, 0.7, 1.0, 1.0]  # median 1.0
    assert rules.spikes(base + [5.1], 5.0) == [10]  # 5.1 > 5 x 1.0
    assert rules.spikes(base + [4.9], 5.0) == []
    assert rules.spikes([50.0] + base[1:] + [1.0], 5.0) == []  # the first window is never flagged
    assert rules.spikes(base + [float("nan"), 6.0], 5.0) == [11]  # NaN skipped, not flagged


def _blow_up_run():
    """A CE-GPPO beta1 = 0.75 seed 0 run: pre-clip grad norm 1.4-7 until step 44, then 33.9 at
    steps 45-49; KL ~0.01-0.02, then 0.31-0.67."""
    steps = list(range(50))
    gn = [1.4 + 5.6 * ((s * 7) % 10) / 10 for s in steps[:45]] + [33.9] * 5  # 1.4 .. 6.44, then 33.9
    kl = [0.01 + 0.01 * (s % 2) for s in steps[:45]] + [0.31, 0.45, 0.52, 0.6, 0.67]
    return steps, gn, kl


def test_blow_up_run_is_flagged():
    steps, gn, kl = _blow_up_run()
    st = rules.stability(steps, gn, kl)
    # the norms cycle through 1.4 + 5.6 x {0, .1, .., .9} every 10 steps (max 6.44, never 5x the median);
    # median of the previous 10 before step 45: 1.4 + 5.6 x .45 = 3.92, and 33.9 > 5 x 3.92 = 19.6
    assert 45 in st.grad_spikes
    # KL alternates 0.01 / 0.02 (median 0.015): step 45's 0.31 < 25 x 0.015 = 0.375 is not flagged; step 46's
    # window holds 0.31 once, median still 0.015, and 0.45 > 0.375 is
    assert st.kl_spikes and st.kl_spikes[0] == 46
    assert st.destabilised and st.first == 45
    calm = rules.stability(steps[:45], gn[:45], kl[:45])
    assert not calm.destabilised and calm.first is None


# ------------------------------------------------------------------ verdicts
def _agg(rows: dict[str, list[tuple]]) -> dict:
    """rows: config -> [(h0, h_final, r_final, destabilised), ...] per seed."""
    agg = {}
    for name, seeds in rows.items():
        agg[name] = {
            "h0": [s[0] for s in seeds],
            "h_final": [s[1] for s in seeds],
            "r_final": [s[2] for s in seeds],
            "destabilised": [s[3] for s in seeds],
            "first_spike": [45 if s[3] else None for s in seeds],
        }
    return agg


COLLAPSED = [
    (1.18, 0.05, 0.98, False),
    (1.18, 0.06, 0.98, False),
    (1.18, 0.04, 0.97, False),
    (1.18, 0.05, 0.99, False),
    (1.18, 0.055, 0.98, False),
]


def test_blow_up_is_never_read_as_entropy_preserved():
    # CE-GPPO: every seed blew up and ended with high entropy (0.6-0.8) and low reward. On all seeds
    # Welch would call it "entropy kept higher" (t ~ 18); the flag removes them and the claim is inconclusive.
    blown = [(1.18, 0.6 + 0.05 * i, 0.43, True) for i in range(5)]
    agg = _agg({"ce_gppo": blown, "grpo": COLLAPSED, "dapo": COLLAPSED})
    assert rules.welch(agg["ce_gppo"]["h_final"], agg["grpo"]["h_final"]).holds  # what Welch alone says
    c = claims.claim_ce_gppo(agg)
    assert c.verdict.startswith("inconclusive") and "reproduced" not in c.verdict
    assert any("destabilised 5/5 seeds (first spike at step 45)" in b and "final reward 0.430" in b for b in c.beside)
    # two stable seeds that stayed collapsed plus three blow-ups: the stable ones decide -> not reproduced
    mixed = [(1.18, 0.05, 0.97, False), (1.18, 0.06, 0.96, False)] + blown[:3]
    c = claims.claim_ce_gppo(_agg({"ce_gppo": mixed, "grpo": COLLAPSED, "dapo": COLLAPSED}))
    assert c.verdict == "not reproduced"
    # genuinely preserved entropy on stable runs: reproduced
    kept = [(1.18, 0.20 + 0.01 * i, 0.97, False) for i in range(5)]
    assert claims.claim_ce_gppo(_agg({"ce_gppo": kept, "grpo": COLLAPSED, "dapo": COLLAPSED})).verdict == "reproduced"


def test_collapse_claim():
    # GRPO ratios 0.05/1.18 .. : mean ~0.044 < 0.25 with tiny spread -> reproduced
    assert claims.claim_collapse(_agg({"grpo": COLLAPSED})).verdict == "reproduced"
    # ratios ~0.30 (0.35 / 1.18): not below 0.25
    high = [(1.18, 0.35 + 0.01 * i, 0.9, False) for i in range(5)]
    assert claims.claim_collapse(_agg({"grpo": high})).verdict == "not reproduced"


def test_bonus_claim_cannot_hold_by_default():
    # GRPO collapses; the 0.001 bonus keeps entropy at 0.8 x initial and 0.003 at 0.9 x initial: neither
    # "still collapsed" nor "exploded" -> not reproduced (looking GRPO-like is not enough).
    steady = [(1.18, 0.94 + 0.01 * i, 0.9, False) for i in range(5)]  # ratio ~0.80-0.83
    higher = [(1.18, 1.06 + 0.01 * i, 0.9, False) for i in range(5)]  # ratio ~0.90-0.93
    agg = _agg({"grpo": COLLAPSED, "entropy_bonus_0.001": steady, "entropy_bonus_0.003": higher})
    assert claims.claim_bonus(agg).verdict == "not reproduced"
    # 0.001 collapses like GRPO, 0.003 ends at 1.5-1.7 x initial: reproduced
    exploded = [(1.18, 1.8 + 0.05 * i, 0.6, False) for i in range(5)]
    agg = _agg({"grpo": COLLAPSED, "entropy_bonus_0.001": COLLAPSED, "entropy_bonus_0.003": exploded})
    assert claims.claim_bonus(agg).verdict == "reproduced"
    # the same explosion, but every 0.003 run blew up: it does not count
    agg["entropy_bonus_0.003"]["destabilised"] = [True] * 5
    assert claims.claim_bonus(agg).verdict.startswith("inconclusive")


def test_beta_claim():
    lo = [(1.18, 0.30 + 0.01 * i, 0.9, False) for i in range(5)]  # beta1 0.25: highest entropy
    mid = [(1.18, 0.20 + 0.01 * i, 0.9, False) for i in range(5)]
    hi = [(1.18, 0.10 + 0.01 * i, 0.9, False) for i in range(5)]
    b2lo = [(1.18, 0.12 + 0.01 * i, 0.9, False) for i in range(5)]  # beta2 0.5: below beta2 1 (0.20 ..)
    agg = _agg({"ce_gppo_0.25_1": lo, "ce_gppo": mid, "ce_gppo_0.75_1": hi, "ce_gppo_0.5_0.5": b2lo})
    assert claims.claim_betas(agg).verdict == "reproduced"
    # beta1 0.75 blew up to high entropy on 3 seeds: with them the trend would reverse; the 2 stable
    # seeds (0.10, 0.11) keep it
    agg["ce_gppo_0.75_1"]["h_final"][2:] = [0.9, 0.95, 1.0]
    agg["ce_gppo_0.75_1"]["destabilised"][2:] = [True] * 3
    assert claims.claim_betas(agg).verdict == "reproduced"


def test_clipped_lp_claim_spreads_over_seeds():
    c = claims.claim_clipped_lp({0: 0.8, 1: 0.7, 2: 0.75, 3: 0.72, 4: 0.78}, [0.8] * 5)
    assert c.verdict == "reproduced" and "spread across 5 seeds" in c.evidence and c.figure == "clipped-prob"
    assert claims.claim_clipped_lp({0: 0.45, 1: 0.55, 2: 0.5}, []).verdict == "not reproduced"


# ------------------------------------------------------------------ regimes and the file
def test_regimes():
    assert config_for("grpo") == config_for("grpo", regime="fast")
    fast = config_for("grpo")
    assert (fast.lr, fast.updates, fast.steps) == (ToyConfig.lr, 8, ToyConfig.steps) and fast.regime == "fast"
    paper = config_for("ce_gppo_0.75_1", regime="paper", seed=3)
    assert paper.regime == "paper" and paper.beta1 == 0.75 and paper.seed == 3
    for k, v in REGIMES["paper"].items():
        assert getattr(paper, k) == v
    assert config_for("grpo", regime="paper", steps=7).steps == 7  # overrides win
    with pytest.raises(ValueError, match="unknown regime 'slow'"):
        config_for("grpo", regime="slow")


def _result(regime, reduced, verdicts):
    cl = [
        dict(key=str(i + 1), text=f"claim {i + 1}", figure="f", verdict=v, evidence="e", beside=[])
        for i, v in enumerate(verdicts)
    ]
    m = [1e-3, 1e-4]
    return {
        "regime": regime,
        "seeds": 2 if reduced else 5,
        "steps": 10,
        "reduced": reduced,
        "command": f"cmd {regime}",
        "minutes": 3.0,
        "core_minutes": 5.0,
        "workers": 2,
        "settings": {"lr": 1e-4},
        "table": {},
        "measured": {k: m for k in ("kl", "clip_low", "clip_high", "gclip_share", "gn_median")},
        "claims": cl,
    }


def test_markdown_side_by_side_and_reduced_label(tmp_path):
    import json

    (tmp_path / "paper-claims-fast.json").write_text(
        json.dumps(_result("fast", False, ["reproduced", "partly reproduced"]))
    )
    (tmp_path / "paper-claims-paper.json").write_text(
        json.dumps(_result("paper", True, ["not reproduced", "reproduced"]))
    )
    text = claims.write_markdown(tmp_path).read_text()
    assert "| 1. claim 1 | reproduced | not reproduced |" in text
    assert "| 2. claim 2 | partly reproduced | reproduced |" in text
    assert "paper (REDUCED: 2 seeds x 10 steps)" in text and "fast (5 seeds x 10 steps)" in text
    assert "`cmd fast`" in text and "`cmd paper`" in text and "**Reduced run**" in text
    assert "~1e-5" in text  # the papers' KL beside the measured ones
