"""Entry point of the CUDA hardware package (``[project.entry-points.pagedlm] cuda``)."""

from __future__ import annotations

from pagedlm import hookimpl
from pagedlm.plugins import BackendSpec, PlatformSpec

PAGEDLM_CONTRACT_VERSION = "1.0"
"""The plugin contract this package is built for (``pagedlm.plugins.contract``)."""


def cuda_is_available() -> bool:
    """True for a CUDA (not HIP) build of torch that sees at least one device."""
    import torch

    return (
        torch.version.cuda is not None and torch.version.hip is None and (torch.cuda.is_available())
    )


@hookimpl
def pagedlm_register_platforms() -> list[PlatformSpec]:
    return [
        PlatformSpec(
            name="cuda",
            target="pagedlm_cuda.platform:CudaPlatform",
            is_available=cuda_is_available,
            priority=10,
            description="NVIDIA GPUs through CUDA.",
        )
    ]


@hookimpl
def pagedlm_register_attention_backends(platform: object) -> list[BackendSpec]:
    return [
        BackendSpec(
            name="triton", target="pagedlm_cuda.attention:TritonAttentionBackend", platform="cuda"
        )
    ]
