-- title: Clip fractions by side and quadrant, per step
-- columns: run, method, step, quadrant, tokens, clip_low_frac, clip_high_frac, clipped_frac
-- figure: CE-GPPO Fig. 1 (which tokens PPO-clip silently drops, over training)
-- params: none
-- As clip_by_quadrant, one row per (run, step, quadrant); the whole run: clip_by_quadrant.
SELECT
    t.run,
    r.method,
    t.step,
    t.quadrant,
    count(*) AS tokens,
    avg(CAST(t.clipped AND t.clip = -1 AS INTEGER)) AS clip_low_frac,
    avg(CAST(t.clipped AND t.clip = 1 AS INTEGER)) AS clip_high_frac,
    avg(CAST(t.clipped AS INTEGER)) AS clipped_frac
FROM tokens AS t
JOIN runs AS r USING (run)
WHERE t.quadrant <> 'ZA'
GROUP BY t.run, r.method, t.step, t.quadrant
ORDER BY t.run, t.step, t.quadrant
