-- title: One line per recorded response and step: reward, advantage, length, entropy, clipped and ERC-dropped tokens, entropy effect
-- columns: run, step, rank, seq, gen_step, group, reward, advantage, length, tokens, updates, mean_entropy, max_entropy, clipped, erc_dropped, entropy_effect, entropy_effect_dropped
-- figure: the token viewer's response list (report's responses pages, `entropylens show`)
-- params: none
-- A response is a sequence's token rows at one step (all its updates there); rank is the rank that recorded them.
-- gen_step: the step whose sequences row describes it (reward, length): the same step, or, where the run numbers
-- its sequences across the run (TRL, verl: a sequence id used once), the earlier step that generated it.
-- tokens: positions recorded (all of them unless the run samples token rows); updates: the step's updates that
-- trained on it. mean_entropy / max_entropy: the sampling policy's entropy H(pi_old) over its tokens, nats.
-- clipped / erc_dropped: token rows (summed over the updates) whose gradient PPO-clip / ERC removed; erc_dropped is
-- null (not applicable) where the run recorded no ERC (erc_kept null on every row).
-- entropy_effect / entropy_effect_dropped: sums of the tokens' columns over the updates (null without attribution).
WITH per_response AS (
    SELECT
        run,
        step,
        rank,
        seq,
        min("group") AS grp,
        avg(advantage) AS advantage,
        count(DISTINCT pos) AS tokens,
        count(DISTINCT "update") AS updates,
        avg(old_entropy) AS mean_entropy,
        max(old_entropy) AS max_entropy,
        sum(CASE WHEN clipped THEN 1 ELSE 0 END) AS clipped,
        CASE WHEN count(erc_kept) > 0 THEN sum(CASE WHEN erc_kept = false THEN 1 ELSE 0 END) END AS erc_dropped,
        sum(entropy_effect) AS entropy_effect,
        sum(entropy_effect_dropped) AS entropy_effect_dropped
    FROM tokens
    GROUP BY run, step, rank, seq
),
unique_seq AS (
    -- sequence ids a run uses once: numbered across the run
    SELECT
        run,
        seq,
        min(step) AS step,
        min(rank) AS rank
    FROM sequences
    GROUP BY run, seq
    HAVING count(*) = 1
)
SELECT
    p.run,
    p.step,
    p.rank,
    p.seq,
    coalesce(s.step, u.step) AS gen_step,
    coalesce(s."group", s2."group", p.grp) AS "group",
    coalesce(s.reward, s2.reward) AS reward,
    coalesce(s.advantage, s2.advantage, p.advantage) AS advantage,
    coalesce(s.length, s2.length, p.tokens) AS length,
    p.tokens,
    p.updates,
    p.mean_entropy,
    p.max_entropy,
    p.clipped,
    p.erc_dropped,
    p.entropy_effect,
    p.entropy_effect_dropped
FROM per_response AS p
LEFT JOIN sequences AS s
    ON s.run = p.run AND s.step = p.step AND s.rank = p.rank AND s.seq = p.seq
LEFT JOIN unique_seq AS u
    ON s.seq IS NULL AND u.run = p.run AND u.seq = p.seq AND u.step < p.step
LEFT JOIN sequences AS s2
    ON s2.run = u.run AND s2.step = u.step AND s2.rank = u.rank AND s2.seq = u.seq
ORDER BY p.run, p.step, p.rank, p.seq
