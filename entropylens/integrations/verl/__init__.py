"""verl (0.9.x) plug-in: CE-GPPO / GPPO policy losses, ERC and per-token recording, without a fork.

verl imports this package on ``import verl`` (entry point group ``verl.plugins``, pyproject.toml), and
the import does what verl's plug-in mechanism needs: it checks verl's version, registers the policy
losses and the trainer mode ``entropylens``, and hands on the public names. docs/verl.md is the
reference (the three layers, aggregation, metrics, sequences, ranks, checkpoints); one job a module:

    version.py     the verl releases tested, the check that refuses others
    names.py       loss-mode names, batch keys, run ids; the check that the losses are registered
    config.py      EntropyLensLossConfig; eps and aggregation from verl's actor config
    registered.py  layer 1: the registered policy losses (compute_loss), verl's clip metrics; registration
    trainer_mode.py  the registration of trainer_mode=entropylens (imports trainer.py once verl's registry imports)
    metrics.py     which step metrics add up, their shares, the step values the trainer logs
    ranks.py       which processes record, as which rank (FSDP, Megatron)
    batch.py       a micro-batch as [B, T] response tensors
    recorders.py   this process's recorders (end step / commit / close) and the sequences rows
    loss_fn.py     layer 2: EntropyLensLoss, the actor loss function
    checkpoint.py  the checkpoint record and which run a resumed job continues
    trainer.py     layer 3: EntropyLensTrainer (imported on first use: it imports verl's v1 trainer)
"""

from __future__ import annotations

from .version import VERL_TESTED, check_verl_version

check_verl_version()

from ...rl.stats import logit_grad_norm_from_sum_p2  # noqa: E402
from .checkpoint import ResumePlan, read_checkpoint_record, resume_plan, write_checkpoint_record  # noqa: E402
from .config import EntropyLensLossConfig, agg_and_scale, eps_from  # noqa: E402
from .loss_fn import EntropyLensLoss  # noqa: E402
from .metrics import metric_rule, metric_shares, step_values  # noqa: E402
from .names import check_registered, method_of, registered_names  # noqa: E402
from .ranks import dp_rank, megatron_layout, recording_rank  # noqa: E402
from .recorders import close_recorders, commit_recorders, end_step_recorders  # noqa: E402
from .registered import compute_loss, register, verl_clip_metrics, verl_metric_keys  # noqa: E402
from .trainer_mode import register_trainer  # noqa: E402

register()
register_trainer()


def __getattr__(name):  # EntropyLensTrainer imports verl's v1 trainer (TransferQueue): on first use
    if name == "EntropyLensTrainer":
        from .trainer import EntropyLensTrainer

        return EntropyLensTrainer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "EntropyLensLossConfig",
    "EntropyLensLoss",
    "check_verl_version",
    "check_registered",
    "register",
    "register_trainer",
    "compute_loss",
    "agg_and_scale",
    "logit_grad_norm_from_sum_p2",
    "VERL_TESTED",
    "recording_rank",
    "megatron_layout",
    "dp_rank",
    "metric_rule",
    "metric_shares",
    "step_values",
    "verl_clip_metrics",
    "verl_metric_keys",
    "eps_from",
    "method_of",
    "registered_names",
    "close_recorders",
    "commit_recorders",
    "end_step_recorders",
    "ResumePlan",
    "resume_plan",
    "read_checkpoint_record",
    "write_checkpoint_record",
]
