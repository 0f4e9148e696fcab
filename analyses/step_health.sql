-- title: Per-step health signals: the inputs of the alarms (`entropylens check`)
-- columns: run, method, step, entropy, old_entropy, entropy_effect, clipped_frac, kl, grad_norm, erc_drop_frac
-- figure: none (alarms: collapse, explosion, negative entropy budget, clip / KL / grad-norm spikes, ERC drop rate)
-- params: none
-- Exact, from steps: entropies, clipped fraction, KL and the ERC drop fraction token-weighted over the
-- step's updates and ranks; entropy_effect = the step's entropy budget (sum of the tokens' first-order
-- entropy effect g s / T^2); grad_norm = mean over the step's updates. NULL where not recorded.
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
    sum(s.erc_drop_frac * s.n_tokens)
        / nullif(sum(CASE WHEN s.erc_drop_frac IS NOT NULL THEN s.n_tokens END), 0) AS erc_drop_frac
FROM steps AS s
JOIN runs AS r ON s.run = r.run
GROUP BY s.run, r.method, s.step
ORDER BY s.run, s.step
