-- title: Entropy ratio H(pi_theta)/H(pi_old) per step: quantiles and share outside the ERC band
-- columns: run, method, step, p05, p50, p95, outside_band, tokens
-- figure: ERC Fig. 1 / Sec. 3 (the entropy ratio as a global trust region)
-- params: band_low=0.95, band_high=1.05
-- outside_band: share of tokens with rho <= band_low or rho >= band_high (ERC keeps low < rho < high).
-- p05 / p50 / p95 are exact quantiles over the step's tokens, interpolated linearly between the order
-- statistics at rank q * (n - 1) (DuckDB quantile_cont / median; on Spark percentile / median, which
-- entropylens.portable writes for them). Exact sorting costs less CPU than DuckDB's t-digest
-- (approx_quantile), used here before.
SELECT
    t.run,
    r.method,
    t.step,
    quantile_cont(t.entropy_ratio, 0.05) AS p05,
    median(t.entropy_ratio) AS p50,
    quantile_cont(t.entropy_ratio, 0.95) AS p95,
    avg((t.entropy_ratio <= $band_low OR t.entropy_ratio >= $band_high)::INTEGER) AS outside_band,
    count(*) AS tokens
FROM tokens AS t
JOIN runs AS r USING (run)
WHERE t.entropy_ratio IS NOT NULL
GROUP BY t.run, r.method, t.step
ORDER BY t.run, t.step
