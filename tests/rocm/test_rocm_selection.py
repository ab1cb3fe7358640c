"""ROCm selection logic (there is no AMD GPU here): which platform a HIP or CUDA build of
torch gets, and that ROCm reuses the Triton backend. Nothing here runs a kernel."""

from __future__ import annotations

import pytest
import torch

from pagedlm.plugins.registry import (
    PluginError,
    create_plugin_manager,
    select_attention_backend,
    select_platform,
)
from pagedlm_cuda.plugin import cuda_is_available
from pagedlm_rocm.plugin import rocm_is_available


def fake_build(monkeypatch, *, hip: str | None, cuda: str | None, devices: bool) -> None:
    monkeypatch.setattr(torch.version, "hip", hip)
    monkeypatch.setattr(torch.version, "cuda", cuda)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: devices)


def test_hip_build_selects_rocm_with_the_triton_backend(monkeypatch) -> None:
    fake_build(monkeypatch, hip="6.2.41133", cuda=None, devices=True)
    assert rocm_is_available() and not cuda_is_available()
    platform = select_platform(pm=create_plugin_manager(autoload=True))
    assert platform.name == "rocm"
    assert platform.device_type == "cuda" and platform.supports_cuda_graphs
    backend = select_attention_backend(platform, pm=create_plugin_manager(autoload=True))
    assert backend.name == "triton"


def test_cuda_build_selects_cuda(monkeypatch) -> None:
    fake_build(monkeypatch, hip=None, cuda="13.0", devices=True)
    assert cuda_is_available() and not rocm_is_available()
    assert select_platform(pm=create_plugin_manager(autoload=True)).name == "cuda"


def test_hip_build_without_devices_falls_back_to_cpu(monkeypatch) -> None:
    fake_build(monkeypatch, hip="6.2.41133", cuda=None, devices=False)
    assert select_platform(pm=create_plugin_manager(autoload=True)).name == "cpu"


@pytest.mark.parametrize("name", ["cuda", "rocm"])
def test_asking_for_a_missing_gpu_names_the_platforms(monkeypatch, name: str) -> None:
    fake_build(monkeypatch, hip=None, cuda=None, devices=False)
    with pytest.raises(PluginError, match=r"known platforms: .*cpu"):
        select_platform(name, pm=create_plugin_manager(autoload=True))
