"""A recording process for the reliability tests (killed with SIGKILL, or one rank of two).

python record_child.py kill ROOT RUN        record steps until killed; prints 'ready' once
python record_child.py commit ROOT RUN      record steps, commit() after each, print 'committed S'; until killed
python record_child.py endstep ROOT RUN     record steps 0-1, end_step() after each ('ended S'), then
                                            sleep (the next step's rollout) until killed
python record_child.py dist ROOT STEPS      one torch.distributed (gloo) rank; env RANK etc.
python record_child.py distcommit ROOT RUN  one gloo rank of run RUN: steps committed one by one ('committed S')
                                            until killed
python record_child.py distresume ROOT RUN K STEPS   one gloo rank resuming RUN after step K, recording
                                            steps K+1..STEPS-1 (prints 'step=S tokens=N' per step)
"""

import sys

import torch

from entropylens import Recorder
from entropylens.rl.losses import policy_loss
from entropylens.rl.stats import logprobs_and_entropy


def one_update(rec, step, update, b, t, v, gen, seq_offset=0):
    logits = torch.randn(b, t, v, generator=gen, requires_grad=True)
    tokens = torch.randint(0, v, (b, t), generator=gen)
    mask = torch.rand(b, t, generator=gen) < 0.8
    adv = torch.randn(b, generator=gen)
    with torch.no_grad():
        old_lp, old_h = logprobs_and_entropy(logits + 0.1 * torch.randn(b, t, v, generator=gen), tokens)
    rec.watch_logits(logits)
    lp, h = logprobs_and_entropy(logits, tokens)
    out = policy_loss(lp, old_lp, adv, mask, entropy=h, old_entropy=old_h)
    rec.record_update(
        step,
        update,
        mask=mask,
        advantages=adv,
        logprobs=lp,
        old_logprobs=old_lp,
        entropy=h,
        old_entropy=old_h,
        tokens=tokens,
        seq_ids=torch.arange(b) + seq_offset,
        loss=out,
    )
    out.loss.backward()
    rec.record_step(step, update=update, grad_norm=float(logits.grad.norm()), lr=1e-3)
    return int(mask.sum())


def kill_mode(root, run):
    gen = torch.Generator().manual_seed(hash(run) % 1000)
    rec = Recorder(root, run=run, config={"method": "grpo"}, queue_size=4)
    step = 0
    while True:
        for u in range(3):
            one_update(rec, step, u, 8, 64, 50, gen)
        rec.record_sequences(
            step,
            seq_ids=torch.arange(8),
            rewards=torch.rand(8, generator=gen),
            advantages=torch.randn(8, generator=gen),
            lengths=torch.full((8,), 64),
        )
        if step == 2:
            rec.step_summary(step)  # waits until the writer thread has taken in everything before: steps 0, 1 written
            print("ready", flush=True)
        step += 1


def commit_mode(root, run):
    gen = torch.Generator().manual_seed(hash(run) % 1000)
    rec = Recorder(root, run=run, config={"method": "grpo"})
    step = 0
    while True:
        for u in range(2):
            one_update(rec, step, u, 8, 64, 50, gen, seq_offset=8 * u)
        rec.record_sequences(
            step,
            seq_ids=torch.arange(16),
            rewards=torch.rand(16, generator=gen),
            advantages=torch.randn(16, generator=gen),
            lengths=torch.full((16,), 64),
        )
        assert rec.commit() == step
        print(f"committed {step}", flush=True)  # a checkpoint would be saved here
        step += 1


def end_step_mode(root, run):
    import time

    gen = torch.Generator().manual_seed(7)
    rec = Recorder(root, run=run, config={"method": "grpo"})
    for step in range(2):
        for u in range(2):
            one_update(rec, step, u, 8, 64, 50, gen, seq_offset=8 * u)
        rec.record_sequences(
            step,
            seq_ids=torch.arange(16),
            rewards=torch.rand(16, generator=gen),
            advantages=torch.randn(16, generator=gen),
            lengths=torch.full((16,), 64),
        )
        assert rec.end_step() == step
        print(f"ended {step}", flush=True)
    time.sleep(600)  # the next step's rollout: no recorder call


def dist_mode(root, steps):
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(rank)
    total = 0
    with Recorder(root, config={"method": "grpo"}) as rec:
        for step in range(steps):
            total += one_update(rec, step, 0, 4 + rank, 16, 30, gen, seq_offset=100 * rank)
    dist.barrier()
    print(f"rank={rank} run={rec.run} tokens={total}", flush=True)
    dist.destroy_process_group()


def dist_commit_mode(root, run):
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(10 + rank)
    rec = Recorder(root, run=run, config={"method": "grpo"})
    step = 0
    while True:
        one_update(rec, step, 0, 4 + rank, 16, 30, gen, seq_offset=100 * rank)
        assert rec.commit() == step
        dist.barrier()  # the checkpoint: every rank committed the step
        print(f"committed {step}", flush=True)
        step += 1


def dist_resume_mode(root, run, resume, steps):
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(20 + rank)
    with Recorder(root, run=run, resume=resume) as rec:
        for step in range(resume + 1, steps):
            print(
                f"step={step} tokens={one_update(rec, step, 0, 4 + rank, 16, 30, gen, seq_offset=100 * rank)}",
                flush=True,
            )
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    torch.set_num_threads(1)
    mode = sys.argv[1]
    if mode == "kill":
        kill_mode(sys.argv[2], sys.argv[3])
    elif mode == "commit":
        commit_mode(sys.argv[2], sys.argv[3])
    elif mode == "endstep":
        end_step_mode(sys.argv[2], sys.argv[3])
    elif mode == "distcommit":
        dist_commit_mode(sys.argv[2], sys.argv[3])
    elif mode == "distresume":
        dist_resume_mode(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
    else:
        dist_mode(sys.argv[2], int(sys.argv[3]))
