-- title: Each quadrant's share of the squared logit-gradient norm per step
-- columns: run, method, step, quadrant, grad_sq, share, clipped_share
-- figure: CE-GPPO Sec. 3 (gradient mass by quadrant; what PPO-clip would drop)
-- params: none
-- grad_sq = sum of ||dLoss/dz_t||^2 over the quadrant's tokens; share = of the step's total;
-- clipped_share = part of the quadrant's grad_sq from tokens outside the clip interval on the
-- gated side (PPO-clip would drop them; GPPO / CE-GPPO keep a scaled gradient).
SELECT
    t.run,
    r.method,
    t.step,
    t.quadrant,
    sum(t.logit_grad_norm * t.logit_grad_norm) AS grad_sq,
    sum(t.logit_grad_norm * t.logit_grad_norm)
        / nullif(sum(sum(t.logit_grad_norm * t.logit_grad_norm)) OVER (PARTITION BY t.run, t.step), 0) AS share,
    coalesce(sum(t.logit_grad_norm * t.logit_grad_norm) FILTER (WHERE t.clipped), 0)
        / nullif(sum(t.logit_grad_norm * t.logit_grad_norm), 0) AS clipped_share
FROM tokens AS t
JOIN runs AS r USING (run)
WHERE t.logit_grad_norm IS NOT NULL AND t.quadrant <> 'ZA'
GROUP BY t.run, r.method, t.step, t.quadrant
ORDER BY t.run, t.step, t.quadrant
