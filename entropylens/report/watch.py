"""`entropylens watch PATH`: a terminal view of runs while they are written.

Three parts, kept apart so that the view is testable without a terminal or a run:

- :func:`snapshot` (I/O): one fresh connection (the views are a snapshot at connect time, so each
  refresh reconnects), the ``steps`` table only (never ``tokens``): the last ``tail`` steps of each
  run aggregated over their updates and ranks, the runs' method and status, and the alarms'
  findings over all steps (analysis ``step_health`` through :func:`entropylens.alarms.evaluate`,
  the rules of ``entropylens check``; no rule is restated here).
- :func:`render` (pure): a per-step DataFrame (+ findings, + the runs' status) -> a rich renderable.
- :func:`watch` (the loop): rich ``Live``, refreshed every ``interval`` seconds until every run's
  status is finished / failed, or Ctrl-C.

Per step the view shows, aggregated as the ``step_health`` analysis does (token-weighted over the
step's updates and ranks): H_old (``old_entropy_mean``, the rollout policy's entropy; the alarms'
H_t), H (``entropy_mean``), the reward (``reward_mean``), the clip fractions by side (low: r < 1-eps_low
and A < 0; high: r > 1+eps_high and A > 0) and by quadrant (``clip_frac_pa_hp`` ... weighted by the
quadrant's tokens), the entropy ratio rho's p05 / p50 / p95 (lowest p05, median p50, highest p95 of
the step's updates) and, for runs with an ERC band, the share of tokens outside it (``erc_drop_frac``:
the tokens whose rho leaves the band). Entropies are printed to 4 decimals.
"""

from __future__ import annotations

import math
import time
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..alarms import Finding, Thresholds, evaluate
from .escape import terminal as _t  # run ids and statuses as printed: no raw control or bidi character

if TYPE_CHECKING:
    import pandas as pd

ENDED = ("finished", "failed")  # a run in one of these states is written no more
TAIL = 48  # steps per run read at each refresh (the sparkline's length)
LAST = 8  # steps per run in the table
SPARK = "▁▂▃▄▅▆▇█"

_WAVG = "sum(s.{c} * s.{w}) / nullif(sum(CASE WHEN s.{c} IS NOT NULL THEN s.{w} END), 0) AS {c}"
_TOKEN_WEIGHTED = (
    "entropy_mean",
    "old_entropy_mean",
    "clip_low_frac",
    "clip_high_frac",
    "clipped_frac",
    "erc_drop_frac",
    "kl_k3",
)
QUADRANTS = ("pa_hp", "pa_lp", "na_hp", "na_lp")
QUADRANT_NAMES = ("PA&HP", "PA&LP", "NA&HP", "NA&LP")
WIDE = 100  # columns from which the table holds the quadrants' clip fractions (else a line below it)

STEPS_SQL = f"""
SELECT s.run, s.step, count(*) AS n_rows, sum(s.n_tokens) AS n_tokens,
    {", ".join(_WAVG.format(c=c, w="n_tokens") for c in _TOKEN_WEIGHTED)},
    {", ".join(_WAVG.format(c=f"clip_frac_{q}", w=f"n_{q}") for q in QUADRANTS)},
    avg(s.reward_mean) AS reward_mean,
    avg(s.grad_norm) AS grad_norm,
    min(s.entropy_ratio_p05) AS entropy_ratio_p05,
    median(s.entropy_ratio_p50) AS entropy_ratio_p50,
    max(s.entropy_ratio_p95) AS entropy_ratio_p95,
    min(s.erc_low) AS erc_low,
    max(s.erc_high) AS erc_high,
    count(*) OVER (PARTITION BY s.run) AS n_steps
FROM steps AS s
GROUP BY s.run, s.step
QUALIFY row_number() OVER (PARTITION BY s.run ORDER BY s.step DESC) <= ?
ORDER BY s.run, s.step
"""


@dataclass
class Snapshot:
    """What one refresh read: ``steps`` (per run and step, the last ``tail`` steps of each run; columns of
    STEPS_SQL), ``runs`` (run -> (method, status)), the alarms' ``findings`` over all steps, and the
    unreadable files the connection skipped (``skipped``: their warnings' text)."""

    steps: pd.DataFrame
    runs: dict[str, tuple[str | None, str | None]]
    findings: list[Finding] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    taken_at: float = field(default_factory=time.time)

    @property
    def ended(self) -> bool:
        """Every watched run is finished or failed (a stale run, whose heartbeat stopped, is not)."""
        return bool(self.runs) and all(status in ENDED for _, status in self.runs.values())


def snapshot(path, runs: list[str] | None = None, thresholds: Thresholds | None = None, tail: int = TAIL) -> Snapshot:
    """One refresh: a fresh connection (later steps appear only in a new one), the steps table only.
    Raises what :func:`entropylens.read.query.connect` raises (QueryError for a missing path, no run, an
    unknown run)."""
    import duckdb

    from ..read.query import QueryError, UnreadableFileWarning, connect, render_analysis

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", UnreadableFileWarning)
        con = connect(path, runs=runs)
    skipped = [str(w.message) for w in caught if issubclass(w.category, UnreadableFileWarning)]
    try:
        steps = con.execute(STEPS_SQL, [int(tail)]).df()
        info = {
            str(r): (m, s) for r, m, s in con.execute("SELECT run, method, status FROM runs ORDER BY run").fetchall()
        }
        # the alarms exactly as `entropylens check` computes them (report/checks.py): step_health read as
        # Python values (NULL stays None, NaN stays NaN), the rules in alarms.evaluate
        cur = con.execute(render_analysis("step_health"))
        names = [d[0] for d in cur.description]
        rows = [dict(zip(names, r)) for r in cur.fetchall()]
    except duckdb.InterruptException:  # Ctrl-C inside a query: DuckDB's own exception, the user's Ctrl-C
        raise KeyboardInterrupt from None
    except duckdb.Error as e:
        raise QueryError(f"watch: reading the steps failed: {str(e).splitlines()[0]}") from None
    finally:
        con.close()
    return Snapshot(steps=steps, runs=info, findings=evaluate(rows, thresholds), skipped=skipped)


# ---------------------------------------------------------------- rendering (pure)


def _val(v) -> float | None:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return None if f != f else f  # NaN (missing in a DataFrame) -> None; inf stays


def fmt(v, digits: int = 4) -> str:
    """A number as the view prints it: `digits` decimals; '-' where missing (a DataFrame's NULL and NaN
    look alike: a NaN value shows as '-' too, and the nonfinite alarm names it); 'inf' / '-inf'."""
    f = _val(v)
    if f is None:
        return "-"
    if math.isinf(f):
        return "inf" if f > 0 else "-inf"
    return f"{f:.{digits}f}"


def _pct(v) -> str:
    f = _val(v)
    return "-" if f is None or math.isinf(f) else f"{100 * f:.1f}%"


def sparkline(values) -> str:
    """One character per value (▁ lowest .. █ highest of those given); a missing value is a space."""
    xs = [_val(v) for v in values]
    finite = [x for x in xs if x is not None and math.isfinite(x)]
    if not finite:
        return ""
    lo, hi = min(finite), max(finite)
    out = []
    for x in xs:
        if x is None or not math.isfinite(x):
            out.append(" ")
        elif hi == lo:
            out.append(SPARK[len(SPARK) // 2])
        else:
            out.append(SPARK[min(len(SPARK) - 1, int((x - lo) / (hi - lo) * len(SPARK)))])
    return "".join(out)


def _h(row) -> float | None:
    """The step's entropy as the alarms read it: old_entropy (the rollout policy's), else entropy."""
    h = _val(row.get("old_entropy_mean"))
    return _val(row.get("entropy_mean")) if h is None else h


def _run_view(run: str, df, findings: list[Finding], method: str | None, status: str | None, last: int):
    from rich.console import Group
    from rich.panel import Panel
    from rich.text import Text

    rows = df.sort_values("step").to_dict("records")
    colour = {"finished": "green", "failed": "red", "stale": "red", "running": "cyan"}.get(status or "", "white")
    title = Text.assemble((_t(run), "bold"), "  ", (_t(method or "?"), "magenta"), "  ", (_t(status or "?"), colour))
    if not rows:
        return Panel(Text("no step committed yet"), title=title, title_align="left")
    latest = rows[-1]
    n_steps = int(latest.get("n_steps") or len(rows))
    hs = [_h(r) for r in rows]
    finite = [h for h in hs if h is not None and math.isfinite(h)]
    head = Text.assemble(
        ("latest step ", "dim"),
        (str(int(latest["step"])), "bold"),
        ("  steps ", "dim"),
        str(n_steps),
        ("  tokens ", "dim"),
        str(int(_val(latest.get("n_tokens")) or 0)),
        ("  H_old ", "dim"),
        (fmt(latest.get("old_entropy_mean")), "bold"),
        ("  H ", "dim"),
        fmt(latest.get("entropy_mean")),
        ("  reward ", "dim"),
        fmt(latest.get("reward_mean")),
    )
    spark = Text.assemble(
        (f"entropy, last {len(rows)} step{'s' if len(rows) != 1 else ''} ", "dim"),
        (sparkline(hs), "yellow"),
        (f"  {fmt(min(finite))} .. {fmt(max(finite))}" if finite else "", "dim"),
    )
    has_band = any(_val(r.get("erc_low")) is not None or _val(r.get("erc_high")) is not None for r in rows)
    tables = {wide: _step_table(rows[-last:], wide) for wide in (True, False)}
    quads = Text.assemble(
        ("clip by quadrant, step ", "dim"),
        str(int(latest["step"])),
        ": ",
        *(f"{name} {_pct(latest.get(f'clip_frac_{q}'))}  " for q, name in zip(QUADRANTS, QUADRANT_NAMES)),
    )
    band_note = Text(
        "clip: share of tokens whose gradient PPO-clip removes (by side; by quadrant: of that "
        "quadrant's tokens)"
        + (
            "; out of band: tokens whose entropy ratio leaves the ERC band "
            f"[{fmt(latest.get('erc_low'), 3)}, {fmt(latest.get('erc_high'), 3)}]"
            if has_band
            else "; no ERC band in this run"
        ),
        style="dim",
    )
    mine = [f for f in findings if f.run == run]
    if mine:
        alarms = Text(f"alarms ({len(mine)}):", style="bold red")
        for f in mine[-5:]:
            alarms.append(
                f"\n  step {f.step} {f.rule} value={f.value:.4g} threshold={f.threshold:.4g}"
                + (f" signal={f.signal}" if f.signal else ""),
                style="red",
            )
        if len(mine) > 5:
            alarms.append(f"\n  ({len(mine) - 5} earlier: entropylens check)", style="dim")
    else:
        alarms = Text("alarms: none", style="green")
    return Panel(
        _ByWidth(
            Group(head, spark, tables[True], band_note, alarms),
            Group(head, spark, tables[False], quads, band_note, alarms),
        ),
        title=title,
        title_align="left",
    )


class _ByWidth:
    """The wide renderable where it fits (WIDE columns), else the narrow one."""

    def __init__(self, wide, narrow):
        self.wide, self.narrow = wide, narrow

    def __rich_console__(self, console, options):
        yield self.wide if options.max_width >= WIDE else self.narrow


def _step_table(rows: list[dict], wide: bool):
    """The last steps, one line each; ``wide``: with the four quadrants' clip fractions."""
    from rich.table import Table

    table = Table(box=None, pad_edge=False, header_style="bold", padding=(0, 1))
    names = ["step", "H_old", "H", "reward", "clip\nlow", "clip\nhigh"]
    names += [f"clip\n{n}" for n in QUADRANT_NAMES] if wide else []
    names += ["rho\np05", "rho\np50", "rho\np95", "out of\nband"]
    for name in names:
        table.add_column(name, justify="right", no_wrap=True)
    for r in rows:
        band = (
            _pct(r.get("erc_drop_frac"))
            if _val(r.get("erc_low")) is not None or _val(r.get("erc_high")) is not None
            else "-"
        )
        quads = [_pct(r.get(f"clip_frac_{q}")) for q in QUADRANTS] if wide else []
        table.add_row(
            str(int(r["step"])),
            fmt(r.get("old_entropy_mean")),
            fmt(r.get("entropy_mean")),
            fmt(r.get("reward_mean"), 3),
            _pct(r.get("clip_low_frac")),
            _pct(r.get("clip_high_frac")),
            *quads,
            fmt(r.get("entropy_ratio_p05"), 3),
            fmt(r.get("entropy_ratio_p50"), 3),
            fmt(r.get("entropy_ratio_p95"), 3),
            band,
        )
    return table


def render(
    steps, findings: list[Finding] | tuple = (), runs: dict | None = None, *, last: int = LAST, note: str | None = None
):
    """The view of per-step rows (one row per run and step, the columns of STEPS_SQL; missing ones show
    '-'): one panel per run with its latest step, an entropy sparkline, the last ``last`` steps and the
    alarms that fired. ``runs``: run -> (method, status); runs there without a step show too. Pure:
    no I/O, the same frame gives the same renderable."""
    from rich.console import Group
    from rich.text import Text

    runs = dict(runs or {})
    names = sorted(set(map(str, steps["run"])) | set(runs)) if len(steps.columns) else sorted(runs)
    parts = []
    for run in names:
        df = steps[steps["run"].astype(str) == run] if len(steps) else steps
        method, status = runs.get(run, (None, None))
        parts.append(_run_view(run, df, list(findings), method, status, last))
    if note:
        parts.append(Text(note, style="dim"))
    return Group(*parts)


def summary_line(snap: Snapshot) -> str:
    """The last line of a watch: each run's status and last step."""
    last: dict[str, int] = {}
    if len(snap.steps):
        for run, step in zip(snap.steps["run"], snap.steps["step"]):
            last[str(run)] = max(int(step), last.get(str(run), -1))
    parts = [
        f"{_t(run)} {_t(status or '?')} at step {last[run]}"
        if run in last
        else f"{_t(run)} {_t(status or '?')} (no step)"
        for run, (_, status) in sorted(snap.runs.items())
    ]
    n_alarms = len(snap.findings)
    return (
        f"watch: {'all ' if snap.ended else ''}{len(snap.runs)} run(s) "
        f"{'ended' if snap.ended else 'watched'}: {', '.join(parts)}; {n_alarms} alarm(s)"
    )


# ---------------------------------------------------------------- the loop


def watch(
    path,
    *,
    runs: list[str] | None = None,
    interval: float = 2.0,
    thresholds: Thresholds | None = None,
    console=None,
    last: int = LAST,
    first: Snapshot | None = None,
) -> tuple[Snapshot, bool]:
    """Show the runs under ``path`` live until every one has ended (finished / failed) or Ctrl-C.
    Returns (the last snapshot, interrupted). ``first``: an already read snapshot (the CLI reads one to
    report a bad PATH before the view starts). A refresh that fails later (a file gone mid-read) keeps
    the last view and says so under it."""
    from rich.console import Console
    from rich.live import Live

    console = console or Console()
    snap = first or snapshot(path, runs, thresholds)

    def view(s: Snapshot, problem: str | None = None):
        note = time.strftime("refreshed %H:%M:%S", time.localtime(s.taken_at)) + f" every {interval:g} s; Ctrl-C leaves"
        if s.skipped:
            note += f"; {len(s.skipped)} unreadable file(s) skipped (entropylens verify)"
        if problem:
            note += f"; last refresh failed: {_t(problem)}"
        return render(s.steps, s.findings, s.runs, last=last, note=note)

    interrupted = False
    try:
        with Live(
            view(snap), console=console, auto_refresh=False, redirect_stderr=False, vertical_overflow="visible"
        ) as live:
            while not snap.ended:
                time.sleep(interval)
                problem = None
                try:
                    snap = snapshot(path, runs, thresholds)
                except (ValueError, OSError) as e:  # QueryError is a ValueError
                    problem = str(e).splitlines()[0] if str(e) else type(e).__name__
                live.update(view(snap, problem), refresh=True)
    except KeyboardInterrupt:
        interrupted = True
    if not console.is_terminal:
        console.line()  # Live ends a terminal's view with a newline, not a file's
    return snap, interrupted


__all__ = ["Snapshot", "snapshot", "render", "sparkline", "summary_line", "watch", "fmt", "STEPS_SQL"]
