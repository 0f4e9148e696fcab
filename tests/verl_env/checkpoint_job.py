"""A verl job that checkpoints, is killed, and is resumed: run by verl_checks.py in the verl venv.

  python checkpoint_job.py WORK PHASE [RUN]

PHASE ``first``: a fresh EntropyLensTrainer (``trainer.save_freq=2``) records steps 1-4, saves
checkpoint 2, waits (step 4's "rollout") until step 3 is on disk, and SIGKILLs itself in the middle
of step 4. PHASE ``resumed``: a new process, the same
command line (``trainer.resume_mode=auto``), resumes from checkpoint 2, records steps 3-5, saves
checkpoint 4 and ends as ``fit`` ends (the closing copy of the loss). RUN: ``policy_loss.run`` (omit:
the trainer names the run).

verl 0.9.1 cannot train on a CPU machine (verl_checks.test_why_verl_cannot_train_on_this_cpu_machine),
so its GPU parts are stood in for, and nothing else: the actor worker group (``set_loss_fn`` ships
the loss object to the "worker" as Ray does, pickled and unpickled; ``save_checkpoint`` /
``load_checkpoint`` note the path), the dataloader's state, and the rollout-server weight sync
(``on_init_end``). Everything else is verl's own code: the trainer's ``__init__``,
``_load_checkpoint`` (finds global_step_N through latest_checkpointed_iteration.txt),
``_save_checkpoint`` (writes that tracker file), and ours on top (``init``, ``_save_checkpoint``,
``_el_take_ids``, ``_el_step_done``, the loss function each micro-batch goes through, its Recorder).
"""

from __future__ import annotations

import json
import os
import pickle
import signal
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import verl  # noqa: E402
from hydra import compose, initialize_config_dir  # noqa: E402
from hydra.core.global_hydra import GlobalHydra  # noqa: E402
from verl.trainer.ppo.v1 import trainer_base, trainer_sync  # noqa: E402
from verl_checks import TEMP, _micro_batches, model_output, rollout_batch, tiny_qwen2  # noqa: E402

import entropylens.integrations.verl as el_verl  # noqa: E402

WORKER: dict = {}  # the one actor worker's state (this process stands in for it)


class WorkerGroup:
    """Stands in for verl's RayWorkerGroup (Dispatch.ONE_TO_ALL, blocking)."""

    def set_loss_fn(self, loss_fn):
        WORKER["loss_fn"] = pickle.loads(pickle.dumps(loss_fn))  # what Ray does with the argument

    def save_checkpoint(self, local_path, hdfs_path=None, global_step=0, max_ckpt_to_keep=None):
        os.makedirs(local_path, exist_ok=True)
        Path(local_path, "model.txt").write_text(str(global_step))

    def load_checkpoint(self, local_path, del_local_after_load=False):
        WORKER["loaded"] = local_path


class DataLoaderState:
    def __init__(self):
        self.i = 0

    def state_dict(self):
        return {"i": self.i}

    def load_state_dict(self, state):
        self.i = state["i"]


def _setup(self):  # verl's _setup builds Ray workers, servers and the dataloader; then it loads the checkpoint
    self.actor_rollout_wg = WorkerGroup()
    self.train_dataloader = DataLoaderState()
    self._load_checkpoint()


trainer_base.PPOTrainer._setup = _setup
trainer_sync.PPOTrainerSync.on_init_end = lambda self: None  # weight sync to the rollout servers


def trainer(work: Path, run: str | None):
    cfg_dir = str(Path(verl.__file__).parent / "trainer" / "config")
    overrides = [
        "actor_rollout_ref.actor.policy_loss._target_=entropylens.integrations.verl.EntropyLensLossConfig",
        "actor_rollout_ref.actor.policy_loss.loss_mode=ce_gppo",
        f"+actor_rollout_ref.actor.policy_loss.record_dir={work / 'runs'}",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.actor.loss_agg_mode=token-mean",
        "algorithm.adv_estimator=grpo",
        "trainer.use_v1=true",
        "trainer.v1.trainer_mode=entropylens",
        "trainer.save_freq=2",
        f"trainer.default_local_dir={work / 'checkpoints'}",
        "trainer.resume_mode=auto",
    ]
    if run:
        overrides.append(f"+actor_rollout_ref.actor.policy_loss.run={run}")
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=cfg_dir, version_base=None):
        cfg = compose(config_name="ppo_trainer", overrides=overrides)
    t = el_verl.EntropyLensTrainer(cfg)
    t.init()
    return t


def record_step(t, model, step: int, *, kill_midway: bool = False) -> None:
    """One actor update of 6 samples in shuffled micro-batches (verl's own helpers), through the
    worker's loss function, as _update_actor feeds it (sample ids and the step from the trainer)."""
    from verl.utils import tensordict_utils as tu

    t.global_steps = step
    td, ref = rollout_batch(seed=step)
    ids, steps = t._el_take_ids(len(td))
    td["entropylens_sample_id"], td["entropylens_step"] = ids, steps
    n_total = int(ref["mask"].sum())
    _, mbs = _micro_batches(td, dynamic=False, seed=step)
    for k, mb in enumerate(mbs):
        tu.assign_non_tensor(mb, dp_size=1, batch_num_tokens=n_total, global_batch_size=len(td), temperature=TEMP)
        out, _, _ = model_output(model, mb)
        loss, _ = WORKER["loss_fn"](out, mb, dp_group=None)
        loss.backward()
        if kill_midway and k == 0:
            sys.stdout.flush()
            os.kill(os.getpid(), signal.SIGKILL)
    print(json.dumps({"step": step, "tokens": n_total, "ids": ids.tolist()}), flush=True)


def steps_on_disk(work: Path) -> list[int]:
    return sorted(
        int(p.parent.parent.name.split("=")[1]) for p in (work / "runs").glob("*/steps/step=*/rank=0/steps.parquet")
    )


def wait_on_disk(work: Path, step: int, timeout: float = 20.0) -> list[int]:
    """The steps on disk once ``step`` is among them (or the timeout passed)."""
    deadline = time.monotonic() + timeout
    while step not in steps_on_disk(work) and time.monotonic() < deadline:
        time.sleep(0.05)
    return steps_on_disk(work)


def main() -> None:
    work, phase = Path(sys.argv[1]), sys.argv[2]
    run = sys.argv[3] if len(sys.argv) > 3 else None
    t = trainer(work, run)
    print(
        json.dumps(
            {
                "run": t._el_loss.run,
                "resume": t._el_loss.resume,
                "global_steps": t.global_steps,
                "next_id": t._el_next_id,
            }
        ),
        flush=True,
    )
    model = tiny_qwen2()
    steps = range(1, 5) if phase == "first" else range(t.global_steps + 1, 6)
    status = "failed"
    try:
        for step in steps:
            if phase == "first" and step == 4:  # step 4's rollout: step 3 reaches the disk meanwhile, no call needed
                print(json.dumps({"before_step": 4, "steps_on_disk": wait_on_disk(work, 3)}), flush=True)
            record_step(t, model, step, kill_midway=phase == "first" and step == 4)
            t._el_step_done()  # as _update_actor ends
            if step % 2 == 0:
                t._save_checkpoint()  # ours, then verl's
                print(json.dumps({"checkpoint": step, "steps_on_disk": steps_on_disk(work)}), flush=True)
        status = "finished"
    finally:  # as EntropyLensTrainer.fit ends
        t.actor_rollout_wg.set_loss_fn(t._el_loss.shipped(closing=True, status=status))


if __name__ == "__main__":
    main()
