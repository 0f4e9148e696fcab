-- title: Sampling probability of the tokens PPO-clip drops
-- columns: run, method, side, bin, prob_lo, prob_hi, tokens, share, lp_share
-- figure: CE-GPPO Sec. 3 (clipped tokens are mostly low-probability)
-- params: bins=10
-- share: of the side's clipped tokens in this probability bin; lp_share: of the side's clipped tokens with
-- p < tau, the run's own HP / LP threshold (runs.tau).
WITH c AS (
    SELECT
        run,
        CASE WHEN clip = -1 THEN 'low' ELSE 'high' END AS side,
        least(floor(prob * $bins), $bins - 1)::INTEGER AS bin,
        prob
    FROM tokens
    WHERE clipped
)
SELECT
    c.run,
    r.method,
    c.side,
    c.bin,
    c.bin / $bins AS prob_lo,
    (c.bin + 1) / $bins AS prob_hi,
    count(*) AS tokens,
    count(*) / sum(count(*)) OVER (PARTITION BY c.run, c.side) AS share,
    sum(count_if(c.prob < r.tau)) OVER (PARTITION BY c.run, c.side)
        / sum(count(*)) OVER (PARTITION BY c.run, c.side) AS lp_share
FROM c
JOIN runs AS r USING (run)
GROUP BY c.run, r.method, c.side, c.bin
ORDER BY c.run, c.side, c.bin
