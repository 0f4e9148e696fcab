"""One process of a 4-process gloo job laid out as Megatron lays out pp=2 x dp=2 (tp = cp = 1): run by
verl_checks.test_megatron_pipeline_ranks_record_once_per_dp_rank through torch.distributed.run.

    python -m torch.distributed.run --standalone --nproc_per_node 4 tests/verl_env/megatron_ranks.py OUT

Megatron is not installed, so ``megatron.core.parallel_state`` (what verl's Megatron engine reads its
layout from, as ``mpu``) is stood in for by a module answering from real torch.distributed groups, in
Megatron's rank order (tensor fastest, then context, data, pipeline: global rank = pp_rank * dp + dp_rank
here). As in a Megatron pipeline schedule, only the last stage (global ranks 2 and 3) runs the loss
function, with its data-parallel group ({2, 3}: global rank 0 is not in it); every process records
through entropylens' own code (EntropyLensLoss, its Recorder) into OUT/megatron-pp2.
"""

from __future__ import annotations

import sys
import types
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from verl_checks import TEMP, _micro_batches, actor_config, model_output, rollout_batch, tiny_qwen2  # noqa: E402

import entropylens.integrations.verl as el_verl  # noqa: E402  (imports verl: before the stand-in exists)

PP, DP = 2, 2


def stand_in_parallel_state(pp_rank: int, dp_rank: int, dp_group) -> None:
    mpu = types.ModuleType("megatron.core.parallel_state")
    mpu.model_parallel_is_initialized = lambda: True
    mpu.get_pipeline_model_parallel_rank = lambda: pp_rank
    mpu.get_pipeline_model_parallel_world_size = lambda: PP
    mpu.get_tensor_model_parallel_rank = lambda: 0
    mpu.get_context_parallel_rank = lambda: 0
    mpu.get_data_parallel_rank = lambda: dp_rank
    mpu.get_data_parallel_world_size = lambda: DP
    mpu.get_data_parallel_group = lambda: dp_group
    core = types.ModuleType("megatron.core")
    core.parallel_state = mpu
    megatron = types.ModuleType("megatron")
    megatron.core = core
    sys.modules.update({"megatron": megatron, "megatron.core": core, "megatron.core.parallel_state": mpu})


def main(out: str) -> None:
    from verl.utils import tensordict_utils as tu

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    assert dist.get_world_size() == PP * DP
    pp_rank, dp_rank = divmod(rank, DP)
    groups = [dist.new_group([s * DP + d for d in range(DP)]) for s in range(PP)]  # every rank makes every group
    dp_group = groups[pp_rank]
    stand_in_parallel_state(pp_rank, dp_rank, dp_group)
    if pp_rank == PP - 1:  # the loss runs on the last pipeline stage only
        cfg = actor_config(loss_mode="ce_gppo", record_dir=out, run="megatron-pp2", loss_agg_mode="token-mean")
        loss_fn = el_verl.EntropyLensLoss(cfg)
        model = tiny_qwen2(seed=dp_rank)
        td, ref = rollout_batch(seed=10 + dp_rank)
        _, mbs = _micro_batches(td, dynamic=False, seed=dp_rank)
        n_local = torch.tensor(float(ref["mask"].sum()))
        dist.all_reduce(n_local, group=dp_group)
        for mb in mbs:
            tu.assign_non_tensor(
                mb, dp_size=DP, batch_num_tokens=int(n_local), global_batch_size=DP * len(td), temperature=TEMP
            )
            out_, _, _ = model_output(model, mb)
            loss, _ = loss_fn(out_, mb, dp_group=dp_group)
            loss.backward()
        el_verl.close_recorders()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
