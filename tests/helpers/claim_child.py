"""A process for the claim tests (tests/record/test_run_claim.py), started by multiprocessing: it waits on
a Barrier with the others, creates the run, and, if it gets it, records a few steps whose sequence texts
name it ("writer I"). What happened goes on the results queue: ("recorded", i, pid, nonce),
("refused", i, pid, message) or ("error", i, pid, repr)."""

import os


def record_steps(rec, i, steps, gen) -> None:
    """One update and the sequences of each step, the texts naming writer ``i``."""
    import torch
    from record_child import one_update

    for step in steps:
        one_update(rec, step, 0, 4, 8, 16, gen, seq_offset=4 * step)
        rec.record_sequences(
            step,
            seq_ids=torch.arange(4) + 4 * step,
            rewards=torch.zeros(4),
            advantages=torch.zeros(4),
            lengths=torch.full((4,), 8),
            texts=[f"writer {i}"] * 4,
        )


def start(root, run, i, barrier, results, env, steps=2) -> None:
    os.environ.update(env)  # the S3 tests: the moto server's endpoint and keys
    try:
        import torch

        from entropylens import Recorder
        from entropylens.record.run_dir.run_claim import RunExistsError

        barrier.wait(timeout=300)
        try:
            rec = Recorder(root, run=run, config={"method": "grpo", "seed": i})
        except RunExistsError as e:
            results.put(("refused", i, os.getpid(), str(e)))
            return
        with rec:
            record_steps(rec, i, range(steps), torch.Generator().manual_seed(i))
        results.put(("recorded", i, os.getpid(), rec._claim.nonce))
    except BaseException as e:  # noqa: BLE001 - reported to the test, which fails on it
        results.put(("error", i, os.getpid(), repr(e)))
