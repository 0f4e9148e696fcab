-- title: Sampler-trainer mismatch per step: |delta log p|, KL(sampler || trainer), IS-masked share
-- columns: run, method, step, tokens, mean_abs_log_ratio, max_abs_log_ratio, kl_k1, kl_k3, masked_frac, clipped_mismatched_frac
-- figure: TIS / MIS (training-inference mismatch; TRL sampling/sampling_logp_difference, verl rollout_corr kl / k3_kl)
-- params: none
-- delta = old_logprob - sampler_logprob per token (tokens.sampler_log_ratio: the trainer's log-prob of the
-- sampled token minus the sampler's). kl_k1 = mean(sampler_logprob - old_logprob) = mean(-delta) and
-- kl_k3 = mean(exp(delta) - 1 - delta): both estimate KL(pi_sampler || pi_old) over tokens drawn from the
-- sampler (verl's rollout_corr/kl and k3_kl). Token-weighted over the step's updates and ranks; max over them.
-- Exact: from the steps table (all tokens, also when token rows are sampled). NULL where the run recorded
-- no sampler log-probs (never 0).
SELECT
    s.run,
    r.method,
    s.step,
    sum(CASE WHEN s.sampler_abs_log_ratio_mean IS NOT NULL THEN s.n_tokens END) AS tokens,
    sum(s.sampler_abs_log_ratio_mean * s.n_tokens)
        / nullif(sum(CASE WHEN s.sampler_abs_log_ratio_mean IS NOT NULL THEN s.n_tokens END), 0) AS mean_abs_log_ratio,
    max(s.sampler_abs_log_ratio_max) AS max_abs_log_ratio,
    sum(s.sampler_kl_k1 * s.n_tokens)
        / nullif(sum(CASE WHEN s.sampler_kl_k1 IS NOT NULL THEN s.n_tokens END), 0) AS kl_k1,
    sum(s.sampler_kl_k3 * s.n_tokens)
        / nullif(sum(CASE WHEN s.sampler_kl_k3 IS NOT NULL THEN s.n_tokens END), 0) AS kl_k3,
    sum(s.is_masked_frac * s.n_tokens)
        / nullif(sum(CASE WHEN s.is_masked_frac IS NOT NULL THEN s.n_tokens END), 0) AS masked_frac,
    sum(s.clipped_mismatched_frac * s.n_tokens)
        / nullif(sum(CASE WHEN s.clipped_mismatched_frac IS NOT NULL THEN s.n_tokens END), 0) AS clipped_mismatched_frac
FROM steps AS s
JOIN runs AS r USING (run)
WHERE s.n_tokens > 0
GROUP BY s.run, r.method, s.step
ORDER BY s.run, s.step
