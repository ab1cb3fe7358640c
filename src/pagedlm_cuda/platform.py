"""The CUDA platform: Triton attention and fused layers, CUDA graphs for decode steps,
and a KV-cache budget taken from the memory left after a profiling forward."""

from __future__ import annotations

import logging
import os

import torch

from pagedlm.platforms import Platform

logger = logging.getLogger(__name__)

GPU_MEMORY_UTILIZATION_ENV = "PAGEDLM_GPU_MEMORY_UTILIZATION"
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9


def gpu_memory_utilization() -> float:
    """Fraction of the device's memory pagedlm may use in all (``gpu_memory_utilization``)."""
    raw = os.environ.get(GPU_MEMORY_UTILIZATION_ENV)
    if raw is None:
        return DEFAULT_GPU_MEMORY_UTILIZATION
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0.0 < value <= 1.0:
        raise ValueError(f"{GPU_MEMORY_UTILIZATION_ENV} must be a fraction in (0, 1], got {raw!r}.")
    return value


class CudaPlatform(Platform):
    name = "cuda"
    device_type = "cuda"
    dist_backend = "nccl"
    supports_cuda_graphs = True
    profiles_memory = True
    default_attention_backend = "triton"

    @property
    def supported_dtypes(self) -> tuple[torch.dtype, ...]:
        return (torch.bfloat16, torch.float16, torch.float32)

    def prepare_model(self, model: torch.nn.Module) -> None:
        from pagedlm_cuda.fused_layers import install_fused_kernels

        install_fused_kernels(model)
        # The model runner's profiling forward comes next; its peak is measured from here.
        torch.cuda.reset_peak_memory_stats()

    def zeros(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(shape, dtype=dtype, device=self.device)

    def kv_cache_memory_bytes(self) -> int:
        """``utilization * total`` minus what is in use now (weights, other processes) and
        minus the activation peak that the profiling forward reached above it."""
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info()
        activation_peak = torch.cuda.max_memory_allocated() - torch.cuda.memory_allocated()
        budget = int(total * gpu_memory_utilization()) - (total - free) - activation_peak
        logger.info(
            "GPU memory: %.1f GiB total, %.1f GiB in use, %.2f GiB activation peak; "
            "KV cache budget %.1f GiB",
            total / 2**30,
            (total - free) / 2**30,
            activation_peak / 2**30,
            budget / 2**30,
        )
        return max(0, budget)

    def capture_decode_graphs(self, runner: object) -> object | None:
        from pagedlm_cuda.graph_runner import CudaGraphRunner

        return CudaGraphRunner.for_model_runner(runner)

    def synchronize(self) -> None:
        torch.cuda.synchronize()
