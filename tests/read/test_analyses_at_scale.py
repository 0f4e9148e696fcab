"""Each analysis that takes a shortcut at scale gives the rows of its plain SQL definition.

ratio_vs_prob ranks only the rows of the first hash buckets instead of every row, and
entropy_change_by_quadrant runs its per-token window only over sequences seen at more than one
(step, update). Here both are compared with their plain definitions (a row_number over every
row; a lead() over every token) on random runs: one where tokens are seen again (the same sequences
at two updates and at the next step), one where every token is seen once, several ranks and steps.
"""

import json

import numpy as np
import pytest

from entropylens.read.query import connect, run_analysis, run_sql
from entropylens.record.writing.parquet import write_steps, write_tokens

HASH = (
    "((((((((CAST(t.step AS BIGINT) * 742938285 + t.update) % 2147483647) * 742938285 + t.rank)"
    " % 2147483647) * 742938285 + t.seq) % 2147483647) * 742938285 + t.pos) % 2147483647)"
    " * 742938285 % 2147483647"
)

PLAIN_RATIO_VS_PROB = f"""
WITH ranked AS (
    SELECT t.run, t.step, t.prob, t.ratio, t.quadrant, t.clipped,
           row_number() OVER (PARTITION BY t.run ORDER BY {HASH}, t.step, t.update, t.rank, t.seq, t.pos) AS k
    FROM tokens AS t WHERE t.quadrant <> 'ZA'
)
SELECT x.run, r.method, x.step, x.prob, x.ratio, x.quadrant, x.clipped, r.eps_low, r.eps_high
FROM ranked AS x JOIN runs AS r USING (run) WHERE x.k <= $points ORDER BY x.run, x.k
"""

PLAIN_ENTROPY_CHANGE = """
WITH seen AS (
    SELECT run, quadrant, entropy, old_entropy, update,
           lead(entropy) OVER (PARTITION BY run, rank, seq, pos ORDER BY step, update) AS next_entropy
    FROM tokens WHERE quadrant <> 'ZA' AND entropy IS NOT NULL
),
mode AS (SELECT run, bool_or(next_entropy IS NOT NULL) AS repeated FROM seen GROUP BY run),
dh AS (
    SELECT s.run, s.quadrant,
           CASE WHEN m.repeated THEN s.next_entropy - s.entropy ELSE s.entropy - s.old_entropy END AS dh
    FROM seen AS s JOIN mode AS m USING (run)
    WHERE CASE WHEN m.repeated THEN s.next_entropy IS NOT NULL ELSE s.update > 0 END
),
per_q AS (SELECT run, quadrant, count(*) AS tokens, avg(dh) AS mean_dh FROM dh GROUP BY run, quadrant)
SELECT p.run, r.method, p.quadrant, p.tokens, p.mean_dh,
       p.mean_dh - avg(p.mean_dh) OVER (PARTITION BY p.run) AS relative_dh
FROM per_q AS p JOIN runs AS r USING (run) ORDER BY p.run, p.quadrant
"""


def _tokens(rng, n_seq: int, seq0: int, update: int) -> dict:
    lens = rng.integers(1, 9, n_seq)
    seq = np.repeat(np.arange(seq0, seq0 + n_seq, dtype=np.int32), lens)
    pos = np.concatenate([np.arange(k, dtype=np.int32) for k in lens])
    n = len(seq)
    old = np.log(rng.uniform(0.01, 1.0, n)).astype(np.float32)
    adv = np.repeat(rng.choice([-1.0, 0.0, 1.0], n_seq), lens).astype(np.float32)
    prob = np.exp(old)
    quadrant = np.where(adv == 0, 0, np.where(adv > 0, np.where(prob >= 0.5, 1, 2), np.where(prob >= 0.5, 3, 4)))
    clip = rng.choice(np.array([-1, 0, 1], np.int8), n)
    return {
        "update": np.full(n, update, np.int16),
        "seq": seq,
        "group": seq // 4,
        "pos": pos,
        "token_id": rng.integers(0, 50, n).astype(np.int32),
        "logprob": (old + rng.normal(0, 0.2, n)).astype(np.float32),
        "old_logprob": old,
        "advantage": adv,
        "quadrant": quadrant.astype(np.int8),
        "clip": clip,
        "clipped": ((clip == -1) & (adv < 0)) | ((clip == 1) & (adv > 0)),
        "entropy": rng.uniform(0.1, 3.0, n).astype(np.float32),
        "old_entropy": rng.uniform(0.1, 3.0, n).astype(np.float32),
        "grad_coef": rng.normal(0, 1, n).astype(np.float32),
        "logit_grad_norm": rng.uniform(0, 2, n).astype(np.float32),
    }


def _run(root, name: str, repeat: bool, seed: int, boundary: bool = False) -> None:
    """3 steps x 3 ranks x 2 updates; ``repeat``: update 1 sees update 0's sequences again and step
    s + 1 sees some of step s's (seq ids reused), else every token once; ``boundary``: each
    (step, update) shares only its first sequence id with the one before (like a sequence split
    between two mini-batches: benchmarks/scale.py's layout)."""
    rng = np.random.default_rng(seed)
    d = root / name
    d.mkdir()
    (d / "run.json").write_text(
        json.dumps(
            {
                "run": name,
                "method": "grpo",
                "status": "finished",
                "eps_low": 0.2,
                "eps_high": 0.2,
                "tau": 0.5,
                "schema_version": 1,
            }
        )
    )
    for step in range(3):
        for rank in range(3):
            rows = []
            for update in range(2):
                seq0 = (
                    step * 10 if repeat else (step * 2 + update) * 39 if boundary else (step * 6 + update * 3) * 40
                ) + rank * 1000
                arrs = _tokens(np.random.default_rng(seed + 7 * step + rank) if repeat else rng, 40, seq0, update)
                if repeat:  # same tokens, new entropies
                    arrs["entropy"] = rng.uniform(0.1, 3.0, len(arrs["seq"])).astype(np.float32)
                write_tokens(d, step, rank, update, arrs)
                rows.append({"update": update, "n_tokens": len(arrs["seq"])})  # the steps row counts its tokens
            write_steps(d, step, rank, rows)


@pytest.fixture(scope="module")
def con(tmp_path_factory):
    root = tmp_path_factory.mktemp("rewrites")
    _run(root, "again", True, 1)
    _run(root, "once", False, 2)
    _run(root, "boundary", False, 3, boundary=True)
    return connect(root)


@pytest.mark.parametrize("points", [1, 7, 250, 100_000])
def test_ratio_vs_prob_same_rows_as_ranking_every_row(con, points):
    got = run_analysis(con, "ratio_vs_prob", points=points)
    want = run_sql(con, PLAIN_RATIO_VS_PROB.replace("$points", str(points)))
    total = run_sql(con, "SELECT count(*) AS n FROM tokens WHERE quadrant <> 'ZA' GROUP BY run")["n"]
    assert len(got) == sum(min(points, n) for n in total)  # every run, at most `points` rows each
    assert got.reset_index(drop=True).equals(want.reset_index(drop=True))


def test_entropy_change_same_rows_as_window_over_every_token(con):
    got = run_analysis(con, "entropy_change_by_quadrant")
    want = run_sql(con, PLAIN_ENTROPY_CHANGE)
    assert set(got["run"]) == {"again", "once", "boundary"}  # one run of each mode
    n = run_sql(con, "SELECT run, count(*) AS n FROM tokens WHERE quadrant <> 'ZA' GROUP BY run").set_index("run")["n"]
    seen_again = got.groupby("run")["tokens"].sum()
    assert 0 < seen_again["boundary"] < n["boundary"] / 10  # only the shared sequences' tokens
    cols = ["run", "method", "quadrant", "tokens"]
    assert got[cols].reset_index(drop=True).equals(want[cols].reset_index(drop=True))
    for c in ("mean_dh", "relative_dh"):
        assert np.allclose(got[c], want[c], rtol=1e-12, atol=1e-12), c


def test_entropy_ratio_quantiles_are_exact(con):
    """entropy_ratio_by_step's p05 / p50 / p95 (quantile_cont / median, not an approximate quantile)
    are numpy's exact linear-interpolation quantiles of the step's float32 entropy ratios."""
    got = run_analysis(con, "entropy_ratio_by_step")
    rho = run_sql(con, "SELECT run, step, entropy_ratio FROM tokens WHERE entropy_ratio IS NOT NULL")
    assert len(got) == 9  # 3 runs x 3 steps
    for row in got.to_dict("records"):
        x = rho[(rho["run"] == row["run"]) & (rho["step"] == row["step"])]["entropy_ratio"].to_numpy(np.float64)
        assert row["tokens"] == len(x) > 100
        for col, q in (("p05", 0.05), ("p50", 0.5), ("p95", 0.95)):
            want = np.quantile(x, q)  # (n - 1) * q, linear between the two order statistics around it
            assert row[col] == pytest.approx(want, rel=1e-6), (row["run"], row["step"], col)
        lo, hi = np.quantile(x, 0.04), np.quantile(x, 0.06)
        assert not (lo <= row["p95"] <= hi)  # the columns are not mixed up


@pytest.mark.parametrize("bins", [1, 7, 10])
def test_drift_by_prob_bin_same_rows_as_least(con, bins):
    """drift_by_prob_bin's bin is a CASE (cheaper per row than DuckDB's least()); its rows are those of
    the plain definition least(floor(prob * bins), bins - 1)."""
    from entropylens.read.query import render_analysis

    sql = render_analysis("drift_by_prob_bin", bins=bins)
    case = f"CASE WHEN floor(prob * {bins}) <= {bins} - 1 THEN floor(prob * {bins}) ELSE {bins} - 1 END"
    assert case in sql
    got = run_sql(con, sql)
    want = run_sql(con, sql.replace(case, f"least(floor(prob * {bins}), {bins} - 1)"))
    assert len(got) == 3 * bins  # every run, every bin filled (prob is uniform on [0.01, 1])
    cols = ["run", "method", "bin", "prob_lo", "prob_hi", "tokens"]
    assert got[cols].equals(want[cols])
    assert np.allclose(got["mean_abs_log_ratio"], want["mean_abs_log_ratio"], rtol=1e-12, atol=0)


# the SQL entropy_ratio_by_step and grad_share_by_quadrant were before they grouped by fewer keys (#39)
OLD_ENTROPY_RATIO_BY_STEP = """
WITH bands AS (
    SELECT
        run,
        min(erc_low) AS erc_low,
        max(erc_high) AS erc_high
    FROM steps
    GROUP BY run
),
run_band AS (
    SELECT
        r.run,
        r.method,
        coalesce(b.erc_low, $band_low) AS band_low,
        coalesce(b.erc_high, $band_high) AS band_high,
        b.erc_low IS NOT NULL AS erc
    FROM runs AS r
    LEFT JOIN bands AS b ON r.run = b.run
)
SELECT
    t.run,
    rb.method,
    t.step,
    quantile_cont(t.entropy_ratio, 0.05) AS p05,
    median(t.entropy_ratio) AS p50,
    quantile_cont(t.entropy_ratio, 0.95) AS p95,
    avg((t.entropy_ratio <= rb.band_low OR t.entropy_ratio >= rb.band_high)::INTEGER) AS outside_band,
    count(*) AS tokens,
    rb.band_low,
    rb.band_high,
    rb.erc
FROM tokens AS t
JOIN run_band AS rb ON t.run = rb.run
WHERE t.entropy_ratio IS NOT NULL
GROUP BY t.run, rb.method, t.step, rb.band_low, rb.band_high, rb.erc
ORDER BY t.run, t.step
"""

OLD_GRAD_SHARE = """
SELECT
    t.run,
    r.method,
    t.step,
    t.quadrant,
    sum(t.logit_grad_norm * t.logit_grad_norm) AS grad_sq,
    sum(t.logit_grad_norm * t.logit_grad_norm)
        / nullif(sum(sum(t.logit_grad_norm * t.logit_grad_norm)) OVER (PARTITION BY t.run, t.step), 0) AS share,
    coalesce(sum(t.logit_grad_norm * t.logit_grad_norm) FILTER (WHERE t.clipped), 0)
        / nullif(sum(t.logit_grad_norm * t.logit_grad_norm), 0) AS clipped_share
FROM tokens AS t
JOIN runs AS r USING (run)
WHERE t.logit_grad_norm IS NOT NULL AND t.quadrant <> 'ZA'
GROUP BY t.run, r.method, t.step, t.quadrant
ORDER BY t.run, t.step, t.quadrant
"""


@pytest.mark.parametrize("band", [(0.95, 1.05), (0.9, 1.2)])
def test_entropy_ratio_by_step_same_rows_as_grouping_by_every_key(con, band):
    """entropy_ratio_by_step groups by (run, step) and joins each run's method and band after: the rows of the
    query that grouped by (run, method, step, band_low, band_high, erc)."""
    lo, hi = band
    got = run_analysis(con, "entropy_ratio_by_step", band_low=lo, band_high=hi)
    want = run_sql(con, OLD_ENTROPY_RATIO_BY_STEP.replace("$band_low", str(lo)).replace("$band_high", str(hi)))
    assert len(got) == 9 and list(got.columns) == list(want.columns)
    assert got.reset_index(drop=True).equals(want.reset_index(drop=True))


def test_grad_share_same_rows_as_grouping_with_the_method(con):
    """grad_share_by_quadrant sums per (run, step, quadrant) and joins the method after: the old query's rows
    (the sums within 1e-12: a parallel sum's order may differ between two plans)."""
    got = run_analysis(con, "grad_share_by_quadrant")
    want = run_sql(con, OLD_GRAD_SHARE)
    assert len(got) == 3 * 3 * 4 and list(got.columns) == list(want.columns)
    keys = ["run", "method", "step", "quadrant"]
    assert got[keys].reset_index(drop=True).equals(want[keys].reset_index(drop=True))
    for c in ("grad_sq", "share", "clipped_share"):
        assert np.allclose(got[c], want[c], rtol=1e-12, atol=0, equal_nan=True), c
