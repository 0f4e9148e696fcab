"""The report's figures, each declared once: :data:`FIGURES`.

A :class:`Figure` names the analysis it is drawn from (analyses/*.sql), the plots function that draws
it, its title, its caption (the paper's claim it mirrors) and its observer, the captions function that
says what THESE runs show. One signature each, for every figure:

- ``plot(df, *, band, legend_title) -> matplotlib Figure`` (entropylens/report/plots.py; matplotlib is
  imported when a figure is drawn, not when this module is);
- ``observe(df, rs) -> str``: the figure's frame and the report's :class:`~entropylens.report.runset.RunSet`
  (each run's tau, eps, ERC band, beta; its series; whether the runs form a controlled comparison).

An observer that raises is a bug, in the observer or in what the runs hold: :meth:`Figure.observed`
then warns (:class:`CaptionWarning`, naming the figure and the error) and the report shows a row count
in the caption's place, saying the caption failed. The test suite turns that warning into an error
(pyproject's filterwarnings), so a caption that raises fails the tests.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass

from . import captions, plots


class CaptionWarning(UserWarning):
    """A figure's measured caption raised: the report shows a row count in its place."""


class CaptionFailure(str):
    """The text shown in place of a caption that raised; ``why`` names the figure and the error, so the
    process that writes the report warns again for a figure another process drew (the demo's workers)."""

    why: str

    def __new__(cls, text: str, why: str) -> CaptionFailure:
        self = super().__new__(cls, text)
        self.why = why
        return self

    def __reduce__(self):  # pickled across processes with its reason
        return (CaptionFailure, (str(self), self.why))


@dataclass(frozen=True)
class Figure:
    name: str
    analysis: str
    plot: Callable  # plots.<fn>(df, *, band, legend_title) -> matplotlib Figure
    title: str
    caption: str  # what the figure shows and the paper's claim it mirrors
    observe: Callable  # captions.<fn>(df, rs) -> str: what these runs show, measured
    params: Callable | None = None  # rs -> the analysis's parameters (None: its defaults)
    optional: bool = False  # left out (and named under "Not shown") when its analysis has no rows
    has_data: Callable | None = None  # df -> bool: an optional figure whose rows all lack its data is left out too
    # a query whose rows are empty exactly where has_data would be False (a LIMIT 1 that stops at the first row with
    # the data; free where the files lack the column): the analysis then is not run at all
    present: str | None = None
    when_empty: str = ""  # how to record what an opt-in analysis needs (report and `analyze` say it)
    step_links: bool = False  # followed by links to the steps the responses pages hold
    section: str = ""  # the report section it belongs to (SECTIONS); "" for the figures before any section

    def observed(self, df, rs) -> str:
        """The measured caption over ``df``; where the observer raises, a row count that says so, and a
        :class:`CaptionWarning`."""
        try:
            return self.observe(df, rs)
        except Exception as e:  # any error: a warning here, an error in the test suite
            why = f"figure {self.name!r}: its measured caption ({self.observe.__name__}) raised {type(e).__name__}: {e}"
            warnings.warn(CaptionWarning(why + "; the report shows a row count in its place"), stacklevel=2)
            return CaptionFailure(
                f"Here: {len(df)} rows of this figure's analysis (its measured caption failed: {type(e).__name__}).",
                why,
            )


def _reference_band(rs) -> dict:
    """The band a run without ERC is measured against (runset.RunSet.reference_band)."""
    return dict(zip(("band_low", "band_high"), rs.reference_band()[0]))


CUI = "cui"
# section name -> (heading, the paragraph under it): the paper the section's figures test, its claims in words
SECTIONS: dict[str, tuple[str, str]] = {
    CUI: (
        "Cui et al.: the covariance law and the entropy-performance law",
        'Cui et al. 2025 ("The Entropy Mechanism of Reinforcement Learning for Reasoning Language Models") '
        "derive that a policy-gradient step changes a softmax policy's entropy by about minus the step size "
        "times the covariance of the log-probability and the advantage of the sampled actions (natural policy "
        "gradient; vanilla policy gradient: with pi A in place of A), so tokens whose log-probability and "
        "advantage covary strongly drive the entropy down; and they fit their runs' performance to the entropy "
        "as R = -a exp(H) + b, so that once the entropy is spent the performance is predictable, its "
        "ceiling b - a at H = 0. The figures below measure both on these runs, from their token rows and steps.",
    ),
}

FIGURES: tuple[Figure, ...] = (
    Figure(
        "entropy",
        "entropy_by_step",
        plots.entropy_vs_step,
        "Entropy vs step",
        "Mean token entropy of the rollout policy per step. Mirrors CE-GPPO Fig. 2, 3 and 5: under GRPO / DAPO "
        "entropy collapses, CE-GPPO keeps it higher.",
        captions.entropy,
        step_links=True,
    ),
    Figure(
        "reward",
        "reward_by_step",
        plots.reward_vs_step,
        "Reward vs step",
        "Mean reward of the step's responses. Mirrors CE-GPPO Fig. 2 (accuracy vs step).",
        captions.reward,
    ),
    Figure(
        "quadrant_share",
        "quadrant_share_by_step",
        plots.quadrant_share,
        "Quadrant shares",
        "Share of tokens in each quadrant (advantage sign x sampling probability) per step. "
        "Mirrors CE-GPPO Fig. 1 (the four token types).",
        captions.quadrant_share,
    ),
    Figure(
        "clip_by_quadrant",
        "clip_by_quadrant",
        plots.clip_by_quadrant,
        "Clip fractions by side and quadrant",
        "Share of each quadrant's tokens whose gradient PPO-clip removes. The low side (r < 1 - eps_low) "
        "removes it only where A < 0, so it shows NA&HP and NA&LP; the high side (r > 1 + eps_high) only "
        "where A > 0: PA&HP and PA&LP. Mirrors CE-GPPO Sec. 3 / Fig. 1: the dropped gradients are mostly "
        "those of low-probability tokens.",
        captions.clip_by_quadrant,
        step_links=True,
    ),
    Figure(
        "ratio_vs_prob",
        "ratio_vs_prob",
        plots.ratio_vs_prob,
        "Importance ratio vs probability",
        "Importance ratio against sampling probability, coloured by quadrant, with the clip interval "
        "[1 - eps_low, 1 + eps_high] shaded (a bounded sample). Mirrors CE-GPPO Fig. 1 left: the tokens "
        "that leave the interval are mostly low-probability.",
        captions.ratio_vs_prob,
    ),
    Figure(
        "clipped_prob",
        "clipped_prob_distribution",
        plots.clipped_prob,
        "Probability of the clipped tokens",
        "Sampling probability of the tokens whose gradient PPO-clip drops, low and high side. Mirrors "
        "CE-GPPO Sec. 3: the clipped tokens are mostly low-probability (PA&LP on the high side, NA&LP on "
        "the low side).",
        captions.clipped_prob,
    ),
    Figure(
        "grad_share",
        "grad_share_by_quadrant",
        plots.grad_share,
        "Gradient share by quadrant",
        "Each quadrant's share of the squared logit-gradient norm per step; dotted: the part carried by "
        "tokens PPO-clip would drop. Mirrors CE-GPPO Sec. 3 (gradient of clipped tokens).",
        captions.grad_share,
    ),
    Figure(
        "entropy_ratio",
        "entropy_ratio_by_step",
        plots.entropy_ratio_band,
        "Entropy-ratio band",
        "Median and p05-p95 of the per-token entropy ratio H(pi)/H(pi_old) per step, one panel per run (or "
        "group), each with its own ERC band dashed; a run without ERC shows a reference band, named below. "
        "Mirrors ERC Sec. 3: the entropy ratio is a global trust region, and ERC keeps more tokens inside "
        "the band.",
        captions.entropy_ratio,
        params=_reference_band,
    ),
    Figure(
        "drift_by_prob",
        "drift_by_prob_bin",
        plots.drift_by_prob,
        "Drift by probability bin",
        "Mean |log entropy ratio| by sampling-probability bin. The ERC paper reports drift strongest "
        "for tokens below 0.2 and above 0.6 (dotted lines).",
        captions.drift_by_prob,
    ),
    Figure(
        "grad_norm",
        "grad_norm_by_step",
        plots.grad_norm_vs_step,
        "Gradient norm vs step",
        "Global gradient norm before clipping, mean over the step's updates. Mirrors CE-GPPO Fig. 4 right.",
        captions.grad_norm,
    ),
    Figure(
        "kl",
        "kl_by_step",
        plots.kl_vs_step,
        "KL vs step",
        "KL(pi_old || pi_theta), k3 estimator, token mean per step. Mirrors CE-GPPO Fig. 4 left.",
        captions.kl,
    ),
    Figure(
        "entropy_budget",
        "entropy_budget_by_step",
        plots.entropy_budget,
        "Entropy budget per step",
        "How much each quadrant's gradients push the entropy up (above 0) or down (below 0) per step, "
        "stacked; black: the step's total. Exactly: the sum over the quadrant's tokens of "
        "entropy_effect = g_t s_t / T^2, with g_t = dLoss/dlogp_t (grad_coef), "
        "s_t = p_a (log p_a + H) - sum_j p_j^2 (log p_j + H) and T the sampling temperature: the first-order "
        "change of the token's own position's entropy for a unit step along its logit gradient "
        "(dH_t = eta g_t s_t / T^2 at step size eta); with an entropy bonus, plus the bonus's own push "
        "through H (a step without it measured shows no budget). The covariance law (CE-GPPO Sec. 3) says "
        "PA&HP and NA&LP lower entropy, PA&LP and NA&HP raise it.",
        captions.entropy_budget,
        step_links=True,
    ),
    Figure(
        "clipping_removed",
        "entropy_budget_by_step",
        plots.clipping_removed,
        "What clipping removed",
        "The entropy effect that clipping, CE-GPPO's beta scaling, ERC or dual-clip took away, by quadrant, "
        "beside the effect kept; the text below splits the same total by cause (clip low side, clip high side, "
        "dual-clip, ERC's own share: the parts add up). CE-GPPO argues PPO-clip drops mostly PA&LP "
        "(high side, raising entropy) and NA&LP (low side, lowering it) gradients.",
        captions.clipping_removed,
    ),
    Figure(
        "probe",
        "probe_vs_measured",
        plots.probe_vs_measured,
        "Parameter-space probe",
        "The probe's first-order prediction grad(H) . optimizer step (Adam's own preconditioner) against "
        "the entropy change measured after the real step, and each quadrant's share through the shared "
        "parameters (demo --probe-every K).",
        captions.probe_vs_measured,
        optional=True,
        when_empty="The parameter-space probe is opt-in: record it with `entropylens demo --probe-every K` "
        "or by calling `Recorder.probe` every K steps (entropylens/rl/probe.py).",
    ),
    Figure(
        "entropy_change",
        "entropy_change_by_quadrant",
        plots.entropy_change,
        "Entropy drift by quadrant (confounded, not an attribution)",
        "A position's entropy at its next update minus now, per quadrant of its sampled token, minus the "
        "run's mean. Confounded: high-probability positions (low entropy) tend to rise and low-probability "
        "ones to fall whatever the advantage sign, so this does not test the covariance law; the entropy "
        "budget above attributes the change to the tokens' own gradients.",
        captions.entropy_change,
    ),
    Figure(
        "mismatch",
        "mismatch_by_quadrant_by_step",
        plots.mismatch,
        "Training-inference mismatch",
        "The gap between the sampler's log-probability of each sampled token (vLLM, SGLang, a bf16 sampler) "
        "and the trainer's old-policy one, |delta log p| = |log pi_old - log pi_sampler|, per step and "
        "quadrant, one row per run; right: the share of the clipped tokens that are mismatched (|delta| > ln 2, "
        "or masked by the IS correction, as steps.clipped_mismatched_frac) beside the share of the other tokens, and the mismatched tokens' share of the entropy effect. "
        "TIS / MIS (truncated / masked importance sampling) correct this gap, reported as the most common "
        "cause of sudden collapse in LLM RL; a run without sampler log-probs is said so, not drawn as zero.",
        captions.mismatch,
        optional=True,
        has_data=lambda df: bool((df["sampled"].fillna(0) > 0).any()),
        # sampler_log_ratio is derived from sampler_logprob (schema.py): the stored column's filter first, which
        # DuckDB answers from the files' null counts (0.05 s against 1.25 s CPU over 100M all-null rows)
        present="SELECT 1 AS x FROM tokens WHERE sampler_logprob IS NOT NULL AND quadrant <> 'ZA' "
        "AND sampler_log_ratio IS NOT NULL LIMIT 1",
        when_empty="The mismatch figure needs the sampler's log-probs: record_update(..., sampler_logprobs=) "
        "in a loop, TRL with vLLM, verl's rollout_log_probs, or entropylens demo --mismatch.",
    ),
    Figure(
        "covariance_by_quadrant",
        "covariance_by_quadrant",
        plots.covariance_by_quadrant,
        "Covariance of log-probability and advantage by quadrant",
        "Each quadrant's part of the step's covariance Cov(log pi, A): its tokens' summed "
        "(A - mean A)(log pi - mean log pi), the means over each update's batch, divided by the step's "
        "tokens (the parts add up to the step's covariance). Cui et al.: a positive covariance lowers the "
        "entropy, so reinforcing likely tokens (PA&HP) and penalising unlikely ones (NA&LP) drive collapse.",
        captions.covariance_by_quadrant,
        section=CUI,
    ),
    Figure(
        "covariance_law",
        "covariance_law_by_step",
        plots.covariance_law,
        "Entropy change predicted by the covariance law against the measured change",
        "Per step, the measured change of the mean entropy (next step minus this one) against the law's "
        "prediction -eta Cov(log pi, A), eta one least-squares scale per run; the correlation does not depend "
        "on that scale. Cui et al. derive the law for a softmax policy's one step; an LLM shares parameters "
        "across tokens and Adam rescales the step, so here it is tested as a correlation.",
        captions.covariance_law,
        section=CUI,
    ),
    Figure(
        "entropy_performance",
        "entropy_performance_fit",
        plots.entropy_performance,
        "Reward against entropy with the fit R = -a exp(H) + b",
        "Each step's mean reward against its mean entropy, and each run's least-squares fit "
        "R = -a exp(H) + b. Cui et al. report that this form fits their runs' performance against entropy, "
        "with the performance at H = 0 (b - a) as the ceiling once the entropy is spent.",
        captions.entropy_performance,
        section=CUI,
    ),
)

_BY_NAME = {f.name: f for f in FIGURES}
_RUNS_OF_SECTIONS = [f.section for i, f in enumerate(FIGURES) if i == 0 or FIGURES[i - 1].section != f.section]
assert len(_RUNS_OF_SECTIONS) == len(set(_RUNS_OF_SECTIONS)), "a section's figures are declared together"
assert set(_RUNS_OF_SECTIONS) - {""} <= set(SECTIONS), "a figure names an undeclared section"
assert len(_BY_NAME) == len(FIGURES), "two figures share a name"


def figure(name: str) -> Figure:
    """The figure called ``name``."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise KeyError(f"unknown figure {name!r}: one of {', '.join(_BY_NAME)}") from None
