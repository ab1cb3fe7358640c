"""Entry point of the ROCm hardware package (``[project.entry-points.pagedlm] rocm``).

The attention backend and fused kernels are ``pagedlm_cuda``'s Triton kernels, which
Triton compiles for AMD GPUs as well. Untested on AMD hardware.
"""

from __future__ import annotations

from pagedlm import hookimpl
from pagedlm.plugins import BackendSpec, PlatformSpec

PAGEDLM_CONTRACT_VERSION = "1.0"
"""The plugin contract this package is built for (``pagedlm.plugins.contract``)."""


def rocm_is_available() -> bool:
    """True for a HIP build of torch that sees at least one device."""
    import torch

    return torch.version.hip is not None and torch.cuda.is_available()


@hookimpl
def pagedlm_register_platforms() -> list[PlatformSpec]:
    return [
        PlatformSpec(
            name="rocm",
            target="pagedlm_rocm.platform:RocmPlatform",
            is_available=rocm_is_available,
            priority=10,
            description="AMD GPUs through ROCm/HIP (untested on AMD hardware).",
        )
    ]


@hookimpl
def pagedlm_register_attention_backends(platform: object) -> list[BackendSpec]:
    return [
        BackendSpec(
            name="triton", target="pagedlm_cuda.attention:TritonAttentionBackend", platform="rocm"
        )
    ]
