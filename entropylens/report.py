"""The paper-style report: analyses -> figures -> DIR/index.html, DIR/report.md and the PNGs.

The HTML opens from disk (no server, no network): images are relative files, styles are inline.
"""

from __future__ import annotations

import html
import json
from dataclasses import dataclass
from pathlib import Path

from . import plots
from .captions import TAU, observed
from .query import connect, run_analysis


@dataclass(frozen=True)
class Figure:
    name: str
    analysis: str
    plot: str  # function name in plots.py
    title: str
    caption: str
    optional: bool = False  # left out (and named under "Not shown") when its analysis has no rows
    when_empty: str = ""  # how to record what an opt-in analysis needs (report and `analyze` say it)


FIGURES: tuple[Figure, ...] = (
    Figure("entropy", "entropy_by_step", "entropy_vs_step", "Entropy vs step",
           "Mean token entropy of the rollout policy per step. Mirrors CE-GPPO Fig. 2, 3 and 5: under GRPO / DAPO "
           "entropy collapses, CE-GPPO keeps it higher."),
    Figure("reward", "reward_by_step", "reward_vs_step", "Reward vs step",
           "Mean reward of the step's responses. Mirrors CE-GPPO Fig. 2 (accuracy vs step)."),
    Figure("quadrant_share", "quadrant_share_by_step", "quadrant_share", "Quadrant shares",
           "Share of tokens in each quadrant (advantage sign x sampling probability) per step. "
           "Mirrors CE-GPPO Fig. 1 (the four token types)."),
    Figure("clip_by_quadrant", "clip_by_quadrant", "clip_by_quadrant", "Clip fractions by side and quadrant",
           "Share of each quadrant's tokens whose gradient PPO-clip removes, low and high side. "
           "Mirrors CE-GPPO Sec. 3 / Fig. 1: the dropped gradients are mostly those of low-probability tokens."),
    Figure("ratio_vs_prob", "ratio_vs_prob", "ratio_vs_prob", "Importance ratio vs probability",
           "Importance ratio against sampling probability, coloured by quadrant, with the clip interval "
           "[1 - eps_low, 1 + eps_high] shaded (a bounded sample). Mirrors CE-GPPO Fig. 1 left: the tokens "
           "that leave the interval are mostly low-probability."),
    Figure("clipped_prob", "clipped_prob_distribution", "clipped_prob", "Probability of the clipped tokens",
           "Sampling probability of the tokens whose gradient PPO-clip drops, low and high side. Mirrors "
           "CE-GPPO Sec. 3: the clipped tokens are mostly low-probability (PA&LP on the high side, NA&LP on "
           "the low side)."),
    Figure("grad_share", "grad_share_by_quadrant", "grad_share", "Gradient share by quadrant",
           "Each quadrant's share of the squared logit-gradient norm per step; dotted: the part carried by "
           "tokens PPO-clip would drop. Mirrors CE-GPPO Sec. 3 (gradient of clipped tokens)."),
    Figure("entropy_ratio", "entropy_ratio_by_step", "entropy_ratio_band", "Entropy-ratio band",
           "Median and p05-p95 of the per-token entropy ratio H(pi)/H(pi_old) per step, one panel per method, "
           "with ERC's (0.95, 1.05) band. Mirrors ERC Sec. 3: the entropy ratio is a global trust region, and "
           "ERC keeps more tokens inside the band."),
    Figure("drift_by_prob", "drift_by_prob_bin", "drift_by_prob", "Drift by probability bin",
           "Mean |log entropy ratio| by sampling-probability bin. The ERC paper reports drift strongest "
           "for tokens below 0.2 and above 0.6 (dotted lines)."),
    Figure("grad_norm", "grad_norm_by_step", "grad_norm_vs_step", "Gradient norm vs step",
           "Global gradient norm before clipping, mean over the step's updates. Mirrors CE-GPPO Fig. 4 right."),
    Figure("kl", "kl_by_step", "kl_vs_step", "KL vs step",
           "KL(pi_old || pi_theta), k3 estimator, token mean per step. Mirrors CE-GPPO Fig. 4 left."),
    Figure("entropy_budget", "entropy_budget_by_step", "entropy_budget", "Entropy budget per step",
           "First-order entropy effect of each quadrant's token gradients per step (sum of g s / T^2: the "
           "entropy change per unit logit step, exact per token), stacked; black: the step's total. The "
           "covariance law (CE-GPPO Sec. 3) says PA&HP and NA&LP lower entropy, PA&LP and NA&HP raise it."),
    Figure("clipping_removed", "entropy_budget_by_step", "clipping_removed", "What clipping removed",
           "The entropy effect that clipping, CE-GPPO's beta scaling, ERC or dual-clip took away, by quadrant, "
           "beside the effect kept. CE-GPPO argues PPO-clip drops mostly PA&LP (high side, raising entropy) "
           "and NA&LP (low side, lowering it) gradients."),
    Figure("probe", "probe_vs_measured", "probe_vs_measured", "Parameter-space probe",
           "The probe's first-order prediction grad(H) . optimizer step (Adam's own preconditioner) against "
           "the entropy change measured after the real step, and each quadrant's share through the shared "
           "parameters (demo --probe-every K).", optional=True,
           when_empty="The parameter-space probe is opt-in: record it with `entropylens demo --probe-every K` "
                      "or by calling `Recorder.probe` every K steps (entropylens/probe.py)."),
    Figure("entropy_change", "entropy_change_by_quadrant", "entropy_change",
           "Entropy drift by quadrant (confounded, not an attribution)",
           "A position's entropy at its next update minus now, per quadrant of its sampled token, minus the "
           "run's mean. Confounded: high-probability positions (low entropy) tend to rise and low-probability "
           "ones to fall whatever the advantage sign, so this does not test the covariance law; the entropy "
           "budget above attributes the change to the tokens' own gradients."),
)

SUMMARY_COLUMNS = ("run", "method", "status", "steps", "tokens", "final_entropy", "min_entropy", "final_reward",
                   "clip_low_frac", "clip_high_frac", "erc_drop_frac", "hyperparameters")
_HYPER_KEYS = ("eps_low", "eps_high", "beta1", "beta2", "erc", "dual_clip", "entropy_coef", "lr", "seed")


def _hyper(row) -> str:
    try:
        cfg = json.loads(row["config"] or "{}")
    except (TypeError, json.JSONDecodeError):
        cfg = {}
    cfg = {**cfg, "eps_low": row.get("eps_low"), "eps_high": row.get("eps_high")}
    parts = []
    for k in _HYPER_KEYS:
        v = cfg.get(k)
        if isinstance(v, float) and v != v:
            continue
        if k in ("beta1", "beta2"):  # CE-GPPO's: shown for ce_gppo runs, 0 included (beta1 = 0 is a setting)
            if (cfg.get("loss_method") or cfg.get("method")) != "ce_gppo" or v is None:
                continue
        elif v in (None, 0, 0.0, [], ()) and k not in ("seed",):
            continue
        parts.append(f"{k}={round(v, 4) if isinstance(v, float) else v}")
    return ", ".join(parts)


def summary_table(con):
    df = run_analysis(con, "run_summary")
    df["hyperparameters"] = [_hyper(r) for r in df.to_dict("records")]
    return df[list(SUMMARY_COLUMNS)]


def _fmt(v) -> str:
    if v is None or (isinstance(v, float) and v != v):
        return "-"
    if isinstance(v, float) and v.is_integer() and abs(v) < 1e15:
        return str(int(v))
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def _connect(path, runs, engine: str):
    if engine == "spark":  # the same analyses on Spark (entropylens.spark); DuckDB is canonical
        from .spark import connect as spark_connect

        return spark_connect(path, runs=runs)
    if engine == "duckdb":
        con = connect(path, runs=runs)
        con.execute("SET enable_progress_bar = false")  # no bar characters in logs and demo output
        return con
    raise ValueError(f"unknown engine {engine!r}: duckdb or spark")


def _render(con, out: Path, f: Figure) -> tuple[str | None, str]:
    """One figure: its analysis, its PNG in ``out`` -> (png file name, measured caption); (None, '')
    for an opt-in figure whose analysis has no rows."""
    import matplotlib.pyplot as plt

    df = run_analysis(con, f.analysis)
    if f.optional and df.empty:
        return None, ""
    taus = _taus(con) if f.name in TAU else None  # the runs' HP / LP threshold, stated in the caption
    fig = getattr(plots, f.plot)(df, **_tau_arg(f.plot, taus))
    png = f"{f.name}.png"
    fig.savefig(out / png, dpi=110)
    plt.close(fig)
    return png, observed(f.name, df, taus)


def _taus(con) -> dict:
    """{run: tau} of the runs on ``con`` ({} where the engine cannot say)."""
    try:
        return {r: t for r, t in con.execute("SELECT run, tau FROM runs").fetchall()}
    except Exception:  # noqa: BLE001 - a caption detail never fails the report
        return {}


def _tau_arg(plot: str, taus: dict | None) -> dict:
    """The clipped-token histogram draws tau: the runs' own value where they share one."""
    vals = {float(v) for v in (taus or {}).values() if v is not None and v == v}
    return {"tau": vals.pop()} if plot == "clipped_prob" and len(vals) == 1 else {}


def open_report(path, runs: list[str] | None = None, engine: str = "duckdb"):
    """The connection the report's analyses run on (for :func:`render_figure`)."""
    return _connect(path, runs, engine)


def render_figure(con, out_dir, name: str) -> tuple[str | None, str]:
    """Figure ``name`` on an open connection (:func:`open_report`) into ``out_dir`` -> (png or None,
    caption), for :func:`write_report`'s ``done`` (a demo worker draws several on one connection)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    return _render(con, out, next(f for f in FIGURES if f.name == name))


def render_figures(path, out_dir, names, *, runs: list[str] | None = None, engine: str = "duckdb") -> dict:
    """The figures ``names`` only (a part of a report drawn in another process, e.g. by a demo worker):
    {name: (png or None, caption)}, for :func:`write_report`'s ``elsewhere`` / ``done``."""
    con = _connect(path, runs, engine)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    return {f.name: _render(con, out, f) for f in FIGURES if f.name in set(names)}


def write_report(path, out_dir, *, runs: list[str] | None = None, engine: str = "duckdb",
                 elsewhere: tuple[str, ...] = (), done=None, on_summary=None) -> Path:
    """Runs every figure's analysis over the runs under ``path``; writes index.html, report.md and
    one PNG per figure into ``out_dir``. Returns the path of index.html. ``elsewhere``: names of
    figures drawn into ``out_dir`` by another process (:func:`render_figures`); ``done`` gives their
    {name: (png or None, caption)}: a dict, or a callable called once the others are drawn here.
    ``on_summary``: called with the run table (:func:`summary_table`), e.g. to print it too."""
    con = _connect(path, runs, engine)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    summary = summary_table(con)
    if on_summary is not None:
        on_summary(summary)
    drawn = {f.name: _render(con, out, f) for f in FIGURES if f.name not in set(elsewhere)}
    if elsewhere:
        drawn.update(done() if callable(done) else done)
    rendered, not_shown = [], []
    for f in FIGURES:
        png, caption = drawn[f.name]
        if png is None:
            not_shown.append(f)
        else:
            rendered.append((f, png, caption))
    _write_markdown(out / "report.md", summary, rendered, not_shown)
    index = out / "index.html"
    index.write_text(_html(summary, rendered, not_shown))
    return index


def _not_shown_text(not_shown) -> str:
    """One sentence naming the optional figures these runs hold no data for, or ''."""
    if not not_shown:
        return ""
    names = "; ".join(f"{f.title} (`{f.analysis}`: no rows in these runs)" for f in not_shown)
    hints = " ".join(dict.fromkeys(f.when_empty for f in not_shown if f.when_empty))
    return f"Not shown: {names}." + (f" {hints}" if hints else "")


def when_empty(analysis: str) -> str:
    """How to record the data an opt-in analysis needs ('' for the others)."""
    return next((f.when_empty for f in FIGURES if f.analysis == analysis and f.when_empty), "")


def _write_markdown(path: Path, summary, rendered, not_shown=()) -> None:
    lines = ["# entropylens report", "", "## Runs", ""]
    lines.append("| " + " | ".join(SUMMARY_COLUMNS) + " |")
    lines.append("|" + "---|" * len(SUMMARY_COLUMNS))
    for row in summary.to_dict("records"):
        lines.append("| " + " | ".join(_fmt(row[c]).replace("|", "/") for c in SUMMARY_COLUMNS) + " |")
    lines.append("")
    for f, png, seen in rendered:
        lines += [f"## {f.title}", "", f"![{f.title}]({png})", "", f"*{f.caption}* {seen} (analysis: `{f.analysis}`)",
                  ""]
    if not_shown:
        lines += [_not_shown_text(not_shown), ""]
    path.write_text("\n".join(lines))


def _html(summary, rendered, not_shown=()) -> str:
    e = html.escape
    head = "".join(f"<th>{e(c)}</th>" for c in SUMMARY_COLUMNS)
    rows = "".join(
        "<tr>" + "".join(f"<td>{e(_fmt(r[c]))}</td>" for c in SUMMARY_COLUMNS) + "</tr>"
        for r in summary.to_dict("records")
    )
    figs = "".join(
        f'<figure id="{e(f.name)}"><h2>{e(f.title)}</h2><img src="{e(png)}" alt="{e(f.title)}">'
        f"<figcaption>{e(f.caption)} <b>{e(seen)}</b> <code>entropylens analyze PATH {e(f.analysis)}</code>"
        "</figcaption></figure>"
        for f, png, seen in rendered
    )
    if not_shown:
        figs += f"<p>{e(_not_shown_text(not_shown).replace('`', ''))}</p>"
    toc = " · ".join(f'<a href="#{e(f.name)}">{e(f.title)}</a>' for f, *_ in rendered)
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>entropylens report</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1150px; color: #222; }}
table {{ border-collapse: collapse; font-size: 13px; }} td, th {{ border: 1px solid #ccc; padding: 3px 6px; }}
th {{ background: #f3f3f3; }} figure {{ margin: 2em 0; }} img {{ max-width: 100%; }}
figcaption {{ color: #444; font-size: 14px; }} nav {{ font-size: 13px; margin: 1em 0; }}
</style></head>
<body><h1>entropylens report</h1>
<nav>{toc}</nav>
<h2>Runs</h2><table><tr>{head}</tr>{rows}</table>
{figs}
</body></html>
"""
