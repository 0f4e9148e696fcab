-- title: Clip fractions by side and quadrant over the whole run
-- columns: run, method, quadrant, tokens, clip_low_frac, clip_high_frac, clipped_frac
-- figure: CE-GPPO Fig. 1 (which tokens PPO-clip silently drops)
-- params: none
-- Fractions of the quadrant's recorded tokens (all steps) whose gradient PPO-clip removes on each
-- side (low: r < 1-eps_low and A < 0; high: r > 1+eps_high and A > 0). Per step:
-- clip_by_quadrant_by_step.
SELECT
    t.run,
    r.method,
    t.quadrant,
    count(*) AS tokens,
    avg(CAST(t.clipped AND t.clip = -1 AS INTEGER)) AS clip_low_frac,
    avg(CAST(t.clipped AND t.clip = 1 AS INTEGER)) AS clip_high_frac,
    avg(CAST(t.clipped AS INTEGER)) AS clipped_frac
FROM tokens AS t
JOIN runs AS r USING (run)
WHERE t.quadrant <> 'ZA'
GROUP BY t.run, r.method, t.quadrant
ORDER BY t.run, t.quadrant
