-- title: Covariance of log-probability and advantage per quadrant and step (Cui et al.'s entropy law)
-- columns: run, method, step, quadrant, tokens, cov_sum, cov_mean, contribution, step_cov
-- figure: Cui et al. 2025 (the entropy mechanism): tokens of high Cov(log pi, A) drive the entropy down
-- params: none
-- Per token i of a batch b = (run, rank, step, update): c_i = (A_i - mean_b A) (log pi_i - mean_b log pi),
-- log pi = logprob (the policy at this update), the means over the batch's recorded rows, ZA included
-- (a sampled run: its kept rows; rows with a non-finite log-prob or advantage left out).
-- cov_sum: sum of c_i over the quadrant's tokens of the step (its updates and ranks); cov_mean =
-- cov_sum / tokens; contribution = cov_sum / the step's tokens: the quadrants' contributions add up to
-- step_cov, the step's token-mean covariance. The law dH ~ -eta Cov: a positive covariance lowers entropy.
-- One pass over the tokens: per (batch, quadrant) n, sum A, sum L, sum A L; then
-- sum_q c_i = sum_q A L - mean L sum_q A - mean A sum_q L + n_q mean A mean L.
WITH parts AS (
    SELECT
        run,
        rank,
        step,
        update,
        quadrant,
        count(*) AS n,
        sum(CAST(advantage AS DOUBLE)) AS sa,
        sum(CAST(logprob AS DOUBLE)) AS sl,
        sum(CAST(advantage AS DOUBLE) * CAST(logprob AS DOUBLE)) AS sal
    FROM tokens
    WHERE logprob BETWEEN -1e30 AND 1e30 AND advantage BETWEEN -1e30 AND 1e30
    GROUP BY run, rank, step, update, quadrant
),
batches AS (
    SELECT run, rank, step, update, sum(sa) / sum(n) AS ma, sum(sl) / sum(n) AS ml
    FROM parts
    GROUP BY run, rank, step, update
),
per_q AS (
    SELECT
        p.run,
        p.step,
        p.quadrant,
        sum(p.n) AS tokens,
        sum(p.sal - b.ml * p.sa - b.ma * p.sl + p.n * b.ma * b.ml) AS cov_sum
    FROM parts AS p
    JOIN batches AS b ON p.run = b.run AND p.rank = b.rank AND p.step = b.step AND p.update = b.update
    GROUP BY p.run, p.step, p.quadrant
)
SELECT
    q.run,
    r.method,
    q.step,
    q.quadrant,
    CAST(q.tokens AS BIGINT) AS tokens,
    q.cov_sum,
    q.cov_sum / q.tokens AS cov_mean,
    q.cov_sum / sum(q.tokens) OVER (PARTITION BY q.run, q.step) AS contribution,
    sum(q.cov_sum) OVER (PARTITION BY q.run, q.step) / sum(q.tokens) OVER (PARTITION BY q.run, q.step) AS step_cov
FROM per_q AS q
JOIN runs AS r ON q.run = r.run
ORDER BY q.run, q.step, q.quadrant
