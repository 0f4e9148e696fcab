-- title: Measured entropy change per quadrant next to the sign the covariance law predicts
-- columns: run, method, quadrant, tokens, mean_dh, relative_dh, predicted_sign, agrees
-- figure: CE-GPPO Sec. 3 / Fig. 1 (entropy effect of each quadrant; Cui et al. covariance law)
-- params: none
-- dH of a token = its state's entropy at the next update that sees it again minus the entropy at this
-- update (a token appears again when the batch is reused: several epochs / num_iterations > 1, also at
-- the next step: seq ids are run-unique). Where
-- no token is seen twice, dH = entropy - old_entropy at updates after the first (drift since the
-- rollout). relative_dh = mean_dh minus the run's mean over all quadrants (removes the common
-- drift); agrees compares sign(relative_dh) with the law: PA&HP -, PA&LP +, NA&HP +, NA&LP -.
-- Only sequences seen at more than one (step, update) can hold a token seen twice: the per-token
-- window runs over their tokens alone, not over every row.
WITH multi AS (
    SELECT run, rank, seq
    FROM tokens
    WHERE quadrant <> 'ZA' AND entropy IS NOT NULL
    GROUP BY run, rank, seq
    HAVING min(CAST(step AS BIGINT) * 65536 + update) < max(CAST(step AS BIGINT) * 65536 + update)
),
seen AS (
    SELECT
        t.run,
        t.quadrant,
        t.entropy,
        lead(t.entropy) OVER (PARTITION BY t.run, t.rank, t.seq, t.pos ORDER BY t.step, t.update) AS next_entropy
    FROM tokens AS t
    JOIN multi AS m ON t.run = m.run AND t.rank = m.rank AND t.seq = m.seq
    WHERE t.quadrant <> 'ZA' AND t.entropy IS NOT NULL
),
repeated AS (
    SELECT run, quadrant, count(*) AS tokens, avg(next_entropy - entropy) AS mean_dh
    FROM seen
    WHERE next_entropy IS NOT NULL
    GROUP BY run, quadrant
),
drift AS (
    SELECT run, quadrant, count(*) AS tokens, avg(entropy - old_entropy) AS mean_dh
    FROM tokens
    WHERE quadrant <> 'ZA' AND entropy IS NOT NULL AND update > 0
    GROUP BY run, quadrant
),
per_q AS (
    SELECT run, quadrant, tokens, mean_dh FROM repeated
    UNION ALL
    SELECT d.run, d.quadrant, d.tokens, d.mean_dh
    FROM drift AS d
    LEFT JOIN (SELECT DISTINCT run FROM repeated) AS x ON d.run = x.run
    WHERE x.run IS NULL
)
SELECT
    p.run,
    r.method,
    p.quadrant,
    p.tokens,
    p.mean_dh,
    p.mean_dh - avg(p.mean_dh) OVER (PARTITION BY p.run) AS relative_dh,
    CASE p.quadrant WHEN 'PA&HP' THEN -1 WHEN 'PA&LP' THEN 1 WHEN 'NA&HP' THEN 1 ELSE -1 END AS predicted_sign,
    sign(p.mean_dh - avg(p.mean_dh) OVER (PARTITION BY p.run))
        = CASE p.quadrant WHEN 'PA&HP' THEN -1 WHEN 'PA&LP' THEN 1 WHEN 'NA&HP' THEN 1 ELSE -1 END AS agrees
FROM per_q AS p
JOIN runs AS r USING (run)
ORDER BY p.run, p.quadrant
