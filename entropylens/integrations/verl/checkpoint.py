"""Checkpoints and resumes: the record (``entropylens.json``) the trainer leaves in verl's
``global_step_N`` folder, and which run a restarted job records into (:func:`resume_plan`).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

CHECKPOINT_RECORD = "entropylens.json"  # in verl's global_step_N folder: the run that checkpoint belongs to


def write_checkpoint_record(folder, *, record_dir: str, run: str, step: int, next_sample_id: int) -> str:
    """Write ``<folder>/entropylens.json`` (atomically: a temporary file renamed into place): the
    entropylens run a verl checkpoint belongs to, its last step (the checkpoint's global step) and the
    next sample id (sample ids stay run-unique after a resume). Returns the file's path."""
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, CHECKPOINT_RECORD)
    tmp = os.path.join(folder, f".{CHECKPOINT_RECORD}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        json.dump(
            {"record_dir": str(record_dir), "run": run, "step": int(step), "next_sample_id": int(next_sample_id)}, f
        )
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def read_checkpoint_record(folder) -> dict | None:
    """The record :func:`write_checkpoint_record` left in a checkpoint folder; None where there is none
    (a checkpoint saved without recording, or by another trainer)."""
    path = os.path.join(folder, CHECKPOINT_RECORD)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        rec = json.load(f)
    if not isinstance(rec, dict) or not {"run", "step", "next_sample_id"} <= set(rec):
        raise ValueError(f"{path} is not an entropylens checkpoint record (needs run, step, next_sample_id)")
    return rec


def resumed_checkpoint_folder(trainer_config, global_steps: int) -> str | None:
    """The global_step_N folder verl's ``_load_checkpoint`` resumed from (None when it started from
    scratch: global_steps 0), found as verl finds it (trainer.resume_mode auto: default_local_dir;
    resume_path: resume_from_path)."""
    if not global_steps:
        return None
    tr = trainer_config
    if tr.resume_mode == "resume_path":
        folder = str(tr.resume_from_path)
    else:
        folder = os.path.join(str(tr.default_local_dir), f"global_step_{int(global_steps)}")
    return os.path.abspath(folder)


@dataclass
class ResumePlan:
    """What a (re)started verl job records into: ``run``, ``resume`` (the step it continues after, or
    None for a new run) and the first sample id; ``note`` says why, for the log."""

    run: str
    resume: int | None
    next_sample_id: int
    note: str


def resume_plan(folder: str | None, global_steps: int, run_given: str | None, new_run: str) -> ResumePlan:
    """Where a verl job that loaded checkpoint ``folder`` (global step ``global_steps``; None / 0: from
    scratch) records. The checkpoint's record names the run it belongs to: that run continues after the
    checkpoint's step (the crashed job's later steps are recorded again), unless ``policy_loss.run``
    (``run_given``) names another run, which then starts new. A checkpoint without a record (saved
    without recording) starts ``run_given`` or ``new_run``."""
    if folder is None or not global_steps:
        return ResumePlan(run_given or new_run, None, 0, "from scratch")
    rec = read_checkpoint_record(folder)
    if rec is None:
        run = run_given or new_run
        return ResumePlan(
            run,
            None,
            0,
            f"checkpoint {folder} carries no entropylens record (saved without "
            f"recording): run {run!r} starts new at step {int(global_steps) + 1}",
        )
    if int(rec["step"]) != int(global_steps):
        raise ValueError(
            f"{os.path.join(folder, CHECKPOINT_RECORD)} says step {rec['step']}, verl resumed from "
            f"global step {global_steps}: the record does not belong to this checkpoint"
        )
    if run_given and run_given != rec["run"]:
        return ResumePlan(
            run_given,
            None,
            int(rec["next_sample_id"]),
            f"checkpoint {folder} belongs to run {rec['run']!r}; policy_loss.run={run_given!r} "
            f"starts that run new at step {int(global_steps) + 1}",
        )
    return ResumePlan(
        rec["run"],
        int(global_steps),
        int(rec["next_sample_id"]),
        f"run {rec['run']!r} continues after step {int(global_steps)} (checkpoint {folder})",
    )
