"""The in-tree CPU platform and its cpu_sdpa backend pass the conformance kit, and what
they do not offer is reported as not applicable, by name (never skipped)."""

from __future__ import annotations

import re

import pytest
import torch

from pagedlm.plugins.registry import create_plugin_manager, select_platform
from pagedlm.testing import BACKEND_CHECKS, PLATFORM_CHECKS, AttentionTarget, NotApplicable
from pagedlm_cpu.attention import CpuSdpaBackend

CPU_TARGET = AttentionTarget(CpuSdpaBackend)

NOT_ON_CPU = {
    "graph_replay": "captures no graph",
    "host_mapping": "maps no host memory",
    "fused_sampler": "hands the sampler no fused kernel",
    "fused_greedy_verifier": "verifies greedy drafts with torch ops",
    "in_flight_corrector": "corrects in-flight positions with torch ops",
    "step_gatherer": "gathers a step's inputs with torch ops",
}
"""The checks of what the CPU does not offer (it runs torch ops instead): each must say
so, by name; every other check must apply and pass (a NotApplicable there is an error,
not a skip)."""


def run(name: str, check, *args) -> None:
    if name in NOT_ON_CPU:
        with pytest.raises(NotApplicable, match=re.escape(NOT_ON_CPU[name])):
            check(*args)
    else:
        check(*args)


def test_every_not_applicable_check_exists() -> None:
    assert set(NOT_ON_CPU) <= set(BACKEND_CHECKS) | set(PLATFORM_CHECKS)


@pytest.mark.parametrize("check", list(BACKEND_CHECKS))
def test_cpu_sdpa_backend(check: str) -> None:
    run(check, BACKEND_CHECKS[check], CPU_TARGET)


def test_cpu_sdpa_in_bfloat16() -> None:
    target = AttentionTarget(CpuSdpaBackend, dtype=torch.bfloat16, block_sizes=(16,))
    for check in ("slot_mapping", "chunked_prefill", "sliding_window"):
        BACKEND_CHECKS[check](target)


@pytest.mark.parametrize("check", list(PLATFORM_CHECKS))
def test_cpu_platform(check: str) -> None:
    platform = select_platform("cpu", pm=create_plugin_manager(autoload=True))
    run(check, PLATFORM_CHECKS[check], platform)
