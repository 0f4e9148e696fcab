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
-- Without a group per sequence: one pass sums the drift and finds each (run, rank, step, update)'s
-- seq range; a sequence seen at two (step, update) lies where the ranges of its rank overlap (swept
-- in seq order: below the largest hi of the ranges before, or above the smallest lo of those after),
-- so the per-token window runs over the rows in those overlaps alone (a token seen once has no next
-- row there either); in a run that reuses batches that is every row, as before.
WITH blocks AS (
    SELECT
        run,
        rank,
        step,
        update,
        quadrant,
        min(seq) AS lo,
        max(seq) AS hi,
        count(*) AS n,
        count(entropy - old_entropy) AS n_dh,
        sum(entropy - old_entropy) AS sum_dh
    FROM tokens
    WHERE quadrant <> 'ZA' AND entropy IS NOT NULL
    GROUP BY run, rank, step, update, quadrant
),
ranges AS (
    SELECT run, rank, step, update, min(lo) AS lo, max(hi) AS hi
    FROM blocks
    GROUP BY run, rank, step, update
),
swept AS (
    SELECT
        run,
        rank,
        step,
        update,
        lo,
        hi,
        max(hi) OVER (PARTITION BY run, rank ORDER BY lo, step, update
                      ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING) AS prev_hi,
        min(lo) OVER (PARTITION BY run, rank ORDER BY lo, step, update
                      ROWS BETWEEN 1 FOLLOWING AND UNBOUNDED FOLLOWING) AS next_lo
    FROM ranges
),
shared AS (
    SELECT run, rank, step, update, prev_hi, next_lo
    FROM swept
    WHERE prev_hi >= lo OR next_lo <= hi
),
seen AS (
    SELECT
        t.run,
        t.quadrant,
        t.entropy,
        lead(t.entropy) OVER (PARTITION BY t.run, t.rank, t.seq, t.pos ORDER BY t.step, t.update) AS next_entropy
    FROM tokens AS t
    JOIN shared AS s ON t.run = s.run AND t.rank = s.rank AND t.step = s.step AND t.update = s.update
    WHERE t.quadrant <> 'ZA' AND t.entropy IS NOT NULL AND (t.seq <= s.prev_hi OR t.seq >= s.next_lo)
),
repeated AS (
    SELECT run, quadrant, count(*) AS tokens, avg(next_entropy - entropy) AS mean_dh
    FROM seen
    WHERE next_entropy IS NOT NULL
    GROUP BY run, quadrant
),
drift AS (
    SELECT run, quadrant, CAST(sum(n) AS BIGINT) AS tokens, sum(sum_dh) / nullif(sum(n_dh), 0) AS mean_dh
    FROM blocks
    WHERE update > 0
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
