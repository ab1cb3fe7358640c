"""This process's place in the tensor- and pipeline-parallel groups, the TP collectives, and
the host-side facts every rank of the engine must agree on (``gather_from_every_rank``).

A single-process engine is rank 0 of 1 in both groups, and the collectives are identities,
so nothing needs ``torch.distributed``. A worker of a multi-process executor calls
``init_worker_distributed`` once, before building the model; the layers read the ranks and
sizes when they are constructed and slice their weight shards accordingly.

Rank layout (vLLM's): global rank ``r`` is tensor-parallel rank ``r % tp`` of pipeline
stage ``r // tp``. Each stage's ``tp`` ranks form a TP group; the ranks with the same TP
rank across stages form a PP group.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch


@dataclass(frozen=True)
class GroupState:
    """This process's rank in one group, the group's size and members."""

    rank: int
    world_size: int
    group: Any = None
    """A ``torch.distributed`` process group, or None for the default group."""
    ranks: tuple[int, ...] = (0,)
    """Global ranks of the members, in group-rank order."""

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.world_size - 1


TensorParallelState = GroupState  # the name earlier releases exported
_SINGLE_PROCESS = GroupState(rank=0, world_size=1)
_tp = _SINGLE_PROCESS
_pp = _SINGLE_PROCESS
_expert_parallel = False


def _check_rank(kind: str, rank: int, world_size: int) -> None:
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(
            f"{kind} parallel rank {rank} is outside a group of size {world_size}; "
            "pass 0 <= rank < world_size."
        )


def init_tensor_model_parallel(
    rank: int, world_size: int, group: Any = None, ranks: tuple[int, ...] | None = None
) -> None:
    """Record this process's place in the tensor-parallel group (once per worker)."""
    global _tp
    _check_rank("tensor", rank, world_size)
    _tp = GroupState(rank, world_size, group, ranks or tuple(range(world_size)))


def init_pipeline_model_parallel(
    rank: int, world_size: int, group: Any = None, ranks: tuple[int, ...] | None = None
) -> None:
    """Record this process's pipeline stage (once per worker)."""
    global _pp
    _check_rank("pipeline", rank, world_size)
    _pp = GroupState(rank, world_size, group, ranks or tuple(range(world_size)))


def set_expert_parallel(enabled: bool) -> None:
    """Whether MoE layers built from now on shard whole experts over the TP group."""
    global _expert_parallel
    _expert_parallel = enabled


def init_worker_distributed(
    rank: int,
    tensor_parallel_size: int,
    pipeline_parallel_size: int,
    backend: str,
    init_method: str,
    enable_expert_parallel: bool = False,
    timeout_s: float = 600.0,
) -> None:
    """Join the world of ``tp * pp`` ranks and build every TP and PP group.

    Every rank must call this with the same sizes: ``new_group`` is collective, so each
    rank creates every group in the same order and keeps the two it belongs to.
    """
    import torch.distributed as dist

    tp, pp = tensor_parallel_size, pipeline_parallel_size
    world_size = tp * pp
    dist.init_process_group(
        backend,
        init_method=init_method,
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )
    for stage in range(pp):
        ranks = tuple(stage * tp + i for i in range(tp))
        group = dist.new_group(list(ranks))
        if rank in ranks:
            init_tensor_model_parallel(ranks.index(rank), tp, group, ranks)
    for tp_rank in range(tp):
        ranks = tuple(stage * tp + tp_rank for stage in range(pp))
        group = dist.new_group(list(ranks))
        if rank in ranks:
            init_pipeline_model_parallel(ranks.index(rank), pp, group, ranks)
    set_expert_parallel(enable_expert_parallel)


def destroy_model_parallel() -> None:
    """Back to the single-process state; leaves the process group if one was joined."""
    destroy_tensor_model_parallel()
    global _pp
    _pp = _SINGLE_PROCESS
    set_expert_parallel(False)
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def destroy_tensor_model_parallel() -> None:
    """Return to the single-process tensor-parallel state (rank 0 of 1)."""
    global _tp
    _tp = _SINGLE_PROCESS


@contextmanager
def tensor_model_parallel_state(rank: int, world_size: int, group: Any = None) -> Iterator[None]:
    """Temporarily act as ``rank`` of ``world_size`` (building a shard's layers in tests)."""
    global _tp
    previous = _tp
    init_tensor_model_parallel(rank, world_size, group)
    try:
        yield
    finally:
        _tp = previous


@contextmanager
def pipeline_model_parallel_state(rank: int, world_size: int) -> Iterator[None]:
    """Temporarily act as stage ``rank`` of ``world_size`` (building a stage in tests)."""
    global _pp
    previous = _pp
    init_pipeline_model_parallel(rank, world_size)
    try:
        yield
    finally:
        _pp = previous


def get_tensor_model_parallel_rank() -> int:
    return _tp.rank


def get_tensor_model_parallel_world_size() -> int:
    return _tp.world_size


def get_pipeline_state() -> GroupState:
    """This process's pipeline stage (rank 0 of 1 without pipeline parallelism)."""
    return _pp


def expert_parallel_enabled() -> bool:
    return _expert_parallel


def tensor_model_parallel_all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    """Sum ``tensor`` over the group (in place when distributed); identity for one process."""
    if _tp.world_size == 1:
        return tensor
    torch.distributed.all_reduce(tensor, group=_tp.group)
    return tensor


def tensor_model_parallel_all_gather(tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate every rank's ``tensor`` along ``dim``, in rank order."""
    if _tp.world_size == 1:
        return tensor
    parts = [torch.empty_like(tensor) for _ in range(_tp.world_size)]
    torch.distributed.all_gather(parts, tensor.contiguous(), group=_tp.group)
    return torch.cat(parts, dim=dim)


def gather_from_every_rank(texts: list[str | None], device: torch.device) -> list[list[str | None]]:
    """Every rank's ``texts``, indexed by global rank, on every rank of the engine (each TP
    rank of each pipeline stage): what one rank found on its host (a file it could not
    read) that every rank must act on alike. ``[texts]`` in a single process.

    Collective over the whole engine: every rank calls it at the same point of the same
    calls, with as many texts. They cross as JSON bytes in ``device`` tensors (the
    platform's backend), nothing pickled."""
    import torch.distributed as dist

    if _tp.world_size * _pp.world_size == 1 or not dist.is_initialized():
        return [list(texts)]
    payload = torch.tensor(list(json.dumps(texts).encode()), dtype=torch.uint8, device=device)
    world_size = dist.get_world_size()
    size = torch.tensor([payload.numel()], dtype=torch.int64, device=device)
    sizes = [torch.empty_like(size) for _ in range(world_size)]
    dist.all_gather(sizes, size)
    lengths = [int(length) for length in torch.cat(sizes).tolist()]
    padded = torch.zeros(max(lengths), dtype=torch.uint8, device=device)
    padded[: payload.numel()] = payload
    parts = [torch.empty_like(padded) for _ in range(world_size)]
    dist.all_gather(parts, padded)
    return [
        json.loads(bytes(part[:length].tolist()))
        for part, length in zip(parts, lengths, strict=True)
    ]


def divide(numerator: int, denominator: int) -> int:
    """``numerator / denominator``, which must be exact (a shard size)."""
    if numerator % denominator != 0:
        raise ValueError(
            f"{numerator} is not divisible by the tensor parallel size {denominator}; "
            "choose a tensor parallel size that divides the model's head and hidden sizes."
        )
    return numerator // denominator
