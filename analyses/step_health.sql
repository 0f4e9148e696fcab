-- title: Per-step health signals: the inputs of the alarms (`entropylens check`)
-- columns: run, method, step, entropy, old_entropy, entropy_effect, clipped_frac, kl, grad_norm, loss, lr, erc_drop_frac, entropy_ratio_p05, entropy_ratio_p95, erc_low, erc_high, n_nonfinite_ratio, za_frac, zero_grad_frac, sampler_kl
-- figure: none (alarms: nonfinite, collapse, explosion, negative entropy budget, clip / KL / grad-norm spikes, ERC drop rate, no signal)
-- params: none
-- Exact, from steps: entropies, clipped fraction, KL and the ERC drop fraction token-weighted over the
-- step's updates and ranks; entropy_effect = the step's entropy budget (sum of the tokens' first-order
-- entropy effect g s / T^2); grad_norm, loss, lr = means over the step's rows. NaN and inf pass through
-- (a NaN grad norm makes the step's grad_norm NaN: DuckDB's sum / avg over a NaN is NaN), NULL where not
-- recorded. entropy_ratio_p05 / _p95: the lowest p05 and highest p95 of the step's updates; erc_low /
-- erc_high: the widest ERC band of the step (NULL without ERC). n_nonfinite_ratio: tokens whose ratio or
-- k3 overflowed. za_frac = n_za / n_tokens (tokens with advantage exactly 0); zero_grad_frac: share of the
-- step's rows with a grad norm whose grad norm is exactly 0. sampler_kl: KL(pi_sampler || pi_old), k3
-- (steps.sampler_kl_k3; NULL without sampler log-probs), each update weighted by its tokens with a sampler
-- log-prob (steps.n_sampled, the tokens the k3 mean is over; n_tokens in rows without it), as mismatch_by_step.
SELECT
    s.run,
    r.method,
    s.step,
    sum(s.entropy_mean * s.n_tokens)
        / nullif(sum(CASE WHEN s.entropy_mean IS NOT NULL THEN s.n_tokens END), 0) AS entropy,
    sum(s.old_entropy_mean * s.n_tokens)
        / nullif(sum(CASE WHEN s.old_entropy_mean IS NOT NULL THEN s.n_tokens END), 0) AS old_entropy,
    sum(s.entropy_effect) AS entropy_effect,
    sum(s.clipped_frac * s.n_tokens) / nullif(sum(CASE WHEN s.clipped_frac IS NOT NULL THEN s.n_tokens END), 0)
        AS clipped_frac,
    sum(s.kl_k3 * s.n_tokens) / nullif(sum(CASE WHEN s.kl_k3 IS NOT NULL THEN s.n_tokens END), 0) AS kl,
    avg(s.grad_norm) AS grad_norm,
    avg(s.loss) AS loss,
    avg(s.lr) AS lr,
    sum(s.erc_drop_frac * s.n_tokens)
        / nullif(sum(CASE WHEN s.erc_drop_frac IS NOT NULL THEN s.n_tokens END), 0) AS erc_drop_frac,
    min(s.entropy_ratio_p05) AS entropy_ratio_p05,
    max(s.entropy_ratio_p95) AS entropy_ratio_p95,
    min(s.erc_low) AS erc_low,
    max(s.erc_high) AS erc_high,
    CAST(sum(s.n_nonfinite_ratio) AS BIGINT) AS n_nonfinite_ratio,
    CAST(sum(s.n_za) AS DOUBLE) / nullif(sum(CASE WHEN s.n_za IS NOT NULL THEN s.n_tokens END), 0) AS za_frac,
    avg(CASE WHEN s.grad_norm = 0 THEN 1.0 WHEN s.grad_norm IS NOT NULL THEN 0.0 END) AS zero_grad_frac,
    sum(s.sampler_kl_k3 * coalesce(s.n_sampled, s.n_tokens))
        / nullif(sum(CASE WHEN s.sampler_kl_k3 IS NOT NULL THEN coalesce(s.n_sampled, s.n_tokens) END), 0) AS sampler_kl
FROM steps AS s
JOIN runs AS r ON s.run = r.run
GROUP BY s.run, r.method, s.step
ORDER BY s.run, s.step
