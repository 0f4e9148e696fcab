-- title: Importance ratio against sampling probability, by quadrant (bounded sample)
-- columns: run, method, step, prob, ratio, quadrant, clipped, eps_low, eps_high
-- figure: CE-GPPO Fig. 1 left (scatter with the 1 - eps_low and 1 + eps_high lines)
-- params: points=4000
-- A deterministic sample of at most $points token rows per run: the rows with the smallest hash of
-- their key (step, update, rank, seq, pos), a multiplicative hash modulo the prime 2^31 - 1 written in
-- plain integer arithmetic (every product < 2^62) so DuckDB and Spark pick the same rows.
-- Without sorting every row: one pass counts the hashes in 1,024 equal buckets (2^21 wide), a second
-- ranks only the rows of the first buckets that together hold at least $points rows (those buckets
-- hold every row that ranks within $points). Buckets are h // 2^21 (integer division; Spark DIV); the
-- second pass keeps rows below the largest run's cut before joining each run's own cut.
WITH hashed AS (
    SELECT
        t.run,
        ((((((((CAST(t.step AS BIGINT) * 742938285 + t.update) % 2147483647) * 742938285 + t.rank)
            % 2147483647) * 742938285 + t.seq) % 2147483647) * 742938285 + t.pos) % 2147483647)
            * 742938285 % 2147483647 AS h
    FROM tokens AS t
    WHERE t.quadrant <> 'ZA'
),
buckets AS (
    SELECT run, h // 2097152 AS b, count(*) AS n
    FROM hashed
    GROUP BY run, h // 2097152
),
upto AS (
    SELECT
        run,
        b,
        sum(n) OVER (PARTITION BY run ORDER BY b ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW) AS cum
    FROM buckets
),
cut AS (
    SELECT run, coalesce(min(CASE WHEN cum >= $points THEN b END), max(b)) AS last_b FROM upto GROUP BY run
),
keyed AS (
    SELECT
        t.run,
        t.step,
        t.update,
        t.rank,
        t.seq,
        t.pos,
        t.prob,
        t.ratio,
        t.quadrant,
        t.clipped,
        ((((((((CAST(t.step AS BIGINT) * 742938285 + t.update) % 2147483647) * 742938285 + t.rank)
            % 2147483647) * 742938285 + t.seq) % 2147483647) * 742938285 + t.pos) % 2147483647)
            * 742938285 % 2147483647 AS h
    FROM tokens AS t
    WHERE t.quadrant <> 'ZA'
),
ranked AS (
    SELECT
        k.run,
        k.step,
        k.prob,
        k.ratio,
        k.quadrant,
        k.clipped,
        row_number() OVER (PARTITION BY k.run ORDER BY k.h, k.step, k.update, k.rank, k.seq, k.pos) AS k
    FROM keyed AS k
    JOIN cut AS c ON k.run = c.run
    WHERE k.h < (SELECT max(last_b) + 1 FROM cut) * 2097152 AND k.h // 2097152 <= c.last_b
)
SELECT
    x.run,
    r.method,
    x.step,
    x.prob,
    x.ratio,
    x.quadrant,
    x.clipped,
    r.eps_low,
    r.eps_high
FROM ranked AS x
JOIN runs AS r USING (run)
WHERE x.k <= $points
ORDER BY x.run, x.k
