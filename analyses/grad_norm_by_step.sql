-- title: Global gradient norm (before clipping) per step
-- columns: run, method, step, grad_norm, grad_norm_max, updates, nonfinite
-- figure: CE-GPPO Fig. 4 right (gradient norm vs step); ERC (steadier gradients)
-- params: none
-- grad_norm: mean over the step's updates with a finite norm (each its own optimizer step); grad_norm_max:
-- the largest finite one; NULL where no update's norm is finite. nonfinite: updates whose recorded norm is
-- NaN or +-inf (a blow-up: see `entropylens check`, rule nonfinite).
-- updates: distinct updates of the step (ranks hold the same updates: counted once, not once per rank).
WITH g AS (
    SELECT
        run,
        step,
        "update",
        grad_norm,
        isnan(grad_norm) OR abs(grad_norm) = CAST('inf' AS DOUBLE) AS bad
    FROM steps
    WHERE grad_norm IS NOT NULL
)
SELECT
    g.run,
    r.method,
    g.step,
    avg(CASE WHEN NOT g.bad THEN g.grad_norm END) AS grad_norm,
    max(CASE WHEN NOT g.bad THEN g.grad_norm END) AS grad_norm_max,
    count(DISTINCT g."update") AS updates,
    CAST(sum(CASE WHEN g.bad THEN 1 ELSE 0 END) AS BIGINT) AS nonfinite
FROM g
JOIN runs AS r ON g.run = r.run
GROUP BY g.run, r.method, g.step
ORDER BY g.run, g.step
