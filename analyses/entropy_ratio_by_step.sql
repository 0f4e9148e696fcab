-- title: Entropy ratio H(pi_theta)/H(pi_old) per step: quantiles and share outside the ERC band
-- columns: run, method, step, p05, p50, p95, outside_band, tokens
-- figure: ERC Fig. 1 / Sec. 3 (the entropy ratio as a global trust region)
-- params: band_low=0.95, band_high=1.05
-- outside_band: share of tokens with rho <= band_low or rho >= band_high (ERC keeps low < rho < high).
-- p50 is exact (median); p05 / p95 are approximate (approx_quantile: DuckDB t-digest, Spark
-- percentile_approx), within about 1% of rank. Exact quantiles over all tokens: steps.entropy_ratio_p*.
SELECT
    t.run,
    r.method,
    t.step,
    approx_quantile(t.entropy_ratio, 0.05) AS p05,
    median(t.entropy_ratio) AS p50,
    approx_quantile(t.entropy_ratio, 0.95) AS p95,
    avg((t.entropy_ratio <= $band_low OR t.entropy_ratio >= $band_high)::INTEGER) AS outside_band,
    count(*) AS tokens
FROM tokens AS t
JOIN runs AS r USING (run)
WHERE t.entropy_ratio IS NOT NULL
GROUP BY t.run, r.method, t.step
ORDER BY t.run, t.step
