"""Ranges of the analyses' parameters, checked before any SQL runs (one-line errors).

A parameter is known by its name across every analysis (``bins`` means the same everywhere).
Values arrive as strings from the CLI or as numbers from Python.
"""

from __future__ import annotations

# name -> (kind, low, high, inclusive-low, inclusive-high, what it is)
RULES: dict[str, tuple[str, float, float, bool, bool, str]] = {
    "bins": ("int", 1, 10_000, True, True, "number of probability bins"),
    "points": ("int", 1, 10_000_000, True, True, "points per run"),
    "tau": ("float", 0.0, 1.0, True, True, "probability threshold"),
    "band_low": ("float", 0.0, float("inf"), False, False, "entropy-ratio band, low edge"),
    "band_high": ("float", 0.0, float("inf"), False, False, "entropy-ratio band, high edge"),
    "mismatch": (
        "float",
        0.0,
        float("inf"),
        True,
        False,
        "|old_logprob - sampler_logprob| above which a token is mismatched, nats",
    ),
}


class ParamError(ValueError):
    """A parameter value outside its range (a one-line message)."""


def _number(name: str, value, kind: str) -> float:
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise ParamError(f"parameter {name}={value!r} is not a number") from None
    if v != v:
        raise ParamError(f"parameter {name} must be a number, got NaN")
    if kind == "int" and not float(v).is_integer():
        raise ParamError(f"parameter {name} must be a whole number, got {value}")
    return v


def check(params: dict) -> None:
    """Raise :class:`ParamError` for the first value out of its range; unknown names pass."""
    for name, value in params.items():
        rule = RULES.get(name)
        if rule is None or isinstance(value, (list, tuple)) or str(value).lstrip().startswith("["):
            continue
        kind, lo, hi, lo_in, hi_in, what = rule
        v = _number(name, value, kind)
        ok = (v >= lo if lo_in else v > lo) and (v <= hi if hi_in else v < hi)
        if not ok:
            left = "[" if lo_in else "("
            right = "]" if hi_in else ")"
            rng = f"in {left}{lo:g}, {hi:g}{right}" if hi != float("inf") else f"> {lo:g}"
            if kind == "int" and lo_in and hi_in:
                rng = f"a whole number from {lo:g} to {hi:g}"
            raise ParamError(f"parameter {name} ({what}) must be {rng}, got {value}")
    band_low, band_high = params.get("band_low"), params.get("band_high")
    if band_low is not None and band_high is not None and float(band_low) >= float(band_high):
        raise ParamError(f"parameter band_low ({band_low}) must be below band_high ({band_high})")
