"""The logged metrics: which step metrics add up over micro-batches, ranks and mini-batches
(:func:`metric_rule`), a micro-batch's additive shares of them (:func:`metric_shares`, returned by the
loss function), and the step values the trainer makes of their sums (:class:`MetricShares`,
:func:`step_values`, :func:`logged_metrics`). docs/verl.md, "Logged metrics", says how verl aggregates.
"""

from __future__ import annotations

METRIC_PREFIX = "entropylens/"
# a micro-batch's additive share of a step metric (EntropyLensTrainer turns the shares into step values)
SUM_PREFIX = METRIC_PREFIX + "_sum/"


# Step metrics by how they add up over micro-batches, ranks and mini-batches (exact step values):
# counts are summed; a fraction / mean of tokens is (sum of value * n_tokens) / sum of n_tokens; ratio_mean
# and kl_k3 are means over the tokens with a finite ratio (n_tokens - n_nonfinite_ratio); clip_frac_<q>
# is of quadrant q's tokens; the entropy budget is a sum. Quantiles (entropy_ratio_p*) and the mean
# logit-gradient norms per quadrant do not add up: they are in the steps table, not in the logs.
def metric_rule(name: str) -> tuple[str, str | None] | None:
    """(kind, denominator) of a step metric for exact aggregation; None: not logged (not additive)."""
    from ...rl.aggregates import BUDGET_NAMES

    if name == "n_tokens" or name.startswith("n_"):
        return ("count", None)
    if name in ("ratio_mean", "kl_k3"):
        return ("mean", "n_finite_ratio")
    if name.startswith("clip_frac_"):
        return ("mean", "n_" + name[len("clip_frac_") :])
    if name in BUDGET_NAMES:
        return ("sum", None)
    if name.startswith("entropy_ratio_p") or name.startswith("lgn_mean_") or name == "loss":
        return None
    if name.startswith("sampler_") or name == "clipped_mismatched_frac":  # over scored / clipped tokens, a max
        return None
    if name.endswith("_frac") or name.endswith("_mean"):
        return ("mean", "n_tokens")
    return None


def metric_shares(scal: dict[str, float], dp_size: int) -> dict[str, float]:
    """One micro-batch's additive shares of the step metrics (``scal``: its PolicyLossOutput.scalars()),
    each times ``dp_size``: verl's Metric SUM aggregation averages over data-parallel ranks and sums
    over micro-batches, so a share times dp_size adds up to the global sum of the mini-batch."""
    n = scal.get("n_tokens", 0.0)
    den = {"n_tokens": n, "n_finite_ratio": n - scal.get("n_nonfinite_ratio", 0.0)}
    out = {}
    for name, v in scal.items():
        rule = metric_rule(name)
        if rule is None:
            continue
        kind, d = rule
        if kind == "mean":
            assert d is not None  # metric_rule: a mean always names its denominator
            w = den[d] if d in den else scal.get(d, 0.0)
            v = v * w if w else 0.0  # an empty denominator adds nothing (its value is NaN)
        out[name] = v * dp_size
    if "n_nonfinite_ratio" in scal or "ratio_mean" in scal:
        out["n_finite_ratio"] = den["n_finite_ratio"] * dp_size
    return out


def step_values(sums: dict[str, float]) -> dict[str, float]:
    """The step metrics from their shares summed over the whole step (every micro-batch, rank,
    mini-batch and epoch): each value equals the metric computed over all the step's tokens at once."""
    out = {}
    for name, total in sums.items():
        if name == "n_finite_ratio":
            continue
        rule = metric_rule(name)
        if rule is None:
            continue
        kind, d = rule
        if kind == "mean":  # over no token: NaN, as step_aggregates makes it (a mean of nothing is not 0)
            assert d is not None  # metric_rule: a mean always names its denominator
            out[name] = total / sums[d] if sums.get(d, 0.0) > 0 else float("nan")
        else:
            out[name] = total
    return out


def _total(v) -> float:
    """A metric verl collected over the step: a list (one value per mini-batch: Metric.aggregate_dp),
    a Metric (verl ran without a data-parallel group: every micro-batch's value) or a number."""
    from verl.utils.metric import Metric

    if isinstance(v, Metric):
        return float(v.aggregate())
    if isinstance(v, (list, tuple)):
        return float(sum(_total(x) for x in v))
    return float(v)


class MetricShares:
    """The actor worker group as verl's ``_update_actor`` sees it, with one change: ``update_actor``'s
    metrics lose the additive shares (``entropylens/_sum/...``) before verl averages them over
    mini-batches (reduce_metrics); their totals over the step are kept in ``sums``."""

    def __init__(self, wg):
        self._wg = wg
        self.sums: dict[str, float] = {}

    def update_actor(self, *args, **kwargs):
        from verl.utils import tensordict_utils as tu

        out = self._wg.update_actor(*args, **kwargs)
        metrics = dict(out["metrics"])
        for k in [k for k in metrics if k.startswith(SUM_PREFIX)]:
            name = k[len(SUM_PREFIX) :]
            self.sums[name] = self.sums.get(name, 0.0) + _total(metrics.pop(k))
        tu.assign_non_tensor(out, metrics=metrics)
        return out

    def __getattr__(self, name):
        return getattr(self._wg, name)


def logged_metrics(own: dict, sums: dict[str, float]) -> dict:
    """What the trainer logs for an actor update: verl's own keys (``own``, from verl's ``_update_actor``)
    unchanged but ours (``actor/entropylens/loss``) without ``actor/``, then the exact step values of
    the shares summed over the step (``sums``, :class:`MetricShares`)."""
    out = {k.replace("actor/" + METRIC_PREFIX, METRIC_PREFIX, 1): v for k, v in own.items()}
    out.update({METRIC_PREFIX + k: v for k, v in step_values(sums).items()})
    return out
