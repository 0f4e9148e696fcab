-- title: One line per run: method, steps, tokens, final and minimum entropy, reward, clip fractions
-- columns: run, method, status, steps, tokens, final_entropy, min_entropy, final_reward, clip_low_frac, clip_high_frac, erc_drop_frac, eps_low, eps_high, config
-- figure: the report's summary table
-- params: none
-- final_*: the last recorded step; clip fractions are token-weighted over the whole run (exact, from steps).
WITH per_step AS (
    SELECT
        run,
        step,
        sum(old_entropy_mean * n_tokens) / nullif(sum(n_tokens), 0) AS entropy,
        sum(n_tokens) AS tokens,
        sum(clip_low_frac * n_tokens) AS clip_low,
        sum(clip_high_frac * n_tokens) AS clip_high,
        sum(erc_drop_frac * n_tokens) AS erc_drop,
        max(reward_mean) AS reward
    FROM steps
    GROUP BY run, step
),
agg AS (
    SELECT
        run,
        CAST(count_if(tokens > 0) AS BIGINT) AS steps,
        sum(tokens) AS tokens,
        arg_max(entropy, step) FILTER (WHERE entropy IS NOT NULL) AS final_entropy,
        min(entropy) AS min_entropy,
        arg_max(reward, step) FILTER (WHERE reward IS NOT NULL) AS final_reward,
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
    a.final_reward,
    a.clip_low_frac,
    a.clip_high_frac,
    a.erc_drop_frac,
    r.eps_low,
    r.eps_high,
    r.config
FROM runs AS r
LEFT JOIN agg AS a USING (run)
ORDER BY r.run
