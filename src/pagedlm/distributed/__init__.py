"""Distributed execution: ranks, groups and collectives of tensor and pipeline parallelism."""

from pagedlm.distributed.parallel_state import (
    destroy_model_parallel,
    destroy_tensor_model_parallel,
    divide,
    expert_parallel_enabled,
    gather_from_every_rank,
    get_pipeline_state,
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    init_pipeline_model_parallel,
    init_tensor_model_parallel,
    init_worker_distributed,
    pipeline_model_parallel_state,
    set_expert_parallel,
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
    tensor_model_parallel_state,
)

__all__ = [
    "destroy_model_parallel",
    "destroy_tensor_model_parallel",
    "divide",
    "expert_parallel_enabled",
    "gather_from_every_rank",
    "get_pipeline_state",
    "get_tensor_model_parallel_rank",
    "get_tensor_model_parallel_world_size",
    "init_pipeline_model_parallel",
    "init_tensor_model_parallel",
    "init_worker_distributed",
    "pipeline_model_parallel_state",
    "set_expert_parallel",
    "tensor_model_parallel_all_gather",
    "tensor_model_parallel_all_reduce",
    "tensor_model_parallel_state",
]
