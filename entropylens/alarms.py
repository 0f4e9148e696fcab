"""Alarms over step aggregates: the rules behind `entropylens check PATH` and the Recorder's live warnings.

One :class:`Monitor` per run sees the steps in order (a row of per-step signals each) and reports a
:class:`Finding` when a rule starts firing (one per episode: a rule that keeps firing on the next
steps is not reported again until it has stopped). The same code runs offline over the ``steps``
table (:func:`check`, analysis ``step_health``) and live in the Recorder (``Recorder(alarms=True)``:
one Python warning per rule and run). docs/alarms.md says the same with examples.

Notation: H_t the step's entropy (the rollout policy's, old_entropy, else the updated one's), H_0 the
mean of the first ``baseline`` (3) finite H_t; med_t(x) the median of x over the previous ``window``
(20) steps with a finite x, used once 5 of them exist (a median of 0 never fires). A rule reads only
finite values; a NaN or inf is the ``nonfinite`` rule's and is left out of every baseline and median.

Rules: fires at step t when ... [defaults; `entropylens check` flags]
  nonfinite        loss, grad_norm, lr, kl, entropy or old_entropy is NaN or +-inf (value: it, threshold
                   inf), or n_nonfinite_ratio > 0, tokens whose ratio or k3 overflowed (value: their
                   count, threshold 0). [always on]
  collapse         H_t < collapse * H_0. [0.25; --collapse]
  explosion        H_t > explosion * H_0. [2.0; --explosion]
  negative_budget  budget_t < 0 for budget_steps steps in a row AND H_t < budget_entropy * H_0, the
                   budget being the sum of the tokens' first-order entropy effect g s / T^2 (value:
                   budget_t, threshold 0). Entropy has already fallen that far and the updates still
                   push it down: a collapse under way. A negative budget alone is normal RL.
                   [10, 0.5; --budget-steps, --budget-entropy]
  clip_spike       clipped_frac_t > clip_spike * med_t(clipped_frac) and clipped_frac_t >= clip_floor.
                   [3.0, 0.05; --clip-spike, --clip-floor]
  kl_spike         kl_t > kl_spike * med_t(kl). [5.0; --kl-spike]
  grad_norm_spike  grad_norm_t > grad_norm_spike * med_t(grad_norm). [3.0; --grad-norm-spike]
  erc_drop_rate    erc_drop_frac_t > erc_drop_max (ERC throws most gradient away), or
                   erc_drop_frac_t < erc_drop_min while entropy_ratio_p05_t < erc_low or
                   entropy_ratio_p95_t > erc_high (tokens leave the band, ERC drops none of them: it is
                   not applied as configured). Dropping nothing while the ratios stay inside the band
                   is healthy, never an alarm. [0.001, 0.5; --erc-drop-min, --erc-drop-max]
  no_signal        step t is signal-free when za_frac_t = n_za / n_tokens >= no_signal_share or
                   zero_grad_frac_t (share of its updates with grad norm exactly 0) >= no_signal_share.
                   Fires when the last no_signal_steps steps are all signal-free (value: steps in a
                   row, threshold no_signal_steps), or when k signal-free steps among the last n <=
                   window have k >= no_signal_steps and k >= no_signal_share * n (value: k / n,
                   threshold no_signal_share: e.g. a run with every other step at grad norm 0). An
                   episode ends after no_signal_steps steps in a row meeting neither.
                   [0.5, 3; --no-signal-share, --no-signal-steps]
  mismatch         sampler_kl_t > max(mismatch * B, mismatch_floor), sampler_kl_t = KL(pi_sampler || pi_old)
                   (k3 over the sampled tokens, steps.sampler_kl_k3) and B the median of its first
                   mismatch_warmup finite values (the run's own start; no alarm during them). The
                   sampler and the trainer drift apart (a bf16 / quantised / other-engine sampler whose
                   gap grows): the run's own start sets what is normal. A run without sampler log-probs
                   never fires. [10.0, 1e-3, 5; --mismatch, --mismatch-floor, --mismatch-warmup]
A finding's ``signal`` names the input: which value was not finite (nonfinite), or what the step
lacked (no_signal: za_frac or zero_grad_frac). Live (``Recorder(alarms=True)``) the rules read the
closed step's summary plus record_step's grad_norm / lr; the ERC band reaches only the steps rows, so
erc_drop_rate's low side is offline only.
"""

from __future__ import annotations

import math
import statistics
import warnings
from dataclasses import dataclass, field, fields


class EntropyAlarm(UserWarning):
    """A live alarm from the Recorder (one per rule and run)."""


class NonFiniteWarning(UserWarning):
    """record_step recorded a NaN or infinite value (one warning per run; the value is stored as it is)."""


@dataclass(frozen=True)
class Thresholds:
    collapse: float = 0.25  # fraction of the initial entropy
    explosion: float = 2.0  # multiple of the initial entropy
    budget_steps: int = 10  # consecutive steps with a negative entropy budget ...
    budget_entropy: float = 0.5  # ... while entropy is below this fraction of the initial entropy
    clip_spike: float = 3.0  # multiple of the rolling median clipped fraction
    clip_floor: float = 0.05  # ... and at least this clipped fraction (a 2% clip fraction is never a spike)
    kl_spike: float = 5.0  # multiple of the rolling median KL
    grad_norm_spike: float = 3.0  # multiple of the rolling median grad norm
    erc_drop_min: float = 0.001  # ERC drop fraction range (the low side only with ratios outside the band)
    erc_drop_max: float = 0.5
    no_signal_share: float = 0.5  # a step is signal-free at this share of zero-advantage tokens / zero grad norms
    no_signal_steps: int = 3  # signal-free steps in a row (or at least this many, and that share, in the window)
    mismatch: float = 10.0  # multiple of the sampler-trainer KL at the run's start
    mismatch_floor: float = 1e-3  # ... and at least this KL (nats): a tiny start's multiple is no alarm
    mismatch_warmup: int = 5  # first steps with a sampler KL whose median is the run's start
    window: int = 20  # steps in the rolling median (and no_signal's share)
    baseline: int = 3  # first steps whose mean entropy is the initial entropy

    def __post_init__(self):
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, bool) or not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise ValueError(f"alarm threshold {f.name} must be a finite number >= 0, got {v!r}")
        for name in ("window", "baseline", "budget_steps", "no_signal_steps", "mismatch_warmup"):
            if getattr(self, name) < 1:
                raise ValueError(f"alarm threshold {name} must be >= 1, got {getattr(self, name)!r}")
        for name in ("budget_entropy", "no_signal_share"):
            if getattr(self, name) > 1:
                raise ValueError(f"alarm threshold {name} is a share: at most 1, got {getattr(self, name)!r}")
        if self.erc_drop_min > self.erc_drop_max:
            raise ValueError(f"erc_drop_min {self.erc_drop_min} is above erc_drop_max {self.erc_drop_max}")


RULES: tuple[str, ...] = (
    "nonfinite",
    "collapse",
    "explosion",
    "negative_budget",
    "clip_spike",
    "kl_spike",
    "grad_norm_spike",
    "erc_drop_rate",
    "no_signal",
    "mismatch",
)
NONFINITE_SIGNALS: tuple[str, ...] = ("loss", "grad_norm", "lr", "kl", "entropy", "old_entropy")


@dataclass(frozen=True)
class Finding:
    run: str
    step: int
    rule: str
    value: float
    threshold: float
    signal: str | None = None  # nonfinite: the value that was not finite; no_signal: what the step lacked

    def line(self) -> str:
        from .report.escape import terminal  # the run id as printed: no raw control or bidi character

        text = (
            f"run={terminal(self.run)} step={self.step} rule={self.rule} value={self.value:.4g} "
            f"threshold={self.threshold:.4g}"
        )
        return text + (f" signal={self.signal}" if self.signal else "")


def _num(row: dict, key: str) -> float | None:
    """The row's value as a float, NaN and +-inf included; None where missing (None, pandas NA, not a number)."""
    v = row.get(key)
    if v is None:
        return None
    try:
        return float(v)
    except (TypeError, ValueError):
        return None


def _fin(row: dict, key: str) -> float | None:
    """The row's value where it is finite, else None (the rules other than nonfinite read only these)."""
    v = _num(row, key)
    return v if v is not None and math.isfinite(v) else None


@dataclass
class Monitor:
    """The rules over one run's steps, fed in order with :meth:`observe`."""

    run: str
    t: Thresholds = field(default_factory=Thresholds)
    _first: list = field(default_factory=list)
    _hist: dict = field(default_factory=dict)
    _neg: int = 0  # steps in a row with a negative entropy budget
    _quiet: list = field(default_factory=list)  # signal-free flags of the last `window` steps
    _quiet_run: int = 0  # signal-free steps in a row
    _quiet_for: int = 0  # steps in a row a no_signal episode has not met its condition
    _active: set = field(default_factory=set)
    _mm_start: list = field(default_factory=list)  # the first mismatch_warmup finite sampler KLs

    def _spike(self, key: str, value: float | None, factor: float) -> tuple[bool, float]:
        hist = self._hist.setdefault(key, [])
        fired, thr = False, math.nan
        if value is not None:
            if len(hist) >= 5:
                med = statistics.median(hist[-self.t.window :])
                thr = factor * med
                fired = med > 0 and value > thr
            hist.append(value)
            del hist[: -self.t.window]
        return fired, thr

    def observe(self, step: int, row: dict) -> list[Finding]:
        """Signals of one step: entropy, old_entropy, entropy_effect (the budget), clipped_frac, kl, sampler_kl,
        grad_norm, loss, lr, erc_drop_frac, entropy_ratio_p05 / _p95, erc_low / erc_high,
        n_nonfinite_ratio, za_frac (n_za / n_tokens), zero_grad_frac (share of the step's updates with
        grad norm 0); missing ones (None) are skipped. Returns the rules that start firing."""
        t = self.t
        hits: dict[str, tuple] = {}
        for key in NONFINITE_SIGNALS:
            v = _num(row, key)
            if v is not None and not math.isfinite(v):
                hits["nonfinite"] = (v, math.inf, key)
                break
        else:
            n = _num(row, "n_nonfinite_ratio")
            if n is not None and not n <= 0:  # NaN counts too
                hits["nonfinite"] = (n, 0.0, "n_nonfinite_ratio")
        h = _fin(row, "old_entropy")
        h = _fin(row, "entropy") if h is None else h
        h0 = None
        if h is not None:
            if len(self._first) < t.baseline:
                self._first.append(h)
            else:  # after the baseline steps
                h0 = statistics.fmean(self._first)
                if h < t.collapse * h0:
                    hits["collapse"] = (h, t.collapse * h0)
                elif h > t.explosion * h0:
                    hits["explosion"] = (h, t.explosion * h0)
        budget = _fin(row, "entropy_effect")
        if budget is not None:
            self._neg = self._neg + 1 if budget < 0 else 0
            if self._neg >= t.budget_steps and h is not None and h0 is not None and h < t.budget_entropy * h0:
                hits["negative_budget"] = (budget, 0.0)
        for key, rule, factor in (
            ("clipped_frac", "clip_spike", t.clip_spike),
            ("kl", "kl_spike", t.kl_spike),
            ("grad_norm", "grad_norm_spike", t.grad_norm_spike),
        ):
            v = _fin(row, key)
            fired, thr = self._spike(key, v, factor)
            # the floor: too small a share to matter (fired implies a value)
            if fired and rule == "clip_spike" and v is not None and v < t.clip_floor:
                fired = False
            if fired:
                hits[rule] = (v, thr)
        erc = _fin(row, "erc_drop_frac")
        if erc is not None:
            if erc > t.erc_drop_max:
                hits["erc_drop_rate"] = (erc, t.erc_drop_max)
            elif erc < t.erc_drop_min and self._outside_band(row):
                hits["erc_drop_rate"] = (erc, t.erc_drop_min)
        self._no_signal(row, hits)
        self._mismatch(row, hits)
        new = [Finding(self.run, int(step), r, *hit) for r, hit in hits.items() if r not in self._active]
        self._active = set(hits)
        return sorted(new, key=lambda f: RULES.index(f.rule))

    @staticmethod
    def _outside_band(row: dict) -> bool:
        """The step's entropy ratios leave its ERC band (p05 below erc_low or p95 above erc_high)."""
        lo, hi = _fin(row, "erc_low"), _fin(row, "erc_high")
        p05, p95 = _fin(row, "entropy_ratio_p05"), _fin(row, "entropy_ratio_p95")
        return (lo is not None and p05 is not None and p05 < lo) or (hi is not None and p95 is not None and p95 > hi)

    def _mismatch(self, row: dict, hits: dict) -> None:
        """sampler_kl past max(mismatch x the median of its first mismatch_warmup values, mismatch_floor)."""
        kl = _fin(row, "sampler_kl")
        if kl is None:
            return
        if len(self._mm_start) < self.t.mismatch_warmup:
            self._mm_start.append(kl)
            return
        thr = max(self.t.mismatch * statistics.median(self._mm_start), self.t.mismatch_floor)
        if kl > thr:
            hits["mismatch"] = (kl, thr)

    def _no_signal(self, row: dict, hits: dict) -> None:
        t = self.t
        za, zero_grad = _fin(row, "za_frac"), _fin(row, "zero_grad_frac")
        if za is None and zero_grad is None:
            return  # the step says nothing about its signal
        lacks = (
            "za_frac"
            if za is not None and za >= t.no_signal_share
            else "zero_grad_frac"
            if zero_grad is not None and zero_grad >= t.no_signal_share
            else None
        )
        self._quiet_run = self._quiet_run + 1 if lacks else 0
        self._quiet.append(lacks is not None)
        del self._quiet[: -t.window]
        k, n = sum(self._quiet), len(self._quiet)
        if self._quiet_run >= t.no_signal_steps:
            hits["no_signal"] = (float(self._quiet_run), float(t.no_signal_steps), lacks)
        elif k >= t.no_signal_steps and k >= t.no_signal_share * n:
            hits["no_signal"] = (k / n, t.no_signal_share, lacks or "share_of_steps")
        elif "no_signal" in self._active and self._quiet_for + 1 < t.no_signal_steps:
            self._quiet_for += 1  # the episode goes on (a run alternating around the share is one finding)
            hits["no_signal"] = (k / n, t.no_signal_share, None)
            return
        self._quiet_for = 0


def evaluate(df, thresholds: Thresholds | None = None) -> list[Finding]:
    """Findings over per-step signals (a DataFrame, or a list of dicts, with run, step and the signals of
    :meth:`Monitor.observe`, e.g. the ``step_health`` analysis), each run's steps in order. A NaN is a
    NaN value (the nonfinite rule): a missing value is None, so pass a DataFrame only where NaN means
    that (DuckDB's ``.df()`` turns NULL into NaN; :func:`check` reads the analysis as Python values)."""
    t = thresholds or Thresholds()
    records = df if isinstance(df, list) else df.to_dict("records")
    runs: dict[str, list[dict]] = {}
    for row in records:
        runs.setdefault(str(row["run"]), []).append(row)
    out: list[Finding] = []
    for run in sorted(runs):
        mon = Monitor(run, t)
        for row in sorted(runs[run], key=lambda r: int(r["step"])):
            out.extend(mon.observe(int(row["step"]), row))
    return out


class ScalarLog:
    """record_step's values as they reach the host: one :class:`NonFiniteWarning` per run at the first
    NaN / inf (naming the step and the value; it is stored as it is), and, for the live alarms
    (``keep``), each step's grad_norm and lr until :meth:`take`. Device scalars (a CUDA grad norm) are
    checked once their non-blocking copy has landed, at a later record_step (never a sync)."""

    def __init__(self, run: str, keep: bool):
        self.run, self.keep, self.warned = run, keep, False
        self._pending: list = []  # (step, update, names, HostCopy of [k] float64)
        self._kept: dict[int, dict[str, list[float]]] = {}

    def add(self, step: int, update: int | None, values: dict, device: tuple | None = None) -> None:
        """Host floats ``values``; ``device``: (names, HostCopy) of the device ones."""
        self.poll()
        self._seen(step, update, values)
        if device is not None:
            self._pending.append((step, update, *device))
            self.poll()  # landed already (rare on CUDA): checked now

    def poll(self, upto: int | None = None) -> None:
        """Takes in the device scalars whose copy has landed (and waits for those of steps <= upto)."""
        still = []
        for step, update, names, copy in self._pending:
            if copy.ready or (upto is not None and step <= upto):
                self._seen(step, update, dict(zip(names, copy.wait().tolist())))
            else:
                still.append((step, update, names, copy))
        self._pending = still

    def take(self, step: int) -> dict[str, list[float]]:
        """The step's grad_norm and lr values (lists, in recording order); forgets it and earlier steps."""
        self.poll(upto=step)
        out = self._kept.pop(step, {})
        for s in [s for s in self._kept if s < step]:
            del self._kept[s]
        return out

    def _seen(self, step: int, update: int | None, values: dict) -> None:
        if self.keep:
            kept = self._kept.setdefault(step, {})
            for name in ("grad_norm", "lr"):
                if name in values:
                    kept.setdefault(name, []).append(float(values[name]))
        if self.warned:
            return
        bad = [(k, v) for k, v in values.items() if isinstance(v, float) and not math.isfinite(v)]
        if bad:
            from .caller import caller_stacklevel

            self.warned = True
            where = f"record_step({step}" + (f", update={update})" if update is not None else ")")
            what = ", ".join(f"{k}={v}" for k, v in bad)
            warnings.warn(
                f"entropylens: {where} recorded {what}, stored as it is (a blow-up? `entropylens check` "
                f"rule nonfinite); later non-finite values of run {self.run!r} are stored without a warning",
                NonFiniteWarning,
                stacklevel=caller_stacklevel(),
            )


def _mean(xs: list[float] | None) -> float | None:
    return sum(xs) / len(xs) if xs else None  # NaN and inf propagate, as DuckDB's avg


def check_stop_on(stop_on) -> tuple[str, ...]:
    """``stop_on`` as a tuple of rule names (a name, or names; "all" for every rule); unknown names are a
    one-line error listing the rules."""
    names = (stop_on,) if isinstance(stop_on, str) else tuple(stop_on or ())
    if "all" in names:
        return RULES
    bad = [n for n in names if n not in RULES]
    if bad:
        raise ValueError(f"stop_on: unknown rule {bad[0]!r}; rules: {', '.join(RULES)} (or 'all')")
    return names


class LiveAlarms:
    """The Recorder's live check: feed each closed step's summary; warns once per rule (EntropyAlarm).
    ``scalar_log`` (set by the Recorder): record_step's grad_norm / lr of each step. ``stop_on``: rules
    whose finding sets ``stop`` (the first such Finding): the training loop (or the TRL trainer's
    callback) reads it and stops. ``listeners``: callables ``f(finding)`` called at each finding (e.g. a
    tracker's alert)."""

    def __init__(self, run: str, thresholds: Thresholds | None = None, stop_on=()):
        self.monitor = Monitor(run, thresholds or Thresholds())
        self.warned: set[str] = set()
        self.findings: list[Finding] = []
        self.scalar_log: ScalarLog | None = None
        self.stop_on = check_stop_on(stop_on)
        self.stop: Finding | None = None
        self.listeners: list = []

    def observe(self, step: int, summary: dict) -> None:
        row = {
            "old_entropy": summary.get("old_entropy_mean"),
            "entropy": summary.get("entropy_mean"),
            "entropy_effect": summary.get("entropy_effect"),
            "clipped_frac": summary.get("clipped_frac"),
            "kl": summary.get("kl_k3"),
            "loss": summary.get("loss"),
            "erc_drop_frac": summary.get("erc_drop_frac"),
            "entropy_ratio_p05": summary.get("entropy_ratio_p05"),
            "entropy_ratio_p95": summary.get("entropy_ratio_p95"),
            "n_nonfinite_ratio": summary.get("n_nonfinite_ratio"),
            "sampler_kl": summary.get("sampler_kl_k3"),
        }
        n, za = summary.get("n_tokens"), summary.get("n_za")
        row["za_frac"] = za / n if n and za is not None else None
        scalars = self.scalar_log.take(step) if self.scalar_log is not None else {}
        grads = scalars.get("grad_norm")
        row["grad_norm"] = _mean(grads) if grads else summary.get("grad_norm")
        row["zero_grad_frac"] = sum(g == 0 for g in grads) / len(grads) if grads else None
        row["lr"] = _mean(scalars.get("lr"))
        for f in self.monitor.observe(step, row):
            self.findings.append(f)
            if self.stop is None and f.rule in self.stop_on:
                self.stop = f
            for listen in self.listeners:
                try:
                    listen(f)
                except Exception as e:  # noqa: BLE001 - an alert that fails must not stop training
                    warnings.warn(
                        f"entropylens alarm listener {listen!r} failed: {type(e).__name__}: {e}", stacklevel=2
                    )
            if f.rule not in self.warned:
                self.warned.add(f.rule)
                from .caller import caller_stacklevel

                # the user's line that led here (record_update, end_step, close, ...), not ours
                warnings.warn(f"entropylens alarm: {f.line()}", EntropyAlarm, stacklevel=caller_stacklevel())


__all__ = [
    "Thresholds",
    "Finding",
    "Monitor",
    "RULES",
    "evaluate",
    "LiveAlarms",
    "check_stop_on",
    "EntropyAlarm",
    "NonFiniteWarning",
    "ScalarLog",
]
