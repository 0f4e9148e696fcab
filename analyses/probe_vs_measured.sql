-- title: Parameter-space probe: predicted entropy change per gradient part against the measured change
-- columns: run, method, step, update, part, tokens, grad_norm, predicted_dh, measured_dh, entropy_before, optimizer
-- figure: CE-GPPO Sec. 3 (the entropy effect of each quadrant, measured through shared parameters)
-- params: none
-- One row per probed update and gradient part: a quadrant's kept gradient, its dropped part (what
-- clipping / ERC took away, had it been applied), the optimizer's momentum, the rest ('other'), and
-- 'step', the real optimizer step: predicted_dh = grad(mean entropy) . step direction of the part;
-- measured_dh (step row) = mean entropy on the same positions after the real step minus before.
SELECT
    p.run,
    r.method,
    p.step,
    p.update,
    p.part,
    p.tokens,
    p.grad_norm,
    p.predicted_dh,
    p.measured_dh,
    p.entropy_before,
    p.optimizer
FROM probes AS p
JOIN runs AS r ON p.run = r.run
ORDER BY p.run, p.step, p.update, p.part
