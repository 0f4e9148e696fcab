"""A hand-written GRPO loop in plain PyTorch, recorded by entropylens (CPU, offline; about 13 s of CPU for 20 steps).

    python examples/torch_loop.py --out runs [--steps 20] [--method ce_gppo] [--run ID]   # or --out s3://bucket/runs
Task: answer 8 tokens; reward = share of answer tokens in {0, 2, 4, 6} (chance 1/6).
"""

import argparse
import secrets
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from entropylens import Recorder
from entropylens.integrations.torch import old_policy_pass, policy_update
from entropylens.rl.losses import METHODS

V, P, T, G = 24, 4, 8, 8  # vocab, prompt length, answer length, samples per prompt


def _positive(text: str) -> int:
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {n}")
    return n


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--out",
        default="entropylens-runs",
        help="runs directory, or an object-store URL such as s3://bucket/runs (needs the s3 extra)",
    )
    ap.add_argument("--steps", type=_positive, default=20, help="training steps (default 20)")
    ap.add_argument(
        "--method",
        default="ce_gppo",
        choices=METHODS,
        metavar="METHOD",
        help="policy loss: grpo, dapo, gppo, ce_gppo, cispo or gspo (default ce_gppo)",
    )
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads (default 1: a model this small is fastest on one, and more "
        "spin against other jobs on a busy machine)",
    )
    ap.add_argument("--run", default=None, help="run id (default: torch-loop-<method>-<time>-<random>, new each time)")
    ap.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an earlier run of the same --run id under --out (refused otherwise)",
    )
    a = ap.parse_args(argv)
    threads = torch.get_num_threads()
    torch.set_num_threads(a.threads)
    try:
        return train(a)
    finally:
        torch.set_num_threads(threads)  # the caller's setting, as it was


def train(a):
    """The loop itself (``a``: the parsed options)."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=V,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=32,
        )
    )
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(0)
    run = a.run or f"torch-loop-{a.method}-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"
    with Recorder(a.out, run=run, config={"method": a.method, "lr": 3e-3}, overwrite=a.overwrite) as rec:
        for step in range(a.steps):
            prompts = torch.randint(0, V, (8, P), generator=gen).repeat_interleave(G, dim=0)  # [64, P]
            with torch.no_grad():  # rollout at temperature 1
                seqs = prompts
                for _ in range(T):
                    probs = torch.softmax(model(seqs).logits[:, -1], dim=-1)
                    seqs = torch.cat([seqs, torch.multinomial(probs, 1, generator=gen)], dim=1)
            answer = seqs[:, P:]  # [64, T]
            reward = ((answer < 8) & (answer % 2 == 0)).float().mean(dim=1)  # [64]
            r = reward.view(-1, G)
            adv = ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-6)).reshape(-1)
            mask = torch.ones_like(answer, dtype=torch.bool)
            with torch.no_grad():
                old_lp, old_h = old_policy_pass(model(seqs).logits[:, P - 1 : -1], answer)
            for u, idx in enumerate(torch.randperm(len(seqs), generator=gen).chunk(4)):
                logits = model(seqs[idx]).logits[:, P - 1 : -1]  # [16, T, V]
                out = policy_update(
                    rec,
                    step,
                    u,
                    logits,
                    answer[idx],
                    mask[idx],
                    adv[idx],
                    old_lp[idx],
                    old_entropy=old_h[idx],
                    seq_ids=idx,
                    group_ids=idx // G,
                    method=a.method,
                )
                opt.zero_grad()
                out.loss.backward()
                gn = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                rec.record_step(step, update=u, grad_norm=gn, lr=3e-3)
            rec.record_sequences(
                step,
                seq_ids=torch.arange(len(seqs)),
                rewards=reward,
                advantages=adv,
                lengths=mask.sum(1),
                group_ids=torch.arange(len(seqs)) // G,
            )
            rec.end_step(step)  # the step is written now, not when the next one begins
            print(f"step {step:3d}  reward {reward.mean():.3f}  entropy {old_h.mean():.3f}")
    print(f"run: {rec.dir}")
    return rec.dir


if __name__ == "__main__":
    from entropylens.record.recorder import RecorderError
    from entropylens.record.run_dir.run_claim import RunExistsError

    try:
        main()
    except (RunExistsError, RecorderError) as e:  # a run of that id, an --out that is a file: one line
        raise SystemExit(f"error: {e}") from None
