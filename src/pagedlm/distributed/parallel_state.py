"""Tensor-parallel state of this process: its rank, the group size and the collectives.

Today every process runs the whole model (rank 0 of 1) and the collectives are identities,
so nothing needs ``torch.distributed``. A multi-process executor calls
``init_tensor_model_parallel`` once per worker, after ``torch.distributed.init_process_group``
and before building the model; the layers read the rank and size when they are constructed
and slice their weight shards accordingly.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class TensorParallelState:
    rank: int
    world_size: int
    group: Any = None
    """A ``torch.distributed`` process group, or None for the default group."""


_SINGLE_PROCESS = TensorParallelState(rank=0, world_size=1)
_state = _SINGLE_PROCESS


def init_tensor_model_parallel(rank: int, world_size: int, group: Any = None) -> None:
    """Record this process's place in the tensor-parallel group (once per worker)."""
    global _state
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(
            f"tensor parallel rank {rank} is outside a group of size {world_size}; "
            "pass 0 <= rank < world_size."
        )
    _state = TensorParallelState(rank=rank, world_size=world_size, group=group)


def destroy_tensor_model_parallel() -> None:
    """Return to the single-process state (rank 0 of 1)."""
    global _state
    _state = _SINGLE_PROCESS


@contextmanager
def tensor_model_parallel_state(rank: int, world_size: int, group: Any = None) -> Iterator[None]:
    """Temporarily act as ``rank`` of ``world_size`` (building a shard's layers in tests)."""
    global _state
    previous = _state
    init_tensor_model_parallel(rank, world_size, group)
    try:
        yield
    finally:
        _state = previous


def get_tensor_model_parallel_rank() -> int:
    return _state.rank


def get_tensor_model_parallel_world_size() -> int:
    return _state.world_size


def tensor_model_parallel_all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    """Sum ``tensor`` over the group (in place when distributed); identity for one process."""
    if _state.world_size == 1:
        return tensor
    torch.distributed.all_reduce(tensor, group=_state.group)
    return tensor


def tensor_model_parallel_all_gather(tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate every rank's ``tensor`` along ``dim``, in rank order."""
    if _state.world_size == 1:
        return tensor
    parts = [torch.empty_like(tensor) for _ in range(_state.world_size)]
    torch.distributed.all_gather(parts, tensor.contiguous(), group=_state.group)
    return torch.cat(parts, dim=dim)


def divide(numerator: int, denominator: int) -> int:
    """``numerator / denominator``, which must be exact (a shard size)."""
    if numerator % denominator != 0:
        raise ValueError(
            f"{numerator} is not divisible by the tensor parallel size {denominator}; "
            "choose a tensor parallel size that divides the model's head and hidden sizes."
        )
    return numerator // denominator
