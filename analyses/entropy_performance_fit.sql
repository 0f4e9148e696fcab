-- title: Entropy-performance fit R = -a exp(H) + b per run (Cui et al.'s empirical law)
-- columns: run, method, step, entropy, reward, fitted_reward, a, b, rmse, r2, steps
-- figure: Cui et al. 2025 (the entropy mechanism): performance R = -a exp(H) + b as the entropy H falls
-- params: none
-- entropy: the step's token-weighted mean entropy, exact from steps (old_entropy_mean: the policy that
-- sampled the step's responses; entropy_mean where only that was recorded); reward: the step's mean reward
-- over its sequences (steps' reward_mean for runs without sequences). Least squares in x = exp(H), per run
-- over the steps with both: slope = covar_pop(R, x) / var_pop(x), a = -slope, b = mean R + a mean x;
-- fitted_reward = b - a exp(H); rmse = sqrt(mean (R - fitted)^2); r2 = 1 - SSE / SST (null where the reward
-- does not vary); steps: how many steps the fit has (a and b are null below 2 or where H does not vary).
WITH ent AS (
    SELECT
        run,
        step,
        sum(CAST(coalesce(old_entropy_mean, entropy_mean) AS DOUBLE) * n_tokens) / nullif(sum(n_tokens), 0) AS entropy
    FROM steps
    WHERE n_tokens IS NOT NULL
    GROUP BY run, step
),
seq_reward AS (
    SELECT run, step, avg(CAST(reward AS DOUBLE)) AS reward
    FROM sequences
    WHERE reward BETWEEN -1e30 AND 1e30
    GROUP BY run, step
),
rewards AS (
    SELECT run, step, reward FROM seq_reward
    UNION ALL
    SELECT run, step, avg(CAST(reward_mean AS DOUBLE)) AS reward
    FROM steps
    WHERE reward_mean IS NOT NULL AND run NOT IN (SELECT run FROM seq_reward)
    GROUP BY run, step
),
pts AS (
    SELECT e.run, e.step, e.entropy, w.reward, exp(e.entropy) AS x
    FROM ent AS e
    JOIN rewards AS w ON e.run = w.run AND e.step = w.step
    WHERE e.entropy IS NOT NULL AND w.reward IS NOT NULL
),
coef AS (
    SELECT
        run,
        CAST(count(*) AS BIGINT) AS steps,
        -covar_pop(reward, x) / nullif(var_pop(x), 0) AS a,
        avg(reward) + covar_pop(reward, x) / nullif(var_pop(x), 0) * -avg(x) AS b,
        avg(reward) AS mean_r
    FROM pts
    GROUP BY run
),
fitted AS (
    SELECT
        p.run,
        p.step,
        p.entropy,
        p.reward,
        c.b - c.a * p.x AS fitted_reward,
        c.a,
        c.b,
        c.steps,
        c.mean_r
    FROM pts AS p
    JOIN coef AS c ON p.run = c.run
)
SELECT
    f.run,
    r.method,
    f.step,
    f.entropy,
    f.reward,
    f.fitted_reward,
    f.a,
    f.b,
    sqrt(avg((f.reward - f.fitted_reward) * (f.reward - f.fitted_reward)) OVER (PARTITION BY f.run)) AS rmse,
    1 - sum((f.reward - f.fitted_reward) * (f.reward - f.fitted_reward)) OVER (PARTITION BY f.run)
        / nullif(sum((f.reward - f.mean_r) * (f.reward - f.mean_r)) OVER (PARTITION BY f.run), 0) AS r2,
    f.steps
FROM fitted AS f
JOIN runs AS r ON f.run = r.run
ORDER BY f.run, f.step
