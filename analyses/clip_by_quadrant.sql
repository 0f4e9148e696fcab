-- title: Clip fractions by side and quadrant, per step and overall
-- columns: run, method, step, quadrant, tokens, clip_low_frac, clip_high_frac, clipped_frac
-- figure: CE-GPPO Fig. 1 (which tokens PPO-clip silently drops)
-- params: none
-- Fractions of the quadrant's tokens whose gradient PPO-clip removes on each side
-- (low: r < 1-eps_low and A < 0; high: r > 1+eps_high and A > 0). step IS NULL: the whole run.
SELECT
    t.run,
    r.method,
    t.step,
    t.quadrant,
    count(*) AS tokens,
    avg((t.clipped AND t.clip = -1)::INTEGER) AS clip_low_frac,
    avg((t.clipped AND t.clip = 1)::INTEGER) AS clip_high_frac,
    avg(t.clipped::INTEGER) AS clipped_frac
FROM tokens AS t
JOIN runs AS r USING (run)
WHERE t.quadrant <> 'ZA'
GROUP BY GROUPING SETS ((t.run, r.method, t.step, t.quadrant), (t.run, r.method, t.quadrant))
ORDER BY t.run, t.step NULLS LAST, t.quadrant
