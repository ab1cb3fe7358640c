"""The ROCm platform (HIP builds of torch expose devices as "cuda").

It reuses the CUDA package's Triton kernels, fused layers and graph runner; nothing here
has run on AMD hardware.
"""

from __future__ import annotations

import torch

from pagedlm_cuda.platform import CudaPlatform


class RocmPlatform(CudaPlatform):
    name = "rocm"
    device_type = "cuda"
    dist_backend = "nccl"  # RCCL answers to the nccl backend name
    default_attention_backend = "triton"

    def map_host_tensor(self, host: torch.Tensor) -> None:
        """None (``cpu_offload_gb`` has no effect): a HIP-registered host pointer need not
        be its device address, and the kit's ``host_mapping`` check has not run on AMD
        hardware."""
        return None
