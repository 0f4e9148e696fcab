-- title: Each quadrant's share of the squared logit-gradient norm per step
-- columns: run, method, step, quadrant, grad_sq, share, clipped_share
-- figure: CE-GPPO Sec. 3 (gradient mass by quadrant; what PPO-clip would drop)
-- params: none
-- grad_sq = sum of ||dLoss/dz_t||^2 over the quadrant's tokens; share = of the step's total;
-- clipped_share = part of the quadrant's grad_sq from tokens outside the clip interval on the
-- gated side (PPO-clip would drop them; GPPO / CE-GPPO keep a scaled gradient).
-- Summed per (run, step, quadrant) first, the run's method joined to the sums (fewer keys per row).
WITH per_q AS (
    SELECT
        t.run,
        t.step,
        t.quadrant,
        sum(t.logit_grad_norm * t.logit_grad_norm) AS grad_sq,
        coalesce(sum(t.logit_grad_norm * t.logit_grad_norm) FILTER (WHERE t.clipped), 0) AS clipped_sq
    FROM tokens AS t
    WHERE t.logit_grad_norm IS NOT NULL AND t.quadrant <> 'ZA'
    GROUP BY t.run, t.step, t.quadrant
)
SELECT
    p.run,
    r.method,
    p.step,
    p.quadrant,
    p.grad_sq,
    p.grad_sq / nullif(sum(p.grad_sq) OVER (PARTITION BY p.run, p.step), 0) AS share,
    p.clipped_sq / nullif(p.grad_sq, 0) AS clipped_share
FROM per_q AS p
JOIN runs AS r USING (run)
ORDER BY p.run, p.step, p.quadrant
