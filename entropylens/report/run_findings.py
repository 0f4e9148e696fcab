"""Findings about a whole run, from its token rows: a quadrant too thin to read (the tau was wrong for the
run) and a run trained on-policy (every ratio exactly 1: clipping, CE-GPPO and ERC cannot act).

- ``thin_quadrant``: a real quadrant (PA&HP, PA&LP, NA&HP, NA&LP) holds < 1% of the run's tokens of
  nonzero advantage. The signal gives the run's token-probability quantiles (p05, p50, p95), exp(-H) at the
  run's mean entropy H, and a suggested tau: the median token probability p50 (each of HP / LP then holds
  half the tokens). ``entropylens report --tau`` re-splits after the fact (read/retau.py).
- ``on_policy``: every recorded ratio r = exp(logprob - old_logprob) is 1, over at least one token (the advice
  in the run's trainer's settings, ON_POLICY_BY_FRAMEWORK): every
  |logprob - old_logprob| <= ON_POLICY_TOL (1e-5: the noise of an old log-prob recomputed in float32 in a
  separate pass, far below the narrowest clip band, GSPO's 3e-4).
"""

from __future__ import annotations

import math

from ..alarms import Finding
from ..read.views import sql_str
from ..schema import QUADRANTS


class OnPolicyWarning(UserWarning):
    """A trainer set up so that every ratio is 1 (TRL: it keeps no old log-probs): warned once, at its start."""


THIN_SHARE = 0.01  # a quadrant below this share of a run's signed tokens is called thin
ON_POLICY_TOL = 1e-5  # |log r| at or below this counts as r = 1 (a recomputed old log-prob's float32 noise)
ON_POLICY_TEXT = (
    "every ratio is 1: clipping, CE-GPPO and ERC cannot act; set num_iterations > 1 or "
    "steps_per_generation > gradient_accumulation_steps"
)  # TRL's settings
# the same finding in the words of the run's trainer (run.json config.framework); a loop of one's own: generic
ON_POLICY_BY_FRAMEWORK: dict[str | None, str] = {
    "trl": ON_POLICY_TEXT,
    "verl": (
        "every ratio is 1: clipping, CE-GPPO and ERC cannot act; set actor_rollout_ref.actor.ppo_epochs > 1 "
        "or ppo_mini_batch_size < data.train_batch_size"
    ),
    None: (
        "every ratio is 1: clipping, CE-GPPO and ERC cannot act; take more than one optimizer step per batch "
        "of rollouts (TRL: num_iterations > 1; verl: ppo_epochs > 1 or several mini-batches)"
    ),
}


def _rows(con, sql: str) -> list[dict]:
    cur = con.execute(sql)
    names = [d[0] for d in cur.description]
    return [dict(zip(names, r)) for r in cur.fetchall()]


def suggest_tau(p50: float) -> str:
    """The median p as a --tau to type: 3 significant digits, rounded down so that the median token is HP
    (p >= tau) and the split falls at the median, not above it."""
    text = f"{p50:.3g}"
    if float(text) > p50:
        digits = 3 - 1 - math.floor(math.log10(p50))
        text = f"{math.floor(p50 * 10**digits) / 10**digits:.{max(digits, 0)}f}".rstrip("0").rstrip(".")
    return text


def thin_quadrants(con) -> list[Finding]:
    """One ``thin_quadrant`` finding per (run, quadrant) below THIN_SHARE (at the run's first step). The
    quadrant counts are read first; the probability quantiles (three sorts of every signed token's p) only for
    the runs with a thin quadrant, whose rows are then the same as from one query over every run."""
    n: dict[str, int] = {}  # run -> signed tokens
    per_q: dict[str, dict[str, int]] = {}  # run -> real quadrant -> tokens
    for r in _rows(
        con,
        "SELECT run, quadrant, count(*) AS k FROM tokens WHERE advantage <> 0 AND prob IS NOT NULL GROUP BY run, quadrant",
    ):
        run = str(r["run"])
        n[run] = n.get(run, 0) + r["k"]
        qs = per_q.setdefault(run, dict.fromkeys(QUADRANTS, 0))
        if r["quadrant"] in qs:
            qs[r["quadrant"]] = r["k"]
    thin = sorted(run for run in n if n[run] and min(per_q[run].values()) / n[run] < THIN_SHARE)
    if not thin:
        return []
    counts = ", ".join(f"count(*) FILTER (WHERE quadrant = '{q}') AS \"{q}\"" for q in QUADRANTS)
    rows = _rows(
        con,
        f"""
        SELECT run, min(step) AS step, count(*) AS n, {counts},
               quantile_cont(prob, [0.05, 0.5, 0.95])[1] AS p05, quantile_cont(prob, [0.05, 0.5, 0.95])[2] AS p50,
               quantile_cont(prob, [0.05, 0.5, 0.95])[3] AS p95,  -- one list quantile (computed once), not three
               avg(coalesce(old_entropy, entropy)) AS h, any_value(r.tau) AS tau
        FROM tokens JOIN (SELECT run, tau FROM runs) AS r USING (run)
        WHERE advantage <> 0 AND prob IS NOT NULL AND run IN ({", ".join(sql_str(run) for run in thin)})
        GROUP BY run ORDER BY run""",
    )
    out = []
    for r in rows:
        if not r["n"]:
            continue
        for q in QUADRANTS:
            share = r[q] / r["n"]
            if share >= THIN_SHARE:
                continue
            h = r["h"]
            eh = f", exp(-H) {math.exp(-h):.3g} at H {h:.3g} nats" if h is not None else ""
            tau = f"tau {r['tau']:g}" if r["tau"] is not None else "its tau"
            out.append(
                Finding(
                    str(r["run"]),
                    int(r["step"]),
                    "thin_quadrant",
                    share,
                    THIN_SHARE,
                    f"{q} holds {share:.2%} of the tokens at {tau}; token p: p05 {r['p05']:.3g}, "
                    f"p50 {r['p50']:.3g}, p95 {r['p95']:.3g}{eh}; try --tau {suggest_tau(r['p50'])} (the median p)",
                )
            )
    return out


def on_policy(con) -> list[Finding]:
    """One ``on_policy`` finding per run whose every recorded ratio is 1: |logprob - old_logprob| <=
    ON_POLICY_TOL on every token row (read from the log-probs, not the ratio column, which an overflow cannot
    cast; value 0; at the run's first step). A run with a token row that moved is found by its first such row
    (a query that stops there); only the others are counted over every row."""
    moved = f"NOT abs(logprob - old_logprob) <= {ON_POLICY_TOL}"
    both = "logprob IS NOT NULL AND old_logprob IS NOT NULL"
    runs = [str(r["run"]) for r in _rows(con, "SELECT run FROM runs ORDER BY run")]
    still = [
        run
        for run in runs
        if not _rows(con, f"SELECT 1 AS x FROM tokens WHERE run = {sql_str(run)} AND {both} AND {moved} LIMIT 1")
    ]
    if not still:
        return []
    rows = _rows(
        con,
        f"""
        SELECT run, min(step) AS step, count(*) AS n,
               count(*) FILTER (WHERE {moved}) AS moved,
               any_value(try(json_extract_string(r.config, '$.framework'))) AS framework
        FROM tokens LEFT JOIN (SELECT run, config FROM runs) AS r USING (run)
        WHERE {both} AND run IN ({", ".join(sql_str(run) for run in still)}) GROUP BY run ORDER BY run""",
    )
    return [
        Finding(
            str(r["run"]),
            int(r["step"]),
            "on_policy",
            0.0,
            0.0,
            ON_POLICY_BY_FRAMEWORK.get(r["framework"], ON_POLICY_BY_FRAMEWORK[None]),
        )
        for r in rows
        if r["n"] and not r["moved"]
    ]


def run_findings(con) -> list[Finding]:
    """Both rules over the runs of ``con``."""
    return thin_quadrants(con) + on_policy(con)
