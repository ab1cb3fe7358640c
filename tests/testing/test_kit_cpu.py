"""The in-tree CPU platform and its cpu_sdpa backend pass the conformance kit."""

from __future__ import annotations

import pytest
import torch

from pagedlm.plugins.registry import create_plugin_manager, select_platform
from pagedlm.testing import BACKEND_CHECKS, PLATFORM_CHECKS, AttentionTarget, NotApplicable
from pagedlm_cpu.attention import CpuSdpaBackend

CPU_TARGET = AttentionTarget(CpuSdpaBackend)


def run(check, *args) -> None:
    try:
        check(*args)
    except NotApplicable as exc:
        pytest.skip(str(exc))


@pytest.mark.parametrize("check", list(BACKEND_CHECKS))
def test_cpu_sdpa_backend(check: str) -> None:
    run(BACKEND_CHECKS[check], CPU_TARGET)


def test_cpu_sdpa_in_bfloat16() -> None:
    target = AttentionTarget(CpuSdpaBackend, dtype=torch.bfloat16, block_sizes=(16,))
    for check in ("slot_mapping", "chunked_prefill", "sliding_window"):
        BACKEND_CHECKS[check](target)


@pytest.mark.parametrize("check", list(PLATFORM_CHECKS))
def test_cpu_platform(check: str) -> None:
    platform = select_platform("cpu", pm=create_plugin_manager(autoload=True))
    run(PLATFORM_CHECKS[check], platform)
