"""The statistics behind the paper-claims verdicts: Student's t tail, Welch's test, spike flags.

Pure functions on plain Python numbers (no scipy: it is not a dependency). The t tail is
    P(T_nu > t) = 0.5 * I_{nu / (nu + t^2)}(nu / 2, 1 / 2)          (t >= 0)
with I_x(a, b) the regularised incomplete beta function, evaluated by its continued fraction
(modified Lentz), as in Numerical Recipes' ``betacf``. Welch's test:
    t = (mean_a - mean_b) / sqrt(v_a / n_a + v_b / n_b)
    nu = (v_a / n_a + v_b / n_b)^2 / ((v_a / n_a)^2 / (n_a - 1) + (v_b / n_b)^2 / (n_b - 1))
(Welch-Satterthwaite), one-sided p = P(T_nu > t); two-sided p = 2 P(T_nu > |t|) (:func:`welch_two_sided`).
Holm's step-down procedure (:func:`holm`) keeps the family-wise error of many such tests at ALPHA.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

ALPHA = 0.05  # one-sided level of every "A above B" rule
SPIKE_WINDOW = 10  # rolling median over the previous 10 steps
GRAD_SPIKE = 5.0  # grad norm above 5 x its rolling median
KL_SPIKE = 25.0  # KL above 25 x its rolling median (KL grows with the square of the step: 5^2)


def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the incomplete beta function (modified Lentz), converges for x < (a+1)/(a+b+2)."""
    tiny, eps = 1e-300, 1e-15
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 500):
        m2 = 2 * m
        aa = m * (b - m) * x / ((qam + m2) * (a + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        h *= d * c
        aa = -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < eps:
            break
    return h


def betainc(a: float, b: float, x: float) -> float:
    """Regularised incomplete beta I_x(a, b) for a, b > 0, 0 <= x <= 1."""
    if not (a > 0 and b > 0):
        raise ValueError(f"betainc needs a, b > 0, got {a}, {b}")
    if not 0.0 <= x <= 1.0:
        raise ValueError(f"betainc needs 0 <= x <= 1, got {x}")
    if x == 0.0 or x == 1.0:
        return x
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _betacf(a, b, x) / a
    return 1.0 - front * _betacf(b, a, 1.0 - x) / b


def t_sf(t: float, df: float) -> float:
    """Upper tail P(T > t) of Student's t with ``df`` (> 0, may be fractional) degrees of freedom."""
    if not df > 0:
        raise ValueError(f"t_sf needs df > 0, got {df}")
    if math.isinf(t):
        return 0.0 if t > 0 else 1.0
    if math.isinf(df):
        return 0.5 * math.erfc(t / math.sqrt(2.0))
    tail = 0.5 * betainc(df / 2.0, 0.5, df / (df + t * t))  # P(T > |t|)
    return tail if t >= 0 else 1.0 - tail


def t_ppf(q: float, df: float) -> float:
    """The t value with P(T <= t) = q (bisection on :func:`t_sf`; for critical values in captions)."""
    if not 0.0 < q < 1.0:
        raise ValueError(f"t_ppf needs 0 < q < 1, got {q}")
    lo, hi = -1e3, 1e3
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if 1.0 - t_sf(mid, df) < q:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


@dataclass(frozen=True)
class Welch:
    """Welch's test of mean(a) > mean(b): difference, t, Welch-Satterthwaite df, one-sided p
    (n_b = 0: a one-sample test of mean(a) > mu, df = n_a - 1)."""

    diff: float
    t: float
    df: float
    p: float
    n_a: int
    n_b: int
    sides: int = 1  # 1: p = P(T > t) (mean(a) > mean(b)); 2: p = P(|T| > |t|) (the means differ)

    @property
    def holds(self) -> bool:
        """mean(a) > mean(b) at one-sided level ALPHA (two-sided: the means differ at level ALPHA)."""
        return self.p < ALPHA

    def text(self) -> str:
        one = self.n_b == 0  # a one-sample test
        n = f"n = {self.n_a}" if one else f"n = {self.n_a} / {self.n_b}"
        if self.n_a < 2 or (not one and self.n_b < 2):
            diff = "no difference" if math.isnan(self.diff) else f"difference {self.diff:+.3f}"  # a side without runs
            return f"{diff}, {n}: too few runs for a test"
        name = "t" if one else "Welch t"
        side = "one" if self.sides == 1 else "two"
        return f"difference {self.diff:+.3f}, {name} = {self.t:.2f}, df = {self.df:.1f}, {side}-sided p = {self.p:.3f}, {n}"


def _clean(xs) -> list[float]:
    return [float(x) for x in xs if x is not None and not math.isnan(float(x))]


def welch(a, b) -> Welch:
    """Welch's one-sided test that mean(a) > mean(b). Fewer than 2 values on a side: p = 1 (never holds).
    Both variances 0: t = +-inf (p = 0 or 1) when the means differ, else p = 1."""
    a, b = _clean(a), _clean(b)
    na, nb = len(a), len(b)
    if na < 2 or nb < 2:
        diff = (statistics.fmean(a) if a else math.nan) - (statistics.fmean(b) if b else math.nan)
        return Welch(diff, math.nan, math.nan, 1.0, na, nb)
    ma, mb = statistics.fmean(a), statistics.fmean(b)
    qa, qb = statistics.variance(a) / na, statistics.variance(b) / nb  # squared standard errors
    diff = ma - mb
    if qa + qb == 0.0:
        t = math.inf if diff > 0 else (-math.inf if diff < 0 else 0.0)
        return Welch(diff, t, float(na + nb - 2), 0.0 if diff > 0 else 1.0, na, nb)
    t = diff / math.sqrt(qa + qb)
    df = (qa + qb) ** 2 / (qa**2 / (na - 1) + qb**2 / (nb - 1))
    return Welch(diff, t, df, t_sf(t, df), na, nb)


def welch_two_sided(a, b) -> Welch:
    """Welch's two-sided test that mean(a) != mean(b): the same t and df as :func:`welch`, p = 2 P(T_nu > |t|)
    (fewer than 2 values on a side, or t = 0: p = 1; zero variances with different means: p = 0)."""
    w = welch(a, b)
    if w.n_a < 2 or w.n_b < 2 or math.isnan(w.t) or w.t == 0.0:
        p = 1.0
    elif math.isinf(w.t):
        p = 0.0
    else:
        p = min(1.0, 2.0 * t_sf(abs(w.t), w.df))
    return Welch(w.diff, w.t, w.df, p, w.n_a, w.n_b, sides=2)


def holm(ps, alpha: float = ALPHA) -> list[bool]:
    """Holm's step-down procedure over m p-values: sorted ascending, p_(i) (i = 1..m) is rejected while
    p_(i) < alpha / (m - i + 1); the first that is not stops it. -> rejected?, in the input's order.
    The family-wise error rate (any false rejection) stays at most alpha."""
    ps = [float(p) for p in ps]
    m = len(ps)
    out = [False] * m
    for rank, i in enumerate(sorted(range(m), key=lambda j: ps[j])):
        if not ps[i] < alpha / (m - rank):
            break
        out[i] = True
    return out


def one_sample(xs, mu: float) -> Welch:
    """One-sided one-sample t test that mean(xs) > mu (df = n - 1); same fields as :class:`Welch`."""
    xs = _clean(xs)
    n = len(xs)
    if n < 2:
        return Welch((statistics.fmean(xs) if xs else math.nan) - mu, math.nan, math.nan, 1.0, n, 0)
    m, se = statistics.fmean(xs), statistics.stdev(xs) / math.sqrt(n)
    diff = m - mu
    if se == 0.0:
        return Welch(diff, math.inf if diff > 0 else -math.inf, n - 1.0, 0.0 if diff > 0 else 1.0, n, 0)
    t = diff / se
    return Welch(diff, t, n - 1.0, t_sf(t, n - 1.0), n, 0)


def spikes(xs, factor: float, window: int = SPIKE_WINDOW) -> list[int]:
    """Indices i with xs[i] > factor x median(xs[i-window:i]) (the previous ``window`` values; the first
    ``window`` values are never flagged). NaN values are skipped in the median and never flagged."""
    out = []
    for i in range(window, len(xs)):
        prev = [x for x in xs[i - window : i] if x is not None and not math.isnan(x)]
        x = xs[i]
        if prev and x is not None and not math.isnan(x) and x > factor * statistics.median(prev):
            out.append(i)
    return out


@dataclass(frozen=True)
class Stability:
    """A run's spike check: steps whose grad norm / KL spiked against the run's rolling median."""

    grad_spikes: tuple[int, ...]
    kl_spikes: tuple[int, ...]

    @property
    def destabilised(self) -> bool:
        return bool(self.grad_spikes or self.kl_spikes)

    @property
    def first(self) -> int | None:
        s = self.grad_spikes + self.kl_spikes
        return min(s) if s else None


def stability(steps, grad_norm, kl) -> Stability:
    """Per-step series (``steps`` their step numbers; grad_norm = the step's largest pre-clip norm,
    kl = the step's mean KL(old || new)) -> the steps that spiked: grad norm > GRAD_SPIKE x or
    KL > KL_SPIKE x the median of the previous SPIKE_WINDOW steps."""
    g = tuple(steps[i] for i in spikes(list(grad_norm), GRAD_SPIKE))
    k = tuple(steps[i] for i in spikes(list(kl), KL_SPIKE))
    return Stability(g, k)


__all__ = [
    "ALPHA",
    "GRAD_SPIKE",
    "KL_SPIKE",
    "SPIKE_WINDOW",
    "Stability",
    "Welch",
    "betainc",
    "holm",
    "one_sample",
    "spikes",
    "stability",
    "t_ppf",
    "t_sf",
    "welch",
    "welch_two_sided",
]
