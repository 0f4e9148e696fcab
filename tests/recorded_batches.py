"""A recorded update from a small real batch (logits, tokens, mask, advantages, an older policy): the
Recorder's tests and the trackers' tests record with it."""

import torch

from entropylens.rl import stats
from entropylens.rl.losses import policy_loss

B, T, V = 6, 9, 25


def make_batch(seed=0, b=B, t=T):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, t, V, generator=g, dtype=torch.float64) * 2
    tokens = torch.randint(0, V, (b, t), generator=g)
    mask = torch.ones(b, t, dtype=torch.bool)
    mask[0, 5:] = False
    mask[3, 2:] = False
    adv = torch.tensor([1.0, -1.0, 0.5, 0.0, -2.0, 1.5][:b], dtype=torch.float64)
    old = x + 0.5 * torch.randn(b, t, V, generator=g, dtype=torch.float64)
    return x, tokens, mask, adv, old


def record_one(rec, step, update, seed=0, erc=None, method="grpo", watch=True):
    x, tokens, mask, adv, old = make_batch(seed)
    logits = x.clone().float().requires_grad_(True)
    with torch.no_grad():
        old_lp, old_h = stats.logprobs_and_entropy(old.float(), tokens)
    if watch:
        rec.watch_logits(logits)
    lp, h = stats.logprobs_and_entropy(logits, tokens)
    out = policy_loss(lp, old_lp, adv.float(), mask, method=method, entropy=h, old_entropy=old_h, erc=erc)
    rec.record_update(
        step,
        update,
        mask=mask,
        advantages=adv.float(),
        logprobs=lp,
        old_logprobs=old_lp,
        entropy=h,
        old_entropy=old_h,
        tokens=tokens,
        seq_ids=torch.arange(B) + B * update,
        loss=out,
    )
    out.loss.backward()
    rec.record_step(step, update=update, grad_norm=float(logits.grad.norm()), lr=0.01)
    return logits, tokens, mask, out
