"""Cost of the parameter-space entropy probe: one probed update against one plain update of the toy
policy (same batch, same process, alternating). Prints the time ratio and the backward passes.

  python benchmarks/probe.py [--repeats 7]

A plain update is one forward + one backward + clip + Adam step. The probed update adds one backward
for grad(mean entropy), one per non-empty gradient part (each quadrant's kept gradient, and its
dropped part where clipping changed some tokens), and one no-grad forward after the step.
Last line: probe_ratio=<median probed / plain time> backward_passes=<in a probed update>
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from entropylens.demo.toy import task
from entropylens.demo.toy.model import build_model, response_logits
from entropylens.rl import stats
from entropylens.rl.losses import policy_loss
from entropylens.rl.probe import ProbeForward, probe_update


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=7)
    a = ap.parse_args()
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    model = build_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-5)  # tiny steps: the policy barely moves between repeats
    p_len = task.PROMPT_LEN + 2
    prompts = task.make_prompts(32, g)
    resp = torch.randint(0, task.N_SYMBOLS, (32, task.RESPONSE_LEN), generator=g)
    seqs = torch.cat([prompts, resp], 1)
    with torch.no_grad():
        old = response_logits(model, seqs, p_len) + torch.randn(32, task.RESPONSE_LEN, task.VOCAB, generator=g)
        old_lp, old_h = stats.logprobs_and_entropy(old, resp)
    adv = torch.randn(32, generator=g)
    mask = torch.ones(32, task.RESPONSE_LEN, dtype=torch.bool)

    def loss_fn(m, _):
        lp, h = stats.logprobs_and_entropy(response_logits(m, seqs, p_len), resp, entropy_grad=True)
        out = policy_loss(lp, old_lp, adv, mask, method="grpo", entropy=h, old_entropy=old_h)
        return ProbeForward(out.loss, lp, h, mask, out.columns)

    def plain():
        opt.zero_grad(set_to_none=True)
        loss_fn(model, None).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    rows = []

    def probed():
        rows[:] = probe_update(model, opt, loss_fn, None, max_grad_norm=1.0)

    plain(), probed()  # warm-up
    tp, tq = [], []
    for _ in range(a.repeats):
        t0 = time.perf_counter()
        plain()
        tp.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        probed()
        tq.append(time.perf_counter() - t0)
    parts = [r["part"] for r in rows if r["part"] not in ("momentum", "other", "step")]
    backward = 1 + len(parts) + 1  # grad(H), one per part, the real backward
    mp, mq = statistics.median(tp), statistics.median(tq)
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}; toy policy, batch 32 x {task.RESPONSE_LEN}")
    print(f"plain update {mp * 1e3:.1f} ms, probed update {mq * 1e3:.1f} ms (parts: {', '.join(parts)})")
    print(f"probe_ratio={mq / mp:.2f} backward_passes={backward}")


if __name__ == "__main__":
    main()
