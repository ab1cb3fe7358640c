"""The example platform: CPU torch standing in for a device with a fixed memory size."""

from __future__ import annotations

import os

import torch

from pagedlm.platforms import Platform

MEMORY_ENV = "PAGEDLM_EXAMPLE_MEMORY_GIB"
"""GiB of the (simulated) device memory the KV cache may fill; default 1."""


class ExamplePlatform(Platform):
    name = "example"
    device_type = "cpu"
    dist_backend = "gloo"
    default_attention_backend = "example_attention"
    default_executor = "example_uniproc"

    @property
    def supported_dtypes(self) -> tuple[torch.dtype, ...]:
        return (torch.float32, torch.bfloat16)

    def kv_cache_memory_bytes(self, bytes_per_block: int | None = None) -> int:
        raw = os.environ.get(MEMORY_ENV, "1")
        try:
            gib = float(raw)
        except ValueError:
            gib = -1.0
        if not gib >= 0:  # also catches NaN
            raise ValueError(
                f"{MEMORY_ENV} must be a number of GiB >= 0, got {raw!r}; e.g. {MEMORY_ENV}=2."
            )
        return int(gib * 2**30)
