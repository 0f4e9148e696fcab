-- title: Global drift |log entropy ratio| by sampling-probability bin
-- columns: run, method, bin, prob_lo, prob_hi, tokens, mean_abs_log_ratio
-- figure: ERC Sec. 3 (drift is strongest for p < 0.2 and p > 0.6)
-- params: bins=10
SELECT
    t.run,
    r.method,
    least(floor(t.prob * $bins), $bins - 1)::INTEGER AS bin,
    least(floor(t.prob * $bins), $bins - 1) / $bins AS prob_lo,
    (least(floor(t.prob * $bins), $bins - 1) + 1) / $bins AS prob_hi,
    count(*) AS tokens,
    avg(abs(ln(t.entropy_ratio))) AS mean_abs_log_ratio
FROM tokens AS t
JOIN runs AS r USING (run)
WHERE t.entropy_ratio > 0
GROUP BY t.run, r.method, bin, prob_lo, prob_hi
ORDER BY t.run, bin
