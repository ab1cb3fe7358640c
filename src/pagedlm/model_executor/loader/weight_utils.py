"""Copying checkpoint tensors into parameters: shape checks and tensor-parallel slicing."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

WeightLoader = Callable[..., None]
"""``loader(param, loaded_weight)`` or ``loader(param, loaded_weight, shard_id)``."""


def set_weight_loader(param: torch.nn.Parameter, loader: WeightLoader) -> None:
    """Attach how ``param`` takes a checkpoint tensor (read by ``load_weights``)."""
    param.weight_loader = loader  # type: ignore[attr-defined]


def get_weight_loader(param: torch.nn.Parameter) -> WeightLoader:
    return getattr(param, "weight_loader", default_weight_loader)


def copy_checked(target: torch.Tensor, loaded_weight: torch.Tensor, what: Any = "") -> None:
    """``target.copy_(loaded_weight)`` (casting dtype/device) after checking the shapes."""
    if target.shape != loaded_weight.shape:
        raise ValueError(
            f"checkpoint tensor {what} has shape {tuple(loaded_weight.shape)} but the model "
            f"expects {tuple(target.shape)}; the checkpoint does not match its config.json."
        )
    with torch.no_grad():
        target.copy_(loaded_weight)


def default_weight_loader(param: torch.nn.Parameter, loaded_weight: torch.Tensor) -> None:
    """Load an unsharded (replicated) parameter."""
    copy_checked(param.data, loaded_weight)


def shard_of(loaded_weight: torch.Tensor, dim: int, rank: int, shard_size: int) -> torch.Tensor:
    """Rank ``rank``'s slice of ``shard_size`` rows (``dim=0``) or columns (``dim=1``)."""
    # A full tensor always splits into whole shards (kv heads replicated across ranks
    # included), so a size that does not is a config/checkpoint mismatch, not a slicing bug.
    full = loaded_weight.shape[dim] if loaded_weight.dim() > dim else 0
    if full < (rank + 1) * shard_size or full % shard_size:
        raise ValueError(
            f"checkpoint tensor of shape {tuple(loaded_weight.shape)} does not split into "
            f"slices of {shard_size} along dim {dim} as the model expects; the checkpoint "
            "does not match its config.json."
        )
    return loaded_weight.narrow(dim, rank * shard_size, shard_size)


@contextmanager
def one_intra_op_thread() -> Iterator[None]:
    """Torch's intra-op pool at one thread inside the block, restored after.

    Loading and packing a GGUF model run hundreds of small ops that gain nothing from a
    second thread, but each is a parallel region whose first thread spins until the
    second arrives: on a loaded 2-core machine (load average 2) packing SmolLM2-135M took
    5-7 s of CPU with OMP_NUM_THREADS=2 against 0.45 s on one thread.
    """
    threads = torch.get_num_threads()
    if threads == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
