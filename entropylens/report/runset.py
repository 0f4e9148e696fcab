"""The runs a report shows: each run's own settings, how runs are told apart, and whether they form a
controlled comparison (the condition for a verdict against the papers).

Pure pandas over two small frames (the ``runs`` view and the steps' per-update loss settings); the
report reads them once (:func:`from_connection`).

- **Settings** are each run's own: tau, eps_low / eps_high (runs), ERC band, beta1 / beta2, dual-clip c,
  entropy coefficient (steps rows, as the loss used them; min and max over the run, so a schedule shows
  as ``0 -> 0.5``). Nothing is taken from the demo.
- **Series**: the identity of a line, a bar or a panel. By default one per run. ``group_by="method"``
  or a config key (``lr``, ``seed``, ...) puts the runs that share its value in one series (drawn as the
  mean over them with a band); ``group_by="config"`` puts runs whose configs differ only in the seed
  in one series (seeds of one config).
- **Comparison**: the config keys whose values differ between runs. Keys that define a method
  (:data:`METHOD_KEYS`) count as one factor, ``method``; seeds are replicates, not a factor. The runs
  form a controlled comparison *in* a factor when it is the only one that differs.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

# config keys that are part of what a method is: runs that differ only in these compare methods
METHOD_KEYS = frozenset(
    {
        "method",
        "loss_method",
        "loss_type",
        "eps_low",
        "eps_high",
        "epsilon",
        "epsilon_high",
        "beta1",
        "beta2",
        "beta1_schedule",
        "erc",
        "erc_low",
        "erc_high",
        "dual_clip",
        "entropy_coef",
        "agg",
    }
)
REPLICATE_KEYS = frozenset({"seed"})  # replicates of one setting, never a confounder
LABEL_KEYS = frozenset({"name", "run", "run_name", "output_dir", "logging_dir", "regime"})  # names, not settings
SETTINGS = ("tau", "eps_low", "eps_high", "erc_low", "erc_high", "beta1", "beta2", "dual_clip", "entropy_coef")
STEP_SETTINGS = ("erc_low", "erc_high", "beta1", "beta2", "dual_clip", "entropy_coef")
BANDS = ("minmax", "sd")
PAPER_ERC_BAND = (0.95, 1.05)  # the ERC paper's scripts: the reference for runs without ERC
MAX_LISTED = 6  # a caption lists at most this many series, then says how many more
# measured from each run's rows, compared as settings (a run of 3 steps beside one of 10 is not controlled):
# steps recorded, updates per step (num_iterations x accumulation), responses per step (batch), group size
RECORDED_SHAPE = ("steps recorded", "updates per step", "responses per step", "group size")


def _hashable(v):
    return json.dumps(v, sort_keys=True, default=str) if isinstance(v, (list, dict, tuple)) else v


def _num(v) -> float:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return math.nan
    return f


def fmt(v) -> str:
    """A setting as a caption writes it: 0.001, 0.9, (0.9, 1.1)."""
    if isinstance(v, float):
        return "n/a" if v != v else f"{v:.4g}"
    if isinstance(v, (list, tuple)):
        return "(" + ", ".join(fmt(x) for x in v) + ")"
    return str(v)


@dataclass
class RunSet:
    """The runs of a report: ``settings`` {run: {setting: (min, max)}}, ``config`` {run: flat config},
    ``method`` {run: method}, ``series`` {run: label}, how groups are banded (``band``)."""

    method: dict[str, str]
    config: dict[str, dict]
    settings: dict[str, dict[str, tuple[float, float]]]
    group_by: str | None = None
    band: str = "minmax"
    series: dict[str, str] = field(default_factory=dict)
    recorded: dict[str, dict] = field(default_factory=dict)  # {run: {what: value}} measured (RECORDED_SHAPE)

    def __post_init__(self):
        if self.band not in BANDS:
            raise ValueError(f"band must be one of {', '.join(BANDS)}, got {self.band!r}")
        if self.group_by is not None:
            self._check_group_key()
        self.series = {r: self._label(r) for r in self.method}

    # ------------------------------------------------------------------ series
    def _check_group_key(self) -> None:
        if self.group_by in ("method", "config", "run"):
            return
        if not any(self.group_by in c for c in self.config.values()):
            keys = sorted({k for c in self.config.values() for k in c} - LABEL_KEYS - {"method"})
            raise ValueError(
                f"--group-by {self.group_by}: no run records that config key; keys: "
                + ", ".join(["method", "config", *keys])
            )

    def _label(self, run: str) -> str:
        method = str(self.method.get(run) or "?")
        key = self.group_by
        if key is None or key == "run":
            return run if run.startswith(method) else f"{run} ({method})"
        if key == "method":
            return self.method_label(run)
        if key == "config":
            differing = [k for k in self.factors(replicates=False) if k != "method"]
            cfg = self.config[run]
            parts = [method] + [f"{k}={fmt(cfg.get(k, self.recorded.get(run, {}).get(k)))}" for k in differing]
            return " ".join(parts)
        v = self.config[run].get(key)
        return f"{key}={fmt(v) if v is not None else '?'}"

    @property
    def grouped(self) -> bool:
        """Some series hold more than one run."""
        return len(set(self.series.values())) < len(self.series)

    def runs_of(self, series: str) -> list[str]:
        return sorted(r for r, s in self.series.items() if s == series)

    def band_text(self) -> str:
        """How a grouped series is drawn, for a caption ('' when every series is one run)."""
        if not self.grouped:
            return ""
        what = "min-max" if self.band == "minmax" else "+-1 sd"
        sizes = sorted({len(self.runs_of(s)) for s in set(self.series.values())})
        n = f"{sizes[0]}" if len(sizes) == 1 else f"{sizes[0]}-{sizes[-1]}"
        by = "seeds of one config" if self.group_by == "config" else f"by {self.group_by}"
        return f"Runs grouped {by} ({n} runs per series): line = mean over the runs, band = {what} over the runs."

    # ------------------------------------------------------------------ settings
    def setting(self, run: str, name: str) -> tuple[float, float]:
        return self.settings.get(run, {}).get(name, (math.nan, math.nan))

    def erc_band(self, run: str) -> tuple[float, float] | None:
        lo, hi = self.setting(run, "erc_low")[0], self.setting(run, "erc_high")[1]
        return (lo, hi) if lo == lo and hi == hi else None

    def has_erc(self, run: str) -> bool:
        return self.erc_band(run) is not None

    def reference_band(self) -> tuple[tuple[float, float], str]:
        """(band, whose) that runs without ERC are measured against: the ERC runs' own where they share one
        (so every run is held to the same band), else the ERC paper's (0.95, 1.05)."""
        bands = {band for r in self.method if (band := self.erc_band(r)) is not None}  # the runs with ERC
        if len(bands) == 1:
            return bands.pop(), "the ERC runs' band"
        return PAPER_ERC_BAND, "the ERC paper's band"

    def setting_text(self, name: str, runs=None) -> str:
        """'beta1 = 0.5' when the runs share it, else per series ('beta1: a 0.5, b 0 -> 0.5')."""
        runs = list(runs or self.method)
        vals = {}
        for r in runs:
            lo, hi = self.setting(r, name)
            if lo == lo:
                vals[r] = fmt(lo) if lo == hi else f"{fmt(lo)} -> {fmt(hi)}"
        if not vals:
            return ""
        if len(set(vals.values())) == 1:
            return f"{name} = {next(iter(vals.values()))}"
        return f"{name}: " + ", ".join(f"{self.series[r]} {v}" for r, v in sorted(vals.items()))

    # ------------------------------------------------------------------ comparison
    def factors(self, replicates: bool = True) -> dict[str, list]:
        """{factor: distinct values} over the runs: config keys that differ (method-defining keys folded
        into ``method``); ``replicates``: include the seed."""
        runs = list(self.method)
        out: dict[str, list] = {}
        methods = sorted({str(self.method[r]) for r in runs})
        method_cfg = {
            json.dumps({k: _hashable(self.config[r].get(k)) for k in METHOD_KEYS}, sort_keys=True, default=str)
            for r in runs
        }
        if len(methods) > 1 or len(method_cfg) > 1:
            out["method"] = sorted({self.method_label(r) for r in runs})
        for k in RECORDED_SHAPE:  # measured from the rows: what a curve's x axis and its noise mean
            vals = [self.recorded.get(r, {}).get(k) for r in runs]
            if all(v is not None for v in vals) and len(set(vals)) > 1:
                out[k] = sorted(set(vals))
        keys = sorted({k for r in runs for k in self.config[r]} - METHOD_KEYS - LABEL_KEYS)
        for k in keys:
            if k in REPLICATE_KEYS and not replicates:
                continue
            distinct = {_hashable(self.config[r].get(k)) for r in runs}
            if len(distinct) > 1:
                out[k] = sorted(distinct, key=str)
        return out

    def method_label(self, run: str) -> str:
        """The run's method with the method-defining settings that differ between the runs:
        'grpo', or 'grpo erc=(0.9, 1.1)' beside a plain grpo run."""
        runs = list(self.method)
        keys = sorted(
            k
            for k in METHOD_KEYS - {"method", "loss_method"}
            if len({_hashable(self.config[r].get(k)) for r in runs}) > 1
        )
        cfg = self.config[run]
        extra = [f"{k}={fmt(cfg[k])}" for k in keys if cfg.get(k) not in (None, [], ())]
        return " ".join([str(self.method[run])] + extra)

    def controlled_in(self) -> str | None:
        """The one factor the runs differ in (seeds aside), or None: no factor (one setting) or several."""
        f = [k for k in self.factors() if k not in REPLICATE_KEYS]
        return f[0] if len(f) == 1 else None

    def differs_text(self) -> str:
        """What a caption says instead of a verdict against the papers: 'The runs differ in lr (0.001, 0.003)
        and method (dapo, grpo): not a controlled comparison ...', or, for runs that differ in one setting
        other than the method, that they compare that setting, not methods."""
        f = {k: v for k, v in self.factors().items() if k not in REPLICATE_KEYS}
        if not f:
            return "The runs share every recorded setting."
        parts = [f"{k} ({', '.join(fmt(x) for x in v[:4])}{', ...' if len(v) > 4 else ''})" for k, v in f.items()]
        if len(parts) == 1 and "method" not in f:  # a controlled comparison, but not of methods
            return (
                f"The runs differ only in {parts[0]}: a controlled comparison of {next(iter(f))}; the papers' "
                "verdicts compare methods, so none here."
            )
        return (
            "The runs differ in "
            + (", ".join(parts[:-1]) + " and " + parts[-1] if len(parts) > 1 else parts[0])
            + ": not a controlled comparison, so no verdict against the paper."
        )


def flat_config(raw) -> dict:
    try:
        cfg = json.loads(raw) if isinstance(raw, str) else dict(raw or {})
    except (TypeError, ValueError):
        cfg = {}
    return cfg if isinstance(cfg, dict) else {}


def build(runs_df, settings_df=None, *, group_by: str | None = None, band: str = "minmax", shape_df=None) -> RunSet:
    """A RunSet from the ``runs`` view (run, method, config, tau, eps_low, eps_high) and the steps'
    per-run settings (run and, per setting of :data:`STEP_SETTINGS`, ``<name>_min`` / ``<name>_max``);
    ``shape_df``: per run the :data:`RECORDED_SHAPE` columns (:data:`_SHAPE_SQL`)."""
    method, config, settings = {}, {}, {}
    for row in runs_df.to_dict("records"):
        r = str(row["run"])
        method[r] = str(row.get("method") or "?")
        config[r] = flat_config(row.get("config"))
        settings[r] = {k: (_num(row.get(k)), _num(row.get(k))) for k in ("tau", "eps_low", "eps_high")}
    if settings_df is not None:
        for row in settings_df.to_dict("records"):
            r = str(row["run"])
            if r in settings:
                for k in STEP_SETTINGS:
                    settings[r][k] = (_num(row.get(f"{k}_min")), _num(row.get(f"{k}_max")))
    recorded = {}
    if shape_df is not None:
        for row in shape_df.to_dict("records"):
            recorded[str(row["run"])] = {
                k: (None if row.get(k) is None or row.get(k) != row.get(k) else int(row[k])) for k in RECORDED_SHAPE
            }
    return RunSet(method, config, settings, group_by=group_by, band=band, recorded=recorded)


_SETTINGS_SQL = (
    "SELECT run, "
    + ", ".join(f"min({k}) AS {k}_min, max({k}) AS {k}_max" for k in STEP_SETTINGS)
    + " FROM steps GROUP BY run"
)


_SHAPE_SQL = """
WITH st AS (SELECT run, count(DISTINCT step) AS n_steps, max("update") + 1 AS n_updates FROM steps GROUP BY run),
per_step AS (SELECT run, step, count(*) AS n FROM sequences GROUP BY run, step),
per_group AS (SELECT run, step, "group", count(*) AS n FROM sequences WHERE "group" IS NOT NULL
              GROUP BY run, step, "group")
SELECT st.run, st.n_steps AS "steps recorded", st.n_updates AS "updates per step",
       (SELECT CAST(median(n) AS BIGINT) FROM per_step AS p WHERE p.run = st.run) AS "responses per step",
       (SELECT CAST(median(n) AS BIGINT) FROM per_group AS g WHERE g.run = st.run) AS "group size"
FROM st"""


def from_connection(con, *, group_by: str | None = None, band: str = "minmax") -> RunSet:
    """The RunSet of the runs on a report connection (DuckDB or the Spark engine's)."""
    runs = con.execute("SELECT run, method, config, tau, eps_low, eps_high FROM runs").df()
    try:
        settings = con.execute(_SETTINGS_SQL).df()
    except Exception:  # noqa: BLE001 - an engine whose steps lack a settings column: runs-level only
        settings = None
    try:
        shape = con.execute(_SHAPE_SQL).df()
    except Exception:  # noqa: BLE001 - an engine without these SQL forms: the configs alone
        shape = None
    return build(runs, settings, group_by=group_by, band=band, shape_df=shape)


__all__ = ["RunSet", "build", "from_connection", "METHOD_KEYS", "PAPER_ERC_BAND", "BANDS", "fmt"]
