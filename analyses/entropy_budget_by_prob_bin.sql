-- title: Entropy effect by sampling-probability bin and advantage sign, kept and dropped
-- columns: run, method, sign, bin, prob_lo, prob_hi, tokens, changed, effect, dropped, effect_per_token
-- figure: CE-GPPO Sec. 3 (which tokens drive entropy: high vs low probability, by advantage sign)
-- params: bins=10
-- effect = sum of tokens.entropy_effect (g s / T^2) in the bin; dropped = sum of entropy_effect_dropped
-- (what clipping / beta / ERC / dual-clip took away), changed = tokens whose gradient was changed.
-- sign: PA (A > 0) or NA (A < 0); A = 0 tokens have no effect and are left out. From token rows: sums
-- cover the sampled sequences only when the run was recorded with sample < 1. Tokens without an effect
-- are left out: no attribution recorded, or an entropy bonus whose own term was not measured.
SELECT
    t.run,
    r.method,
    CASE WHEN t.advantage > 0 THEN 'PA' ELSE 'NA' END AS sign,
    least(floor(t.prob * $bins), $bins - 1) AS bin,
    least(floor(t.prob * $bins), $bins - 1) / $bins AS prob_lo,
    (least(floor(t.prob * $bins), $bins - 1) + 1) / $bins AS prob_hi,
    count(*) AS tokens,
    count(t.entropy_effect_dropped) AS changed,
    sum(t.entropy_effect) AS effect,
    coalesce(sum(t.entropy_effect_dropped), 0) AS dropped,
    avg(t.entropy_effect) AS effect_per_token
FROM tokens AS t
JOIN runs AS r ON t.run = r.run
WHERE t.entropy_effect IS NOT NULL AND t.advantage <> 0
GROUP BY
    t.run,
    r.method,
    CASE WHEN t.advantage > 0 THEN 'PA' ELSE 'NA' END,
    least(floor(t.prob * $bins), $bins - 1)
ORDER BY t.run, sign, bin
