"""Alarms over step aggregates: the rules behind `entropylens check PATH` and the Recorder's live warnings.

One :class:`Monitor` per run sees the steps in order (a row of per-step signals each) and reports a
:class:`Finding` when a rule starts firing (one per episode: a rule that keeps firing on the next
steps is not reported again until it has stopped). The same code runs offline over the ``steps``
table (:func:`check`, analysis ``step_health``) and live in the Recorder (``Recorder(alarms=True)``:
one Python warning per rule and run).

Rules (name: what fires, default threshold, CLI flag):
  collapse         entropy < collapse x initial entropy                  0.25   --collapse
  explosion        entropy > explosion x initial entropy                 2.0    --explosion
  negative_budget  the step's entropy budget (sum of tokens' first-order
                   entropy effect) < 0 for budget_steps steps in a row     10     --budget-steps
  clip_spike       clipped fraction > clip_spike x rolling median          3.0    --clip-spike
  kl_spike         KL(old || new) > kl_spike x rolling median              5.0    --kl-spike
  grad_norm_spike  grad norm > grad_norm_spike x rolling median            3.0    --grad-norm-spike
  erc_drop_rate    ERC drop fraction outside [erc_drop_min, erc_drop_max]  0.001 / 0.5
Entropy is the rollout policy's (old_entropy), else the updated one; the initial entropy is the mean
over the first ``baseline`` steps (default 3). The rolling median is over the previous ``window``
steps (default 20) and needs 5 of them; a zero median never fires. The ERC drop fraction's low side
counts from the step after the first ``baseline`` steps with ERC (the run starts on its rollout policy,
where ERC has nothing to drop yet); its high side from the first.
"""

from __future__ import annotations

import math
import statistics
import warnings
from dataclasses import dataclass, field, fields


class EntropyAlarm(UserWarning):
    """A live alarm from the Recorder (one per rule and run)."""


@dataclass(frozen=True)
class Thresholds:
    collapse: float = 0.25  # fraction of the initial entropy
    explosion: float = 2.0  # multiple of the initial entropy
    budget_steps: int = 10  # consecutive steps with a negative entropy budget
    clip_spike: float = 3.0  # multiple of the rolling median clipped fraction
    kl_spike: float = 5.0  # multiple of the rolling median KL
    grad_norm_spike: float = 3.0  # multiple of the rolling median grad norm
    erc_drop_min: float = 0.001  # ERC drop fraction range
    erc_drop_max: float = 0.5
    window: int = 20  # steps in the rolling median
    baseline: int = 3  # first steps whose mean entropy is the initial entropy

    def __post_init__(self):
        for f in fields(self):
            v = getattr(self, f.name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise ValueError(f"alarm threshold {f.name} must be a finite number >= 0, got {v!r}")
        if self.window < 1 or self.baseline < 1 or self.budget_steps < 1:
            raise ValueError("window, baseline and budget_steps must be >= 1")
        if self.erc_drop_min > self.erc_drop_max:
            raise ValueError(f"erc_drop_min {self.erc_drop_min} is above erc_drop_max {self.erc_drop_max}")


RULES: tuple[str, ...] = ("collapse", "explosion", "negative_budget", "clip_spike", "kl_spike", "grad_norm_spike",
                          "erc_drop_rate")


@dataclass(frozen=True)
class Finding:
    run: str
    step: int
    rule: str
    value: float
    threshold: float

    def line(self) -> str:
        return f"run={self.run} step={self.step} rule={self.rule} value={self.value:.4g} threshold={self.threshold:.4g}"


def _num(row: dict, key: str) -> float | None:
    v = row.get(key)
    if v is None:
        return None
    try:
        v = float(v)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(v) else v


@dataclass
class Monitor:
    """The rules over one run's steps, fed in order with :meth:`observe`."""

    run: str
    t: Thresholds = field(default_factory=Thresholds)
    _first: list = field(default_factory=list)
    _hist: dict = field(default_factory=dict)
    _neg: int = 0
    _erc_steps: int = 0  # steps seen with an ERC drop fraction
    _active: set = field(default_factory=set)

    def _spike(self, key: str, value: float | None, factor: float) -> tuple[bool, float]:
        hist = self._hist.setdefault(key, [])
        fired, thr = False, math.nan
        if value is not None:
            if len(hist) >= 5:
                med = statistics.median(hist[-self.t.window:])
                thr = factor * med
                fired = med > 0 and value > thr
            hist.append(value)
        return fired, thr

    def observe(self, step: int, row: dict) -> list[Finding]:
        """Signals of one step: entropy (or old_entropy), entropy_effect (the budget), clipped_frac,
        kl, grad_norm, erc_drop_frac; missing ones are skipped. Returns the rules that start firing."""
        t = self.t
        hits: dict[str, tuple[float, float]] = {}
        h = _num(row, "old_entropy")
        h = _num(row, "entropy") if h is None else h
        if h is not None:
            if len(self._first) < t.baseline:
                self._first.append(h)
            elif h < t.collapse * statistics.fmean(self._first):  # after the baseline steps
                hits["collapse"] = (h, t.collapse * statistics.fmean(self._first))
            elif h > t.explosion * statistics.fmean(self._first):
                hits["explosion"] = (h, t.explosion * statistics.fmean(self._first))
        budget = _num(row, "entropy_effect")
        if budget is not None:
            self._neg = self._neg + 1 if budget < 0 else 0
            if self._neg >= t.budget_steps:
                hits["negative_budget"] = (budget, 0.0)
        for key, rule, factor in (("clipped_frac", "clip_spike", t.clip_spike), ("kl", "kl_spike", t.kl_spike),
                                  ("grad_norm", "grad_norm_spike", t.grad_norm_spike)):
            v = _num(row, key)
            fired, thr = self._spike(key, v, factor)
            if fired:
                hits[rule] = (v, thr)
        erc = _num(row, "erc_drop_frac")
        if erc is not None:
            self._erc_steps += 1
            if erc > t.erc_drop_max:
                hits["erc_drop_rate"] = (erc, t.erc_drop_max)
            elif erc < t.erc_drop_min and self._erc_steps > t.baseline:  # not while the run starts on-policy
                hits["erc_drop_rate"] = (erc, t.erc_drop_min)
        new = [Finding(self.run, int(step), r, v, thr) for r, (v, thr) in hits.items() if r not in self._active]
        self._active = set(hits)
        return sorted(new, key=lambda f: RULES.index(f.rule))


def evaluate(df, thresholds: Thresholds | None = None) -> list[Finding]:
    """Findings over a DataFrame of per-step signals (columns run, step and the signals of
    :meth:`Monitor.observe`, e.g. the ``step_health`` analysis), each run's steps in order."""
    t = thresholds or Thresholds()
    out: list[Finding] = []
    for run, g in df.sort_values(["run", "step"]).groupby("run", sort=True):
        mon = Monitor(str(run), t)
        for row in g.to_dict("records"):
            out.extend(mon.observe(int(row["step"]), row))
    return out


def check(path, thresholds: Thresholds | None = None, *, runs: list[str] | None = None) -> list[Finding]:
    """Every run under ``path`` through the rules (analysis ``step_health`` over the steps table)."""
    from .query import connect, run_analysis

    return evaluate(run_analysis(connect(path, runs=runs), "step_health"), thresholds)


class LiveAlarms:
    """The Recorder's live check: feed each closed step's summary; warns once per rule (EntropyAlarm)."""

    def __init__(self, run: str, thresholds: Thresholds | None = None):
        self.monitor = Monitor(run, thresholds or Thresholds())
        self.warned: set[str] = set()
        self.findings: list[Finding] = []

    def observe(self, step: int, summary: dict) -> None:
        row = {"old_entropy": summary.get("old_entropy_mean"), "entropy": summary.get("entropy_mean"),
               "entropy_effect": summary.get("entropy_effect"), "clipped_frac": summary.get("clipped_frac"),
               "kl": summary.get("kl_k3"), "grad_norm": summary.get("grad_norm"),
               "erc_drop_frac": summary.get("erc_drop_frac")}
        for f in self.monitor.observe(step, row):
            self.findings.append(f)
            if f.rule not in self.warned:
                self.warned.add(f.rule)
                from .writer_thread import caller_stacklevel

                # the user's line that led here (record_update, end_step, close, ...), not ours
                warnings.warn(f"entropylens alarm: {f.line()}", EntropyAlarm, stacklevel=caller_stacklevel())


__all__ = ["Thresholds", "Finding", "Monitor", "RULES", "evaluate", "check", "LiveAlarms", "EntropyAlarm"]
