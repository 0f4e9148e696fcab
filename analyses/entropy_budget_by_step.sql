-- title: Entropy budget per step: each quadrant's first-order entropy effect, kept and dropped
-- columns: run, method, step, quadrant, effect, dropped, step_effect, step_dropped, dropped_clip_low, dropped_clip_high, dropped_dual_clip, dropped_clip_cov, dropped_kl_cov, dropped_erc, entropy
-- figure: CE-GPPO Sec. 3 / Fig. 1 (entropy effect of each quadrant; what PPO-clip drops)
-- params: none
-- effect = sum over the quadrant's tokens of g s / T^2 (the entropy change its gradient drives per unit
-- logit step, eta left out); dropped = sum of (g_unclipped - g) s / T^2 over tokens whose gradient
-- clipping / CE-GPPO's beta / ERC / dual-clip changed: the effect that was taken away. step_* are the
-- step totals (ZA tokens included); step_dropped split by cause (they add up to it): dropped_clip_low /
-- dropped_clip_high (PPO-clip's sides, CE-GPPO's beta1 / beta2), dropped_dual_clip (dual-clip, TRL's
-- delta), dropped_clip_cov / dropped_kl_cov (Clip-Cov's selection, KL-Cov's penalty), dropped_erc (ERC's
-- own share); NULL where the run had no such cause (no ERC, no dual-clip, another method) or
-- was recorded before the split (schema version < 3). Exact: from the steps table (all tokens, also when
-- token rows are sampled), summed over the step's updates and ranks. NULL where a run recorded no entropy
-- sensitivity (or, for effect, an entropy bonus whose own term was not measured). entropy: the step's
-- token-weighted mean sampling entropy H (old_entropy_mean), for the sign's threshold exp(-H).
WITH s AS (
    SELECT
        run,
        step,
        sum(entropy_effect) AS step_effect,
        sum(entropy_effect_dropped) AS step_dropped,
        sum(entropy_effect_dropped_clip_low) AS dropped_clip_low,
        sum(entropy_effect_dropped_clip_high) AS dropped_clip_high,
        sum(entropy_effect_dropped_dual_clip) AS dropped_dual_clip,
        sum(entropy_effect_dropped_clip_cov) AS dropped_clip_cov,
        sum(entropy_effect_dropped_kl_cov) AS dropped_kl_cov,
        sum(entropy_effect_dropped_erc) AS dropped_erc,
        sum(entropy_effect_pa_hp) AS e_pa_hp,
        sum(entropy_effect_pa_lp) AS e_pa_lp,
        sum(entropy_effect_na_hp) AS e_na_hp,
        sum(entropy_effect_na_lp) AS e_na_lp,
        sum(entropy_effect_dropped_pa_hp) AS d_pa_hp,
        sum(entropy_effect_dropped_pa_lp) AS d_pa_lp,
        sum(entropy_effect_dropped_na_hp) AS d_na_hp,
        sum(entropy_effect_dropped_na_lp) AS d_na_lp,
        sum(old_entropy_mean * n_tokens) / nullif(sum(CASE WHEN old_entropy_mean IS NOT NULL THEN n_tokens END), 0)
            AS entropy
    FROM steps
    WHERE n_tokens IS NOT NULL
    GROUP BY run, step
),
q AS (
    SELECT run, step, 'PA&HP' AS quadrant, e_pa_hp AS effect, d_pa_hp AS dropped FROM s
    UNION ALL
    SELECT run, step, 'PA&LP' AS quadrant, e_pa_lp AS effect, d_pa_lp AS dropped FROM s
    UNION ALL
    SELECT run, step, 'NA&HP' AS quadrant, e_na_hp AS effect, d_na_hp AS dropped FROM s
    UNION ALL
    SELECT run, step, 'NA&LP' AS quadrant, e_na_lp AS effect, d_na_lp AS dropped FROM s
)
SELECT
    q.run,
    r.method,
    q.step,
    q.quadrant,
    q.effect,
    q.dropped,
    s.step_effect,
    s.step_dropped,
    s.dropped_clip_low,
    s.dropped_clip_high,
    s.dropped_dual_clip,
    s.dropped_clip_cov,
    s.dropped_kl_cov,
    s.dropped_erc,
    s.entropy
FROM q
JOIN s ON q.run = s.run AND q.step = s.step
JOIN runs AS r ON q.run = r.run
ORDER BY q.run, q.step, q.quadrant
