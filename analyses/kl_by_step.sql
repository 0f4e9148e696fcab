-- title: KL(pi_old || pi_theta) per step (k3 estimator)
-- columns: run, method, step, kl
-- figure: CE-GPPO Fig. 4 left (KL to the old policy vs step)
-- params: none
-- Token-weighted mean over the step's updates of mean((r - 1) - log r). Exact: from steps.
SELECT
    s.run,
    r.method,
    s.step,
    sum(s.kl_k3 * s.n_tokens) / nullif(sum(s.n_tokens), 0) AS kl
FROM steps AS s
JOIN runs AS r USING (run)
WHERE s.n_tokens > 0
GROUP BY s.run, r.method, s.step
ORDER BY s.run, s.step
