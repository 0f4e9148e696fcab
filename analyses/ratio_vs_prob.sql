-- title: Importance ratio against sampling probability, by quadrant (bounded sample)
-- columns: run, method, step, prob, ratio, quadrant, clipped, eps_low, eps_high
-- figure: CE-GPPO Fig. 1 left (scatter with the 1 - eps_low and 1 + eps_high lines)
-- params: points=4000
-- A deterministic sample of at most $points token rows per run: the rows with the smallest hash of
-- their key (step, update, rank, seq, pos), a multiplicative hash modulo the prime 2^31 - 1 written in
-- plain integer arithmetic (every product < 2^62) so DuckDB and Spark pick the same rows.
WITH ranked AS (
    SELECT
        t.run,
        t.step,
        t.prob,
        t.ratio,
        t.quadrant,
        t.clipped,
        row_number() OVER (
            PARTITION BY t.run
            ORDER BY
                ((((((((CAST(t.step AS BIGINT) * 742938285 + t.update) % 2147483647) * 742938285 + t.rank)
                    % 2147483647) * 742938285 + t.seq) % 2147483647) * 742938285 + t.pos) % 2147483647)
                    * 742938285 % 2147483647,
                t.step, t.update, t.rank, t.seq, t.pos
        ) AS k
    FROM tokens AS t
    WHERE t.quadrant <> 'ZA'
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
