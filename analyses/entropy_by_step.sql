-- title: Mean token entropy per run and step
-- columns: run, method, step, entropy, old_entropy, tokens
-- figure: CE-GPPO Fig. 2, 3 and 5 (entropy vs step)
-- params: none
-- entropy: H(pi_theta) at each update, token-weighted over the step's updates and ranks;
-- old_entropy: H(pi_old) of the rollout policy (what verl logs as actor/entropy). Exact: from steps.
SELECT
    s.run,
    r.method,
    s.step,
    sum(s.entropy_mean * s.n_tokens) / nullif(sum(s.n_tokens), 0) AS entropy,
    sum(s.old_entropy_mean * s.n_tokens) / nullif(sum(s.n_tokens), 0) AS old_entropy,
    sum(s.n_tokens) AS tokens
FROM steps AS s
JOIN runs AS r USING (run)
WHERE s.n_tokens IS NOT NULL
GROUP BY s.run, r.method, s.step
ORDER BY s.run, s.step
