"""Which processes record, and as which rank: one recorder per data-parallel rank (FSDP with Ulysses
peers, Megatron's pipeline / tensor / context layout, verl's dynamic context parallelism).
"""

from __future__ import annotations

import sys

import torch


def recording_rank(
    pp_rank: int, pp_size: int, tp_rank: int, cp_rank: int, dp_rank: int, *, dynamic_cp: bool = False
) -> int | None:
    """The recorder rank of a Megatron process (its data-parallel rank), or None when it does not record.

    The loss runs on the last pipeline stage only, and every tensor / context-parallel peer of a
    data-parallel rank holds the same micro-batch: one process per data-parallel rank records, the one
    at the last pipeline stage with tensor rank 0 and context rank 0 (verl's
    MegatronEngine.is_mp_src_rank_with_outputs; its data-parallel groups exclude global rank 0 when
    pp_size > 1). With verl's dynamic context parallelism every data-parallel rank holds the whole
    batch (verl makes dp 1): only data-parallel rank 0 records."""
    if not (0 <= pp_rank < pp_size) or min(tp_rank, cp_rank, dp_rank) < 0:
        raise ValueError(
            f"not a parallel layout: pp_rank={pp_rank}, pp_size={pp_size}, tp_rank={tp_rank}, "
            f"cp_rank={cp_rank}, dp_rank={dp_rank}"
        )
    if pp_rank != pp_size - 1 or tp_rank != 0 or cp_rank != 0:
        return None
    if dynamic_cp:
        return 0 if dp_rank == 0 else None
    return dp_rank


def megatron_layout() -> tuple[int, int, int, int, int, int] | None:
    """(pp_rank, pp_size, tp_rank, cp_rank, dp_rank, dp_size) of this process from Megatron's
    parallel state (megatron.core.parallel_state, which verl's Megatron engine imports as mpu), or None
    where Megatron's model-parallel state is not set up here (FSDP: megatron is not even imported)."""
    mpu = sys.modules.get("megatron.core.parallel_state")
    if mpu is None or not mpu.model_parallel_is_initialized():
        return None
    return (
        mpu.get_pipeline_model_parallel_rank(),
        mpu.get_pipeline_model_parallel_world_size(),
        mpu.get_tensor_model_parallel_rank(),
        mpu.get_context_parallel_rank(),
        mpu.get_data_parallel_rank(),
        mpu.get_data_parallel_world_size(),
    )


def dp_rank(dp_group, *, dynamic_cp: bool = False) -> tuple[int, int, bool]:
    """(rank in the data-parallel group, its size, whether this process records).

    Megatron (:func:`megatron_layout`): :func:`recording_rank` of its layout. Otherwise (FSDP) the
    Ulysses sequence-parallel peers of a data-parallel rank hold the same micro-batch and verl's
    data-parallel groups are the processes of one sequence-parallel rank: the group that contains
    global rank 0 (sequence-parallel rank 0) records, so each data-parallel rank writes once."""
    dist = torch.distributed
    layout = megatron_layout()
    if layout is not None:
        pp_rank, pp_size, tp_rank, cp_rank, rank, size = layout
        got = recording_rank(pp_rank, pp_size, tp_rank, cp_rank, rank, dynamic_cp=dynamic_cp)
        return (0, 1, got is not None) if dynamic_cp else (rank, size, got is not None)
    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1, True
    if dp_group is None:
        return dist.get_rank(), dist.get_world_size(), True
    ranks = dist.get_process_group_ranks(dp_group)
    return dist.get_rank(dp_group), len(ranks), 0 in ranks
