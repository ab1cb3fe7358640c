"""Weights kept in host memory and read by the device in place (vLLM's ``cpu_offload_gb``).

A model that does not fit the device, or leaves too little room for the KV cache, can keep
up to ``cpu_offload_gb`` GiB of its parameters in the host's pinned memory. The platform
maps each such host tensor into the device's address space (``Platform.map_host_tensor``;
CUDA: unified virtual addressing), and the parameter's ``data`` becomes that device view:
kernels, cuBLAS and captured CUDA graphs read the weights across the host link at every
step, with no copy and no change to any layer. It trades speed for memory: each step
reads the offloaded bytes at the link's bandwidth (tens of GB/s, against the device
memory's TB/s).

Which parameters: as vLLM's, those of the layers between the embedding and the LM head
(never a vocabulary table: every step would read all of it across the link), in the order
the model creates them, while fewer than ``cpu_offload_gb`` GiB are offloaded (so the last
one may pass the budget by its own size). Offloading starts while the model is built, one
parameter as it is registered, so the device never holds what is offloaded: a float
checkpoint larger than the device's memory loads. Layers that replace their parameters
after loading (quantization at load or from a pre-quantized checkpoint, GGUF/GPTQ/AWQ
layers kept on their blocks) allocate the new ones on the device first; ``settle``
offloads from those again, before the platform installs its kernels (some keep
references to a layer's tensors).

Invariants:
- an offloaded parameter keeps its ``Parameter`` object and attributes; only its
  ``data`` is the device view of a host tensor this object holds alive;
- parameters on the meta device (layers a GGUF kernel will compute on their blocks) and
  those of vocabulary tables are never offloaded;
- a parameter shared by several modules is offloaded and counted once.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Iterable, Iterator

import torch
from torch import nn
from torch.nn.modules.module import register_module_parameter_registration_hook

from pagedlm.model_executor.layers.vocab_embedding import VocabParallelEmbedding

logger = logging.getLogger(__name__)

HostMapper = Callable[[torch.Tensor], "torch.Tensor | None"]
"""``Platform.map_host_tensor``: a device tensor over a host tensor's memory, or None."""
HostAllocator = Callable[[tuple[int, ...], torch.dtype], torch.Tensor]
"""``Platform.empty_host``: an uninitialized (pinned) host tensor."""


def offload_budget_bytes(cpu_offload_gb: float) -> int:
    value = cpu_offload_gb
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise ValueError(
            f"cpu_offload_gb={value!r} must be a number of GiB >= 0 (0: no offloading)."
        )
    if not math.isfinite(value):
        raise ValueError(
            f"cpu_offload_gb={value!r} must be finite; give the GiB of weights to keep in "
            "host memory (more than the model holds offloads all of it)."
        )
    return int(value * 2**30)


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class WeightOffload:
    """Moves parameters to host memory, up to ``budget_bytes``, and keeps their host
    tensors alive (see the module docstring)."""

    def __init__(self, budget_bytes: int, map_host: HostMapper, empty_host: HostAllocator):
        self.budget_bytes = budget_bytes
        self._map_host = map_host
        self._empty_host = empty_host
        self._held: dict[int, tuple[nn.Parameter, torch.Tensor, int]] = {}
        """id(param) -> (param, its host tensor, the device view's data_ptr)."""
        self.offloaded_bytes = 0
        """The host tensors' bytes."""

    def holds(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is an offloaded parameter (its data lives in host memory)."""
        held = self._held.get(id(tensor))
        return held is not None and held[0] is tensor and tensor.data_ptr() == held[2]

    def offer(self, param: nn.Parameter) -> bool:
        """Offload ``param`` while less than the budget is offloaded; True if it is
        offloaded (now or before)."""
        if self.holds(param):
            return True
        self._forget(id(param))  # its data was replaced since it was offloaded
        size = _nbytes(param)
        if param.is_meta or size == 0 or self.offloaded_bytes >= self.budget_bytes:
            return False
        host = self._empty_host(tuple(param.shape), param.dtype)
        host.copy_(param.detach())
        view = self._map_host(host)
        if view is None:
            raise RuntimeError("the platform gave no device view of a host tensor")
        param.data = view
        self._held[id(param)] = (param, host, param.data_ptr())
        self.offloaded_bytes += size
        return True

    def _forget(self, key: int) -> None:
        held = self._held.pop(key, None)
        if held is not None:
            self.offloaded_bytes -= _nbytes(held[1])

    @contextlib.contextmanager
    def while_building(self) -> Iterator[None]:
        """Offload each parameter as a module registers it (model construction): the device
        holds at most one offloaded parameter at a time."""

        def offload_on_registration(module: nn.Module, name: str, param: nn.Parameter | None):
            if param is not None and not isinstance(module, VocabParallelEmbedding):
                self.offer(param)

        handle = register_module_parameter_registration_hook(offload_on_registration)
        try:
            yield
        finally:
            handle.remove()

    def prune(self, modules: Iterable[nn.Module]) -> dict[int, nn.Parameter]:
        """Forget (and free the host memory of) parameters that left ``modules`` or whose
        data was replaced; returns the modules' parameters by id."""
        params = {id(p): p for module in modules for p in module.parameters()}
        for key in [k for k, (p, _, _) in self._held.items() if params.get(k) is not p]:
            self._forget(key)
        return params

    def settle(self, modules: Iterable[nn.Module]) -> None:
        """After loading, before the platform's kernels: forget parameters that left the
        model or were replaced, then offload more, in module order, while the budget
        allows."""
        modules = list(modules)
        params = self.prune(modules)
        tables = {
            id(p)
            for module in modules
            for m in module.modules()
            if isinstance(m, VocabParallelEmbedding)
            for p in m.parameters(recurse=False)
        }
        for key, param in params.items():
            if key not in tables:
                self.offer(param)
        logger.info(
            "cpu_offload_gb: %.2f GiB of weights in host memory (%d tensors), read by the "
            "device in place at every step",
            self.offloaded_bytes / 2**30,
            len(self._held),
        )


def make_weight_offload(
    cpu_offload_gb: float, platform_name: str, map_host: HostMapper, empty_host: HostAllocator
) -> WeightOffload | None:
    """The offloader for ``cpu_offload_gb`` (None: nothing to offload, or a platform whose
    device cannot read host memory in place, e.g. the CPU, whose weights are there already)."""
    budget = offload_budget_bytes(cpu_offload_gb)
    if budget == 0:
        return None
    probe = empty_host((1,), torch.uint8)
    if map_host(probe) is None:
        logger.warning(
            "cpu_offload_gb=%s has no effect on the %s platform: its device does not read "
            "host memory in place (on the CPU the weights are in host memory already).",
            cpu_offload_gb,
            platform_name,
        )
        return None
    return WeightOffload(budget, map_host, empty_host)
