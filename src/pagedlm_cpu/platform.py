"""The CPU platform."""

from __future__ import annotations

import math
import os

import numpy as np
import torch

from pagedlm.platforms import Platform

KVCACHE_SPACE_ENV = "PAGEDLM_CPU_KVCACHE_SPACE"
"""GiB the KV cache may take on CPU (like vLLM's VLLM_CPU_KVCACHE_SPACE); default 4."""


def _available_memory_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


class CpuPlatform(Platform):
    name = "cpu"
    device_type = "cpu"
    dist_backend = "gloo"
    supports_cuda_graphs = False
    default_attention_backend = "cpu_sdpa"

    @property
    def supported_dtypes(self) -> tuple[torch.dtype, ...]:
        # float16 matmuls on CPU are slow or missing in many torch builds.
        return (torch.float32, torch.bfloat16)

    def default_dtype(self, config_dtype: torch.dtype | None) -> torch.dtype:
        # Like vLLM's CPU backend, run half-precision checkpoints in float32 unless asked.
        return torch.float32 if config_dtype != torch.bfloat16 else torch.bfloat16

    def prepare_model(self, model: torch.nn.Module) -> None:
        from pagedlm_cpu.linear import prepack_linears

        prepack_linears(model)

    def zeros(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        # numpy's zeros comes from calloc: the OS hands out zero pages lazily, so a
        # multi-GiB KV cache costs nothing until it is written (torch.zeros memsets it all).
        element = torch.empty((), dtype=dtype).element_size()
        raw = np.zeros(math.prod(shape) * element, dtype=np.uint8)
        return torch.from_numpy(raw).view(dtype).view(shape)

    def kv_cache_memory_bytes(self, bytes_per_block: int | None = None) -> int:
        if KVCACHE_SPACE_ENV in os.environ:
            try:
                gib = float(os.environ[KVCACHE_SPACE_ENV])
            except ValueError:
                raise ValueError(
                    f"{KVCACHE_SPACE_ENV} must be a number of GiB, "
                    f"got {os.environ[KVCACHE_SPACE_ENV]!r}."
                ) from None
            return int(gib * 2**30)
        budget = 4 * 2**30
        available = _available_memory_bytes()
        if available is not None:
            budget = min(budget, available // 4)
        return budget
