"""Sleep mode on a worker: give the device's memory back without stopping the engine.

vLLM's two levels:

- level 1: the KV cache (and the CUDA graphs that point into it) is dropped, and every
  parameter and buffer of the model (and of a speculative proposer) is copied to host
  memory and its device storage released. ``wake_up`` copies them back and allocates a fresh KV cache (its contents are
  gone, so the engine resets the prefix cache). Tensors already in host memory (the CPU
  platform) stay where they are.
- level 2: the whole model runner is dropped (weights, KV cache, graphs, kernels'
  prepacked copies); ``wake_up`` builds a new one, which loads the weights from the
  checkpoint again (or fills dummy ones) exactly as at start-up, then allocates the KV
  cache with the same number of blocks.

After dropping its references the worker asks the platform to ``release_memory`` (CUDA:
``torch.cuda.empty_cache``), so the memory really returns to the driver.

``wake_up(tags)`` (vLLM's tags) wakes one part at a time: ``"weights"`` (back on the device,
or loaded again) and ``"kv_cache"`` (a new, empty cache); ``None`` wakes both. A
reinforcement-learning loop wakes the weights, replaces them, then wakes the KV cache, so
the new weights never share the device with a KV cache. The KV cache wakes only with or
after the weights (the platform's graphs, captured when it is allocated, run the model).
Until both are awake the engine stays asleep: no request is admitted, and a worker refuses
a step while its KV cache sleeps.

Invariant: the engine sleeps only without unfinished requests (the scheduler refuses
otherwise), so the dropped state holds nothing a request still needs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn

SLEEP_LEVELS = (1, 2)
SLEEP_TAGS = ("weights", "kv_cache")
"""What ``wake_up(tags)`` wakes, in the order it wakes them."""
HOST = torch.device("cpu")


@dataclass
class OffloadedWeights:
    """Host copies of a model's device tensors (level 1), keyed by the tensor objects'
    owners so they can be put back into the same ``Parameter``/buffer objects (layers and
    kernels that hold references to them keep working)."""

    tensors: list[tuple[torch.Tensor, torch.Tensor]]
    """(the model's tensor, its host copy)."""

    @classmethod
    def offload(
        cls,
        modules: Iterable[nn.Module],
        pin_memory: bool,
        in_host_memory: Callable[[torch.Tensor], bool] = lambda tensor: False,
    ) -> OffloadedWeights:
        """``modules``: the model and a speculative proposer's modules; a tensor they share
        is copied once. Tensors on the host device, or for which ``in_host_memory`` is
        true (``cpu_offload_gb``'s, device views of host memory), stay as they are."""
        tensors = []
        seen: set[int] = set()
        every = [t for module in modules for t in (*module.parameters(), *module.buffers())]
        for tensor in every:
            if id(tensor) in seen or tensor.device == HOST or in_host_memory(tensor):
                continue
            seen.add(id(tensor))
            host = torch.empty(tensor.shape, dtype=tensor.dtype, device=HOST, pin_memory=pin_memory)
            host.copy_(tensor.detach())
            # Replacing .data keeps the Parameter object and frees its device storage.
            tensor.data = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
            tensors.append((tensor, host))
        return cls(tensors)

    def restore(self, device: torch.device) -> None:
        for tensor, host in self.tensors:
            tensor.data = host.to(device, non_blocking=False)
        self.tensors = []

    @property
    def num_bytes(self) -> int:
        return sum(host.numel() * host.element_size() for _, host in self.tensors)


def check_level(level: int) -> None:
    if level not in SLEEP_LEVELS:
        raise ValueError(
            f"sleep level {level!r} is not supported; use 1 (weights to host memory, KV "
            "cache dropped) or 2 (weights and KV cache dropped)."
        )


def check_tags(tags: Iterable[str] | None) -> tuple[str, ...]:
    """The parts ``wake_up(tags)`` names, in waking order (None: all of them)."""
    if tags is None:
        return SLEEP_TAGS
    if isinstance(tags, str):
        raise ValueError(f"tags must be a list of tags, got the string {tags!r}; pass [{tags!r}].")
    tags = list(tags)
    unknown = [tag for tag in tags if tag not in SLEEP_TAGS]
    if unknown:
        raise ValueError(
            f"wake_up tags {unknown} are not supported; use {list(SLEEP_TAGS)} (or None for both)."
        )
    return tuple(tag for tag in SLEEP_TAGS if tag in tags)


def check_wake_order(asleep: Iterable[str], waking: Iterable[str]) -> None:
    """The KV cache wakes with or after the weights: ValueError otherwise."""
    asleep, waking = set(asleep), set(waking)
    if "kv_cache" in waking and "weights" in asleep and "weights" not in waking:
        raise ValueError(
            "The weights are still asleep: wake_up(tags=['weights']) before "
            "wake_up(tags=['kv_cache']), or wake both with wake_up()."
        )
