-- title: Sampler-trainer mismatch per step: |delta log p|, KL(sampler || trainer), IS-masked share
-- columns: run, method, step, tokens, mean_abs_log_ratio, max_abs_log_ratio, kl_k1, kl_k3, masked_frac, clipped_mismatched_frac
-- figure: TIS / MIS (training-inference mismatch; TRL sampling/sampling_logp_difference, verl rollout_corr kl / k3_kl)
-- params: none
-- delta = old_logprob - sampler_logprob per token (tokens.sampler_log_ratio: the trainer's log-prob of the
-- sampled token minus the sampler's). kl_k1 = mean(sampler_logprob - old_logprob) = mean(-delta) and
-- kl_k3 = mean(exp(delta) - 1 - delta): both estimate KL(pi_sampler || pi_old) over tokens drawn from the
-- sampler (verl's rollout_corr/kl and k3_kl). Pooled over the step's updates and ranks, each update weighted by
-- the count its value is over: mean_abs_log_ratio, kl_k1, kl_k3 by its tokens with a sampler log-prob
-- (steps.n_sampled), masked_frac by all its tokens (n_tokens), clipped_mismatched_frac by its clipped tokens
-- with a sampler log-prob (steps.n_sampled_clipped; an update without clipped tokens has none and counts
-- nothing); max over them. Steps rows without those counts (written by hand, not by the recorder) weigh by
-- n_tokens and round(clipped_frac x n_tokens), equal where the sampler scored every token. tokens: the
-- step's tokens in updates with sampler log-probs.
-- Exact: from the steps table (all tokens, also when token rows are sampled). NULL where the run recorded
-- no sampler log-probs (never 0).
WITH s AS (
    SELECT
        *,
        coalesce(n_sampled, n_tokens) AS w_sampled,
        coalesce(n_sampled_clipped, round(clipped_frac * n_tokens)) AS w_clipped
    FROM steps
    WHERE n_tokens > 0
)
SELECT
    s.run,
    r.method,
    s.step,
    sum(CASE WHEN s.sampler_abs_log_ratio_mean IS NOT NULL THEN s.n_tokens END) AS tokens,
    sum(s.sampler_abs_log_ratio_mean * s.w_sampled)
        / nullif(sum(CASE WHEN s.sampler_abs_log_ratio_mean IS NOT NULL THEN s.w_sampled END), 0) AS mean_abs_log_ratio,
    max(s.sampler_abs_log_ratio_max) AS max_abs_log_ratio,
    sum(s.sampler_kl_k1 * s.w_sampled)
        / nullif(sum(CASE WHEN s.sampler_kl_k1 IS NOT NULL THEN s.w_sampled END), 0) AS kl_k1,
    sum(s.sampler_kl_k3 * s.w_sampled)
        / nullif(sum(CASE WHEN s.sampler_kl_k3 IS NOT NULL THEN s.w_sampled END), 0) AS kl_k3,
    sum(s.is_masked_frac * s.n_tokens)
        / nullif(sum(CASE WHEN s.is_masked_frac IS NOT NULL THEN s.n_tokens END), 0) AS masked_frac,
    sum(s.clipped_mismatched_frac * s.w_clipped)
        / nullif(sum(CASE WHEN s.clipped_mismatched_frac IS NOT NULL THEN s.w_clipped END), 0) AS clipped_mismatched_frac
FROM s
JOIN runs AS r USING (run)
GROUP BY s.run, r.method, s.step
ORDER BY s.run, s.step
