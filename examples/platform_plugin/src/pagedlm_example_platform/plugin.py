"""The plugin module named by the ``pagedlm`` entry point: the contract version it is built
for, the probe, and the hooks returning specs (each names its class lazily)."""

from __future__ import annotations

import os
import re

from pagedlm import hookimpl
from pagedlm.plugins import BackendSpec, ExecutorSpec, PlatformSpec

PAGEDLM_CONTRACT_VERSION = "1.0"
"""The contract this plugin was written and tested against; a literal, never imported."""

PLATFORM = "example"
VISIBLE_DEVICES_ENV = "PAGEDLM_EXAMPLE_VISIBLE_DEVICES"
"""Like ``CUDA_VISIBLE_DEVICES``: unset means device 0; empty hides every device."""


def example_is_available() -> bool:
    """The probe: cheap, imports nothing heavy. False when no device is visible (not an
    error: the registry probes every platform, even ones nobody asked for); raises with
    the fix when the setting is malformed, which the registry reports."""
    value = os.environ.get(VISIBLE_DEVICES_ENV, "0").strip()
    if not value:
        return False
    if not re.fullmatch(r"\d+(,\d+)*", value):
        raise RuntimeError(
            f"{VISIBLE_DEVICES_ENV}={value!r} is not a comma-separated list of device "
            f"indices; unset it, or set e.g. {VISIBLE_DEVICES_ENV}=0."
        )
    return True


@hookimpl
def pagedlm_register_platforms() -> list[PlatformSpec]:
    # Below the CPU platform's 0: chosen only by name (PAGEDLM_PLATFORM=example or
    # LLM(platform="example")), never instead of the CPU by default.
    return [
        PlatformSpec(
            name=PLATFORM,
            target="pagedlm_example_platform.platform:ExamplePlatform",
            is_available=example_is_available,
            priority=-10,
            description="Example out-of-tree platform (CPU torch, transposed-key KV layout).",
        )
    ]


@hookimpl
def pagedlm_register_attention_backends(platform: object) -> list[BackendSpec]:
    return [
        BackendSpec(
            name="example_attention",
            target="pagedlm_example_platform.attention:ExampleAttentionBackend",
            platform=PLATFORM,
        )
    ]


@hookimpl
def pagedlm_register_executors(platform: object) -> list[ExecutorSpec]:
    # Restricted to this platform: other platforms never see it in their choices.
    return [
        ExecutorSpec(
            name="example_uniproc",
            target="pagedlm_example_platform.executor:ExampleExecutor",
            platforms=(PLATFORM,),
        )
    ]
