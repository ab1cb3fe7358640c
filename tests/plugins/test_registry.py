"""The plugin registry: entry points, explicit plugins, selection and its errors."""

from __future__ import annotations

import importlib.metadata

import pytest
import torch

from pagedlm import hookimpl
from pagedlm.platforms import Platform
from pagedlm.plugins import CONTRACT_VERSION, BackendSpec, PlatformSpec
from pagedlm.plugins.registry import (
    PluginError,
    create_plugin_manager,
    select_attention_backend,
    select_executor,
    select_platform,
)


class FakePlatform(Platform):
    name = "fake"
    device_type = "cpu"
    default_attention_backend = "fake_attn"

    @property
    def supported_dtypes(self):
        return (torch.float32,)

    def kv_cache_memory_bytes(self, bytes_per_block: int | None = None) -> int:
        return 1 << 20


class FakePlugin:
    PAGEDLM_CONTRACT_VERSION = CONTRACT_VERSION

    def __init__(self, priority: int = 0, available: bool = True) -> None:
        self.priority = priority
        self.available = available

    @hookimpl
    def pagedlm_register_platforms(self):
        return [
            PlatformSpec(
                name="fake",
                target=f"{__name__}:FakePlatform",
                is_available=lambda: self.available,
                priority=self.priority,
            )
        ]

    @hookimpl
    def pagedlm_register_attention_backends(self, platform):
        return [BackendSpec("fake_attn", "pagedlm_cpu.attention:CpuSdpaBackend", "fake")]


class BrokenProbePlugin:
    PAGEDLM_CONTRACT_VERSION = CONTRACT_VERSION

    @hookimpl
    def pagedlm_register_platforms(self):
        def probe():
            raise RuntimeError("driver exploded")

        return [PlatformSpec(name="broken", target=f"{__name__}:FakePlatform", is_available=probe)]


def test_in_tree_packages_are_entry_points():
    names = {ep.name: ep.value for ep in importlib.metadata.entry_points(group="pagedlm")}
    assert names["cpu"] == "pagedlm_cpu.plugin"
    assert names["cuda"] == "pagedlm_cuda.plugin"
    assert names["rocm"] == "pagedlm_rocm.plugin"


def test_cpu_platform_found_through_entry_point():
    pm = create_plugin_manager(autoload=True)
    assert pm.get_plugin("cpu") is not None  # registered under its entry-point name
    platform = select_platform(pm=pm)
    assert platform.name == "cpu"
    assert select_attention_backend(platform, pm=pm).name == "cpu_sdpa"
    assert select_executor(platform, pm=pm).name == "uni"


def test_cuda_and_rocm_report_unavailable_here():
    pm = create_plugin_manager(autoload=True)
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    for name in ("cuda", "rocm"):
        with pytest.raises(PluginError, match=r"known platforms: cpu \(available\)"):
            select_platform(name, pm=pm)


def test_fake_platform_selectable_by_name():
    pm = create_plugin_manager(autoload=True)
    pm.register(FakePlugin())
    platform = select_platform("fake", pm=pm)
    assert isinstance(platform, FakePlatform)
    assert select_attention_backend(platform, pm=pm).name == "cpu_sdpa"


def test_env_var_selects_platform(monkeypatch):
    pm = create_plugin_manager(autoload=True)
    pm.register(FakePlugin())
    monkeypatch.setenv("PAGEDLM_PLATFORM", "fake")
    assert select_platform(pm=pm).name == "fake"
    assert select_platform("cpu", pm=pm).name == "cpu"  # the argument wins


def test_priority_and_ties():
    pm = create_plugin_manager(autoload=True)
    pm.register(FakePlugin(priority=5))
    assert select_platform(pm=pm).name == "fake"
    tie = create_plugin_manager(autoload=True)
    tie.register(FakePlugin(priority=0))
    with pytest.raises(PluginError, match="same priority"):
        select_platform(pm=tie)


def test_unknown_and_unavailable_names_list_known_ones():
    pm = create_plugin_manager(autoload=True)
    pm.register(FakePlugin(available=False))
    with pytest.raises(PluginError, match=r"Unknown platform 'tpu'.*cpu \(available\)"):
        select_platform("tpu", pm=pm)
    with pytest.raises(PluginError, match="'fake' cannot be used: not available on this machine"):
        select_platform("fake", pm=pm)
    platform = select_platform("cpu", pm=pm)
    with pytest.raises(PluginError, match="known for this platform: cpu_sdpa"):
        select_attention_backend(platform, "flash", pm=pm)


def test_probe_failure_is_reported(caplog):
    pm = create_plugin_manager(autoload=True)
    pm.register(BrokenProbePlugin())
    with pytest.raises(
        PluginError, match=r"'broken' cannot be used: its probe failed: .*driver exploded"
    ):
        select_platform("broken", pm=pm)
    assert "driver exploded" in caplog.text


def test_autoload_can_be_disabled(monkeypatch):
    monkeypatch.setenv("PAGEDLM_DISABLE_PLUGIN_AUTOLOAD", "1")
    pm = create_plugin_manager()
    assert pm.get_plugin("cpu") is None
    with pytest.raises(PluginError, match="No platform is registered"):
        select_platform(pm=pm)
    monkeypatch.setenv("PAGEDLM_PLUGINS", "pagedlm_cpu.plugin")
    assert select_platform(pm=create_plugin_manager()).name == "cpu"


def test_configure_hook_runs_in_order():
    from dataclasses import replace

    class Shrink:
        PAGEDLM_CONTRACT_VERSION = CONTRACT_VERSION

        def __init__(self, size: int) -> None:
            self.size = size

        @hookimpl
        def pagedlm_configure(self, config, platform):
            return replace(config, cache=replace(config.cache, block_size=self.size))

    from pagedlm.config import (
        ArchConfig,
        CacheConfig,
        EngineConfig,
        ModelConfig,
        SchedulerConfig,
    )
    from pagedlm.plugins.registry import configure

    arch = ArchConfig("LlamaForCausalLM", 10, 8, 1, 2, 2, 4, 16)
    config = EngineConfig(
        ModelConfig("m", None, arch, torch.float32, 64), CacheConfig(), SchedulerConfig(), "cpu"
    )
    pm = create_plugin_manager(autoload=False)
    pm.register(Shrink(8), name="first")
    pm.register(Shrink(32), name="second")
    # Registration order: "second" sees "first"'s result and has the last word.
    assert configure(config, FakePlatform(), pm=pm).cache.block_size == 32
