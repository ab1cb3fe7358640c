"""Entry point of the ROCm hardware package (``[project.entry-points.pagedlm] rocm``)."""

from __future__ import annotations

from pagedlm import hookimpl
from pagedlm.plugins import PlatformSpec


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
            description="AMD GPUs through ROCm/HIP.",
        )
    ]
