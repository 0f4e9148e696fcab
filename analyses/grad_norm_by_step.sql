-- title: Global gradient norm (before clipping) per step
-- columns: run, method, step, grad_norm, grad_norm_max, updates
-- figure: CE-GPPO Fig. 4 right (gradient norm vs step); ERC (steadier gradients)
-- params: none
-- grad_norm: mean over the step's updates (each its own optimizer step); grad_norm_max: the largest.
-- updates: distinct updates of the step (ranks hold the same updates: counted once, not once per rank).
SELECT
    s.run,
    r.method,
    s.step,
    avg(s.grad_norm) AS grad_norm,
    max(s.grad_norm) AS grad_norm_max,
    count(DISTINCT s."update") AS updates
FROM steps AS s
JOIN runs AS r USING (run)
WHERE s.grad_norm IS NOT NULL
GROUP BY s.run, r.method, s.step
ORDER BY s.run, s.step
