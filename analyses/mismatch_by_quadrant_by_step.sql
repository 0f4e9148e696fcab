-- title: Sampler-trainer mismatch by quadrant per step (the report's mismatch figure)
-- columns: run, method, step, quadrant, tokens, sampled, mean_abs_log_ratio, kl_k1, kl_k3, mismatched_frac, masked_frac, clipped, clipped_mismatched_frac, unclipped_mismatched_frac, effect, effect_mismatched, abs_effect, abs_effect_mismatched_share
-- figure: TIS / MIS (delta log p over steps, by quadrant; the share of clipping and of the entropy change)
-- params: mismatch=0.6931471805599453
-- Per step of mismatch_by_quadrant (each step's updates and ranks together); the whole run: mismatch_by_quadrant.
-- delta = tokens.sampler_log_ratio = old_logprob - sampler_logprob; a token is mismatched when |delta| >
-- mismatch (nats; ln 2: the two probabilities differ by more than a factor 2, as steps.clipped_mismatched_frac
-- counts, schema.MISMATCH_LOG_RATIO) or the IS correction masked it (is_masked). sampled = tokens with a sampler
-- log-prob; every mean and share below is over those (NULL, never 0, where the run has none).
-- kl_k1 = mean(-delta), kl_k3 = mean(exp(delta) - 1 - delta): KL(pi_sampler || pi_old) estimates.
-- clipped_mismatched_frac = mismatched share of the tokens PPO-clip dropped, unclipped_mismatched_frac the
-- same share among the others (the clipped set is enriched in mismatch when the first is larger).
-- effect = sum of entropy_effect (the first-order entropy change the tokens' gradients drive, see
-- entropy_budget_by_step), effect_mismatched its part on mismatched tokens, abs_effect = sum |entropy_effect|
-- over the sampled tokens, abs_effect_mismatched_share = the mismatched tokens' part of it.
WITH t AS (
    SELECT
        run,
        step,
        quadrant,
        sampler_log_ratio AS d,
        CAST(abs(sampler_log_ratio) > $mismatch OR (coalesce(is_masked, false) AND sampler_log_ratio IS NOT NULL) AS INTEGER) AS mm,
        CAST(clipped AS INTEGER) AS c,
        CAST(is_masked AS INTEGER) AS masked,
        entropy_effect AS e
    FROM tokens
    WHERE quadrant <> 'ZA'
)
SELECT
    t.run,
    t.step,
    r.method,
    t.quadrant,
    count(*) AS tokens,
    count(t.d) AS sampled,
    avg(abs(t.d)) AS mean_abs_log_ratio,
    avg(-t.d) AS kl_k1,
    avg(exp(t.d) - 1 - t.d) AS kl_k3,
    avg(t.mm) AS mismatched_frac,
    avg(CASE WHEN t.d IS NOT NULL THEN t.masked END) AS masked_frac,
    sum(CASE WHEN t.d IS NOT NULL THEN t.c END) AS clipped,
    avg(CASE WHEN t.c = 1 THEN t.mm END) AS clipped_mismatched_frac,
    avg(CASE WHEN t.c = 0 THEN t.mm END) AS unclipped_mismatched_frac,
    sum(CASE WHEN t.d IS NOT NULL THEN t.e END) AS effect,
    sum(t.mm * t.e) AS effect_mismatched,
    sum(CASE WHEN t.d IS NOT NULL THEN abs(t.e) END) AS abs_effect,
    sum(t.mm * abs(t.e))
        / nullif(sum(CASE WHEN t.d IS NOT NULL THEN abs(t.e) END), 0) AS abs_effect_mismatched_share
FROM t
JOIN runs AS r USING (run)
GROUP BY t.run, r.method, t.step, t.quadrant
ORDER BY t.run, t.step, t.quadrant
