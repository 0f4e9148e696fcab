-- title: Global drift |log entropy ratio| by sampling-probability bin
-- columns: run, method, bin, prob_lo, prob_hi, tokens, mean_abs_log_ratio
-- figure: ERC Sec. 3 (drift is strongest for p < 0.2 and p > 0.6)
-- params: bins=10
-- bin = least(floor(prob * bins), bins - 1), written as a CASE (the same value, NULL and NaN
-- included: both give bins - 1) because DuckDB's least() costs ~3x more CPU per row.
WITH b AS (
    SELECT
        run,
        CAST(CASE WHEN floor(prob * $bins) <= $bins - 1 THEN floor(prob * $bins) ELSE $bins - 1 END AS INTEGER) AS bin,
        abs(ln(entropy_ratio)) AS abs_log_ratio
    FROM tokens
    WHERE entropy_ratio > 0
)
SELECT
    b.run,
    r.method,
    b.bin,
    b.bin / $bins AS prob_lo,
    (b.bin + 1) / $bins AS prob_hi,
    count(*) AS tokens,
    avg(b.abs_log_ratio) AS mean_abs_log_ratio
FROM b
JOIN runs AS r USING (run)
GROUP BY b.run, r.method, b.bin
ORDER BY b.run, b.bin
