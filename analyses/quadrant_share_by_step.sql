-- title: Share of tokens per quadrant per step
-- columns: run, method, step, quadrant, tokens, share
-- figure: CE-GPPO Fig. 1 (the four quadrants; share of each over training)
-- params: none
-- Exact counts from steps (all tokens); ZA = zero-advantage tokens. share = tokens / all tokens of the step.
WITH counts AS (
    SELECT
        run,
        step,
        sum(n_pa_hp) AS "PA&HP",
        sum(n_pa_lp) AS "PA&LP",
        sum(n_na_hp) AS "NA&HP",
        sum(n_na_lp) AS "NA&LP",
        sum(n_za) AS "ZA",
        sum(n_tokens) AS total
    FROM steps
    WHERE n_tokens IS NOT NULL
    GROUP BY run, step
),
long AS (
    UNPIVOT counts ON "PA&HP", "PA&LP", "NA&HP", "NA&LP", "ZA" INTO NAME quadrant VALUE tokens
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
ORDER BY l.run, l.step, l.quadrant
