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
WITH seen AS (
    SELECT
        run,
        quadrant,
        entropy,
        old_entropy,
        update,
        lead(entropy) OVER (PARTITION BY run, rank, seq, pos ORDER BY step, update) AS next_entropy
    FROM tokens
    WHERE quadrant <> 'ZA' AND entropy IS NOT NULL
),
mode AS (
    SELECT run, bool_or(next_entropy IS NOT NULL) AS repeated FROM seen GROUP BY run
),
dh AS (
    SELECT
        s.run,
        s.quadrant,
        CASE WHEN m.repeated THEN s.next_entropy - s.entropy ELSE s.entropy - s.old_entropy END AS dh
    FROM seen AS s
    JOIN mode AS m USING (run)
    WHERE CASE WHEN m.repeated THEN s.next_entropy IS NOT NULL ELSE s.update > 0 END
),
per_q AS (
    SELECT run, quadrant, count(*) AS tokens, avg(dh) AS mean_dh FROM dh GROUP BY run, quadrant
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
