"""Quadrants at any tau after the fact: the SQL macro ``quadrant(advantage, prob, tau)`` and a connection's
views re-split at a tau other than the one each run recorded.

A token's quadrant is PA if A > 0, NA if A < 0, ZA if A == 0; HP if p >= tau else LP (rl/stats.quadrant,
p = exp(old_logprob), tau compared as float32 as torch does). Every token's p and A are recorded, so the
split is exact for any tau. :func:`apply_tau` replaces, on a connection's own DuckDB connection (before
the lockdown):

- ``tokens.quadrant`` by ``quadrant(advantage, prob, tau)``;
- the per-quadrant columns of ``steps`` (``n_*``, ``clip_frac_*``, ``lgn_mean_*``, ``entropy_effect_*``,
  ``entropy_effect_dropped_*``) by their values over the step's token rows; a sampled run (``sample`` < 1)
  has its counts and sums scaled by n_tokens / token rows of the update (an estimate; exact at sample 1);
  an update without token rows gets NULL there (nothing to re-split);
- ``runs.tau`` by ``tau`` (captions name the split the figures use).
"""

from __future__ import annotations

import weakref

from ..schema import QUADRANTS, quadrant_slug

MACRO_SQL = (
    "CREATE OR REPLACE TEMP MACRO quadrant(advantage, prob, tau) AS CASE "
    "WHEN advantage IS NULL OR prob IS NULL THEN NULL "
    "WHEN advantage = 0 THEN 'ZA' "
    "WHEN advantage > 0 THEN CASE WHEN CAST(prob AS FLOAT) >= CAST(tau AS FLOAT) THEN 'PA&HP' ELSE 'PA&LP' END "
    "ELSE CASE WHEN CAST(prob AS FLOAT) >= CAST(tau AS FLOAT) THEN 'NA&HP' ELSE 'NA&LP' END END"
)


def check_tau(tau) -> float:
    """``tau`` as a float in (0, 1]; else a ValueError naming it."""
    try:
        t = float(tau)
    except (TypeError, ValueError):
        raise ValueError(f"tau {tau!r} is not a number in (0, 1]") from None
    if not 0.0 < t <= 1.0:
        raise ValueError(f"tau {tau!r} is not in (0, 1] (a token is HP when its probability p >= tau)")
    return t


def register_macro(con) -> None:
    """``quadrant(advantage, prob, tau)`` on DuckDB connection ``con`` (a temporary macro: nothing written)."""
    con.execute(MACRO_SQL)


def _per_quadrant(have: set[str]) -> list[str]:
    """SET clauses recomputing the steps' per-quadrant columns from token rows ``t`` (aggregate ``a``)."""
    sets = []
    for q in (*QUADRANTS, "ZA"):
        s = quadrant_slug(q)
        sets.append(f"n_{s} = CAST(round(a.n_{s} * a.scale) AS BIGINT)")
        if q == "ZA":
            continue
        for col in (f"clip_frac_{s}", f"lgn_mean_{s}", f"entropy_effect_{s}", f"entropy_effect_dropped_{s}"):
            if col in have:
                scaled = " * a.scale" if col.startswith("entropy_effect") else ""
                sets.append(f"{col} = CASE WHEN steps.{col} IS NULL THEN NULL ELSE a.{col}{scaled} END")
    return sets


def _aggregates() -> str:
    cols = ["run", "rank", "step", "update", "count(*) AS rows"]
    for q in (*QUADRANTS, "ZA"):
        s, cond = quadrant_slug(q), f"q = '{q}'"
        cols.append(f"count(*) FILTER (WHERE {cond}) AS n_{s}")
        if q == "ZA":
            continue
        cols += [
            f"avg(CAST(clipped AS INTEGER)) FILTER (WHERE {cond}) AS clip_frac_{s}",
            f"avg(logit_grad_norm) FILTER (WHERE {cond} AND isfinite(logit_grad_norm)) AS lgn_mean_{s}",
            f"coalesce(sum(entropy_effect) FILTER (WHERE {cond}), 0) AS entropy_effect_{s}",
            f"coalesce(sum(entropy_effect_dropped) FILTER (WHERE {cond}), 0) AS entropy_effect_dropped_{s}",
        ]
    return (
        f"SELECT {', '.join(cols)} FROM (SELECT *, quadrant(advantage, prob, $tau) AS q FROM tokens) "
        "GROUP BY run, rank, step, update"
    )


_TAUS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # con -> the tau its views are split at


def tau_of(con) -> float | None:
    """The tau :func:`apply_tau` split ``con``'s views at (None: each run's own)."""
    return _TAUS.get(con)


def _split_tokens(con, tau: float) -> None:
    """The tokens view re-created over the recorded one with ``quadrant`` recomputed at ``tau``."""
    con.execute("DROP VIEW IF EXISTS _tokens_recorded")
    con.execute("ALTER VIEW tokens RENAME TO _tokens_recorded")
    con.execute(
        f"CREATE VIEW tokens AS SELECT * REPLACE (quadrant(advantage, prob, {tau!r}) AS quadrant) FROM _tokens_recorded"
    )


def replanned(con) -> None:
    """After lockdown.replan re-created the tokens view from the files: split it again at the connection's tau."""
    if con in _TAUS:
        _split_tokens(con, _TAUS[con])


def apply_tau(con, tau: float) -> None:
    """Re-split ``con``'s views (DuckDB's own connection, views built, not yet locked) at ``tau``."""
    tau = check_tau(tau)
    t = repr(tau)
    _TAUS[con] = tau
    _split_tokens(con, tau)
    have = {row[0] for row in con.execute("DESCRIBE steps").fetchall()}
    con.execute(
        f"CREATE TEMP TABLE _retau AS SELECT a.*, coalesce(CAST(s.n_tokens AS DOUBLE) / a.rows, 1.0) AS scale "
        f"FROM ({_aggregates().replace('$tau', t)}) AS a LEFT JOIN steps AS s USING (run, rank, step, update)"
    )
    con.execute(
        f"UPDATE steps SET {', '.join(_per_quadrant(have))} FROM _retau AS a WHERE steps.run = a.run AND "
        "steps.rank = a.rank AND steps.step = a.step AND steps.update = a.update"
    )
    nulls = [
        f"{c} = NULL"
        for c in (
            *(f"n_{quadrant_slug(q)}" for q in (*QUADRANTS, "ZA")),
            *(
                f"{p}_{quadrant_slug(q)}"
                for q in QUADRANTS
                for p in ("clip_frac", "lgn_mean", "entropy_effect", "entropy_effect_dropped")
            ),
        )
        if c.split(" ")[0] in have
    ]
    con.execute(
        f"UPDATE steps SET {', '.join(nulls)} WHERE NOT EXISTS (SELECT 1 FROM _retau AS a WHERE "
        "a.run = steps.run AND a.rank = steps.rank AND a.step = steps.step AND a.update = steps.update)"
    )
    con.execute("DROP TABLE _retau")
    con.execute("ALTER VIEW runs RENAME TO _runs_recorded")
    con.execute(f"CREATE VIEW runs AS SELECT * REPLACE (CAST({t} AS FLOAT) AS tau) FROM _runs_recorded")
