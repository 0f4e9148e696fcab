-- title: Entropy ratio H(pi_theta)/H(pi_old) per step: quantiles and share outside each run's band
-- columns: run, method, step, p05, p50, p95, outside_band, tokens, band_low, band_high, erc
-- figure: ERC Fig. 1 / Sec. 3 (the entropy ratio as a global trust region)
-- params: band_low=0.95, band_high=1.05
-- The band of a run is its own ERC band (steps.erc_low / erc_high, the widest the run used; erc = true);
-- a run without ERC is measured against band_low / band_high (default: the ERC paper's (0.95, 1.05);
-- erc = false). outside_band: share of tokens with rho <= band_low or rho >= band_high (ERC keeps
-- low < rho < high).
-- p05 / p50 / p95 are exact quantiles over the step's tokens, interpolated linearly between the order
-- statistics at rank q * (n - 1) (DuckDB quantile_cont; on Spark percentile, which
-- entropylens.read.portable writes for it). Exact sorting costs less CPU than DuckDB's t-digest
-- (approx_quantile), used here before. The three come from ONE list quantile per step (DuckDB computes
-- the identical expression once): about a third of the CPU of three separate quantiles, the same values.
-- The aggregate groups by (run, step) alone and takes each run's method and band after it: fewer keys per row
-- (the band is one per run), the same groups.
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
),
per_step AS (
    SELECT
        t.run,
        t.step,
        quantile_cont(t.entropy_ratio, [0.05, 0.5, 0.95])[1] AS p05,
        quantile_cont(t.entropy_ratio, [0.05, 0.5, 0.95])[2] AS p50,
        quantile_cont(t.entropy_ratio, [0.05, 0.5, 0.95])[3] AS p95,
        avg((t.entropy_ratio <= rb.band_low OR t.entropy_ratio >= rb.band_high)::INTEGER) AS outside_band,
        count(*) AS tokens
    FROM tokens AS t
    JOIN run_band AS rb ON t.run = rb.run
    WHERE t.entropy_ratio IS NOT NULL
    GROUP BY t.run, t.step
)
SELECT
    p.run,
    rb.method,
    p.step,
    p.p05,
    p.p50,
    p.p95,
    p.outside_band,
    p.tokens,
    rb.band_low,
    rb.band_high,
    rb.erc
FROM per_step AS p
JOIN run_band AS rb ON p.run = rb.run
ORDER BY p.run, p.step
