"""Distributed execution: the tensor-parallel rank, group size and collectives."""

from pagedlm.distributed.parallel_state import (
    destroy_tensor_model_parallel,
    divide,
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    init_tensor_model_parallel,
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
    tensor_model_parallel_state,
)

__all__ = [
    "destroy_tensor_model_parallel",
    "divide",
    "get_tensor_model_parallel_rank",
    "get_tensor_model_parallel_world_size",
    "init_tensor_model_parallel",
    "tensor_model_parallel_all_gather",
    "tensor_model_parallel_all_reduce",
    "tensor_model_parallel_state",
]
