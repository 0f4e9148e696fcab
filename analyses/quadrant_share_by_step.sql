-- title: Share of tokens per quadrant per step
-- columns: run, method, step, quadrant, tokens, share
-- figure: CE-GPPO Fig. 1 (the four quadrants; share of each over training)
-- params: none
-- Exact counts from steps (all tokens); ZA = zero-advantage tokens. share = tokens / all tokens of the step.
WITH counts AS (
    SELECT
        run,
        step,
        sum(n_pa_hp) AS n_pa_hp,
        sum(n_pa_lp) AS n_pa_lp,
        sum(n_na_hp) AS n_na_hp,
        sum(n_na_lp) AS n_na_lp,
        sum(n_za) AS n_za,
        sum(n_tokens) AS total
    FROM steps
    WHERE n_tokens IS NOT NULL
    GROUP BY run, step
),
quadrants AS (
    SELECT 'PA&HP' AS quadrant UNION ALL SELECT 'PA&LP' UNION ALL SELECT 'NA&HP'
    UNION ALL SELECT 'NA&LP' UNION ALL SELECT 'ZA'
),
long AS (
    SELECT
        c.run,
        c.step,
        q.quadrant,
        CASE q.quadrant
            WHEN 'PA&HP' THEN c.n_pa_hp WHEN 'PA&LP' THEN c.n_pa_lp WHEN 'NA&HP' THEN c.n_na_hp
            WHEN 'NA&LP' THEN c.n_na_lp ELSE c.n_za
        END AS tokens,
        c.total
    FROM counts AS c
    CROSS JOIN quadrants AS q
)
SELECT
    l.run,
    r.method,
    l.step,
    l.quadrant,
    l.tokens,
    l.tokens / nullif(l.total, 0) AS share
FROM long AS l
JOIN runs AS r USING (run)
WHERE l.tokens IS NOT NULL
ORDER BY l.run, l.step, l.quadrant
