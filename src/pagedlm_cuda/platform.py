"""The CUDA platform."""

from __future__ import annotations

import torch

from pagedlm.platforms import Platform


class CudaPlatform(Platform):
    name = "cuda"
    device_type = "cuda"
    dist_backend = "nccl"
    supports_cuda_graphs = True
    default_attention_backend = "triton"

    @property
    def supported_dtypes(self) -> tuple[torch.dtype, ...]:
        return (torch.bfloat16, torch.float16, torch.float32)

    def kv_cache_memory_bytes(self, gpu_memory_utilization: float = 0.9) -> int:
        free, total = torch.cuda.mem_get_info()
        used = total - free
        return max(0, int(total * gpu_memory_utilization) - used)

    def synchronize(self) -> None:
        torch.cuda.synchronize()
