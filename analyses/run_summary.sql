-- title: One line per run: method, steps, tokens, final and minimum entropy, reward, clip fractions
-- columns: run, method, status, steps, tokens, final_entropy, min_entropy, final_reward, clip_low_frac, clip_high_frac, erc_drop_frac, eps_low, eps_high, config
-- figure: the report's summary table
-- params: none
-- steps: recorded steps (a run that logs only scalars counts its steps too); final_*: the last recorded step;
-- final_entropy, min_entropy: token-weighted mean old_entropy of a step (entropy where a run recorded only that); clip fractions are token-weighted over the whole run (exact, from steps).
-- final_reward: mean reward over the last step's sequences, all ranks (steps' reward_mean for runs without sequences).
WITH per_step AS (
    SELECT
        run,
        step,
        -- the sampling policy's entropy (old_entropy); the current policy's where only that was recorded
        sum(coalesce(old_entropy_mean, entropy_mean) * n_tokens) / nullif(sum(n_tokens), 0) AS entropy,
        sum(n_tokens) AS tokens,
        sum(clip_low_frac * n_tokens) AS clip_low,
        sum(clip_high_frac * n_tokens) AS clip_high,
        sum(erc_drop_frac * n_tokens) AS erc_drop
    FROM steps
    GROUP BY run, step
),
seq_reward AS (
    SELECT
        run,
        step,
        avg(reward) AS reward
    FROM sequences
    GROUP BY run, step
),
rewards AS (
    SELECT
        run,
        step,
        reward
    FROM seq_reward
    UNION ALL
    SELECT
        run,
        step,
        avg(reward_mean) AS reward
    FROM steps
    WHERE reward_mean IS NOT NULL
        AND run NOT IN (SELECT run FROM seq_reward)
    GROUP BY run, step
),
final_reward AS (
    SELECT
        run,
        arg_max(reward, step) FILTER (WHERE reward IS NOT NULL) AS final_reward
    FROM rewards
    GROUP BY run
),
agg AS (
    SELECT
        run,
        CAST(count(*) AS BIGINT) AS steps,  -- every recorded step, updates or only scalars (record_step)
        sum(tokens) AS tokens,
        arg_max(entropy, step) FILTER (WHERE entropy IS NOT NULL) AS final_entropy,
        min(entropy) AS min_entropy,
        sum(clip_low) / nullif(sum(tokens), 0) AS clip_low_frac,
        sum(clip_high) / nullif(sum(tokens), 0) AS clip_high_frac,
        sum(erc_drop) / nullif(sum(tokens), 0) AS erc_drop_frac
    FROM per_step
    GROUP BY run
)
SELECT
    r.run,
    r.method,
    r.status,
    coalesce(a.steps, 0) AS steps,
    coalesce(a.tokens, 0) AS tokens,
    a.final_entropy,
    a.min_entropy,
    fr.final_reward,
    a.clip_low_frac,
    a.clip_high_frac,
    a.erc_drop_frac,
    r.eps_low,
    r.eps_high,
    r.config
FROM runs AS r
LEFT JOIN agg AS a USING (run)
LEFT JOIN final_reward AS fr USING (run)
ORDER BY r.run
