"""Entry point of the CPU hardware package (``[project.entry-points.pagedlm] cpu``)."""

from __future__ import annotations

from pagedlm import hookimpl
from pagedlm.plugins import BackendSpec, PlatformSpec

PAGEDLM_CONTRACT_VERSION = "1.0"
"""The plugin contract this package is built for (``pagedlm.plugins.contract``)."""


@hookimpl
def pagedlm_register_platforms() -> list[PlatformSpec]:
    # Lowest priority: any accelerator that is present wins over the CPU.
    return [
        PlatformSpec(
            name="cpu",
            target="pagedlm_cpu.platform:CpuPlatform",
            priority=0,
            description="Any CPU torch runs on (gather + SDPA attention).",
        )
    ]


@hookimpl
def pagedlm_register_attention_backends(platform: object) -> list[BackendSpec]:
    return [
        BackendSpec(name="cpu_sdpa", target="pagedlm_cpu.attention:CpuSdpaBackend", platform="cpu")
    ]
