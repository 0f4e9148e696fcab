-- title: Reward per step
-- columns: run, method, step, reward, reward_std, sequences
-- figure: CE-GPPO Fig. 2 (accuracy vs step; here the training reward)
-- params: none
SELECT
    q.run,
    r.method,
    q.step,
    avg(q.reward) AS reward,
    stddev_samp(q.reward) AS reward_std,
    count(*) AS sequences
FROM sequences AS q
JOIN runs AS r USING (run)
GROUP BY q.run, r.method, q.step
ORDER BY q.run, q.step
