-- title: Entropy change per step predicted by the covariance law against the measured change
-- columns: run, method, step, tokens, cov, cov_prob, entropy, measured_dh, predicted_dh, scale, corr, corr_prob, steps
-- figure: Cui et al. 2025 (the entropy mechanism): dH ~ -eta Cov(log pi, A) (natural PG), -eta Cov(log pi, pi A) (vanilla PG)
-- params: none
-- cov: the step's token-mean covariance of log pi and A (covariance_by_quadrant's step_cov: centred within
-- each (rank, step, update) batch); cov_prob: the same with pi A in place of A (pi = exp(logprob)).
-- entropy: the step's token-weighted mean entropy, exact from steps (old_entropy_mean: the policy that
-- sampled the step; entropy_mean where only that was recorded). measured_dh = entropy at the next recorded
-- step minus this one (null at the last). The law's prediction is -eta cov with an unknown step size eta:
-- scale = the run's least-squares eta through the origin, sum(measured_dh * -cov) / sum(cov^2), over the
-- steps with both; predicted_dh = scale * -cov. corr: Pearson correlation of -cov and measured_dh over those
-- steps (> 0: the law's direction; the scale does not change it); corr_prob the same for cov_prob;
-- steps: how many steps the fit has.
WITH parts AS (
    SELECT
        run,
        rank,
        step,
        update,
        count(*) AS n,
        sum(CAST(advantage AS DOUBLE)) AS sa,
        sum(CAST(logprob AS DOUBLE)) AS sl,
        sum(CAST(advantage AS DOUBLE) * CAST(logprob AS DOUBLE)) AS sal,
        sum(exp(CAST(logprob AS DOUBLE)) * CAST(advantage AS DOUBLE)) AS spa,
        sum(exp(CAST(logprob AS DOUBLE)) * CAST(advantage AS DOUBLE) * CAST(logprob AS DOUBLE)) AS spal
    FROM tokens
    WHERE logprob BETWEEN -1e30 AND 1e30 AND advantage BETWEEN -1e30 AND 1e30
    GROUP BY run, rank, step, update
),
covs AS (
    -- sum over a batch of (A - mean A)(L - mean L) = sum A L - sum A sum L / n (and the same with pi A)
    SELECT
        run,
        step,
        sum(n) AS tokens,
        sum(sal - sa * sl / n) / sum(n) AS cov,
        sum(spal - spa * sl / n) / sum(n) AS cov_prob
    FROM parts
    GROUP BY run, step
),
ent AS (
    SELECT
        run,
        step,
        sum(CAST(coalesce(old_entropy_mean, entropy_mean) AS DOUBLE) * n_tokens) / nullif(sum(n_tokens), 0) AS entropy
    FROM steps
    WHERE n_tokens IS NOT NULL
    GROUP BY run, step
),
ent_next AS (
    SELECT
        run,
        step,
        entropy,
        lead(entropy) OVER (PARTITION BY run ORDER BY step) - entropy AS measured_dh
    FROM ent
    WHERE entropy IS NOT NULL
),
joined AS (
    SELECT c.run, c.step, c.tokens, c.cov, c.cov_prob, e.entropy, e.measured_dh
    FROM covs AS c
    LEFT JOIN ent_next AS e ON c.run = e.run AND c.step = e.step
),
fit AS (
    SELECT
        run,
        CAST(count(*) AS BIGINT) AS steps,
        sum(-cov * measured_dh) / nullif(sum(cov * cov), 0) AS scale,
        corr(-cov, measured_dh) AS corr,
        corr(-cov_prob, measured_dh) AS corr_prob
    FROM joined
    WHERE measured_dh IS NOT NULL AND cov IS NOT NULL
    GROUP BY run
)
SELECT
    j.run,
    r.method,
    j.step,
    CAST(j.tokens AS BIGINT) AS tokens,
    j.cov,
    j.cov_prob,
    j.entropy,
    j.measured_dh,
    f.scale * -j.cov AS predicted_dh,
    f.scale,
    f.corr,
    f.corr_prob,
    coalesce(f.steps, 0) AS steps
FROM joined AS j
JOIN runs AS r ON j.run = r.run
LEFT JOIN fit AS f ON j.run = f.run
ORDER BY j.run, j.step
