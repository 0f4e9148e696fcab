-- title: Per step, the mismatched share of the clipped tokens, of the other tokens and of the entropy effect
-- columns: run, method, step, tokens, sampled, mismatched_frac, clipped, clipped_mismatched_frac, unclipped_mismatched_frac, effect, effect_mismatched, abs_effect_mismatched_share
-- figure: TIS / MIS (are the clipped tokens the mismatched ones; how much of the entropy change they carry)
-- params: mismatch=0.6931471805599453
-- All tokens of the step (ZA included), its updates and ranks together; delta = old_logprob -
-- sampler_logprob, mismatched when |delta| > mismatch (nats; ln 2,
-- schema.MISMATCH_LOG_RATIO, as steps.clipped_mismatched_frac) or is_masked. clipped_mismatched_frac = mismatched share
-- of the sampled tokens PPO-clip dropped, unclipped_mismatched_frac of the others; effect = sum of
-- entropy_effect over the sampled tokens, effect_mismatched its mismatched part, abs_effect_mismatched_share
-- = sum |entropy_effect| over mismatched / over all sampled tokens. NULL (never 0) without sampler log-probs.
-- The report's mismatch figure pools mismatch_by_quadrant_by_step's rows (ZA left out there) to these numbers.
WITH t AS (
    SELECT
        run,
        step,
        sampler_log_ratio AS d,
        CAST(abs(sampler_log_ratio) > $mismatch OR (coalesce(is_masked, false) AND sampler_log_ratio IS NOT NULL) AS INTEGER) AS mm,
        CAST(clipped AS INTEGER) AS c,
        entropy_effect AS e
    FROM tokens
)
SELECT
    t.run,
    r.method,
    t.step,
    count(*) AS tokens,
    count(t.d) AS sampled,
    avg(t.mm) AS mismatched_frac,
    sum(CASE WHEN t.d IS NOT NULL THEN t.c END) AS clipped,
    avg(CASE WHEN t.c = 1 THEN t.mm END) AS clipped_mismatched_frac,
    avg(CASE WHEN t.c = 0 THEN t.mm END) AS unclipped_mismatched_frac,
    sum(CASE WHEN t.d IS NOT NULL THEN t.e END) AS effect,
    sum(t.mm * t.e) AS effect_mismatched,
    sum(t.mm * abs(t.e)) / nullif(sum(CASE WHEN t.d IS NOT NULL THEN abs(t.e) END), 0) AS abs_effect_mismatched_share
FROM t
JOIN runs AS r USING (run)
GROUP BY t.run, r.method, t.step
ORDER BY t.run, t.step
