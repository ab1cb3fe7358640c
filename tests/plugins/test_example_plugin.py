"""The example out-of-tree plugin (examples/platform_plugin), installed through its entry
points: selection by name, its backend and executor in a real engine, probe errors."""

from __future__ import annotations

import logging

import pytest

from pagedlm.plugins import CONTRACT_VERSION
from pagedlm.plugins.registry import (
    PluginError,
    create_plugin_manager,
    get_plugin_manager,
    select_attention_backend,
    select_executor,
    select_platform,
)
from plugin_kit import example_project, install_example

DEVICES_ENV = "PAGEDLM_EXAMPLE_VISIBLE_DEVICES"


@pytest.fixture(autouse=True)
def example_installed(monkeypatch, tmp_path):
    monkeypatch.delenv("PAGEDLM_PLATFORM", raising=False)
    monkeypatch.delenv(DEVICES_ENV, raising=False)
    install_example(monkeypatch, tmp_path / "site-packages")
    yield
    get_plugin_manager.cache_clear()


def test_registered_only_through_the_entry_point_group() -> None:
    project = example_project()
    assert project["entry-points"] == {"pagedlm": {"example": "pagedlm_example_platform.plugin"}}
    import pagedlm_example_platform.plugin as plugin

    assert plugin.PAGEDLM_CONTRACT_VERSION == CONTRACT_VERSION
    pm = create_plugin_manager(autoload=True)
    assert pm.get_plugin("example") is plugin and not pm.refused


def test_selected_by_name_never_by_default(monkeypatch) -> None:
    pm = create_plugin_manager(autoload=True)
    assert select_platform(pm=pm).name == "cpu"  # priority -10 < the CPU's 0
    platform = select_platform("example", pm=pm)
    assert type(platform).__name__ == "ExamplePlatform"
    assert select_attention_backend(platform, pm=pm).name == "example_attention"
    assert select_executor(platform, pm=pm).name == "example_uniproc"
    # The example's executor is offered to no other platform.
    with pytest.raises(PluginError, match="known for this platform: uniproc"):
        select_executor(select_platform("cpu", pm=pm), "example_uniproc", pm=pm)
    monkeypatch.setenv("PAGEDLM_PLATFORM", "example")
    assert select_platform(pm=pm).name == "example"


def test_llm_runs_its_backend_and_executor(tiny_checkpoint, monkeypatch) -> None:
    from pagedlm import LLM, SamplingParams

    monkeypatch.setenv("PAGEDLM_PLATFORM", "example")
    llm = LLM(str(tiny_checkpoint("llama")), skip_tokenizer_init=True, max_model_len=64)
    executor = llm.llm_engine.engine_core.executor
    assert executor.name == "example_uniproc"
    runner = executor.worker.model_runner
    assert runner.attn_backend.name == "example_attention"
    key_cache, _ = runner.kv_cache.layer(0)
    # Its own layout: [num_blocks, num_kv_heads, head_dim, block_size].
    assert tuple(key_cache.shape[1:]) == (2, 16, 16)
    out = llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=4))
    assert len(out[0].outputs[0].token_ids) == 4
    assert executor.num_steps >= 4
    executor.shutdown()


def test_hidden_device_is_reported_unavailable(monkeypatch) -> None:
    monkeypatch.setenv(DEVICES_ENV, "")
    pm = create_plugin_manager(autoload=True)
    with pytest.raises(
        PluginError, match=r"'example' cannot be used: not available on this machine"
    ):
        select_platform("example", pm=pm)
    assert select_platform(pm=pm).name == "cpu"


def test_malformed_setting_fails_the_probe_naming_the_fix(monkeypatch, caplog) -> None:
    monkeypatch.setenv(DEVICES_ENV, "gpu0")
    pm = create_plugin_manager(autoload=True)
    with caplog.at_level(logging.WARNING):
        assert select_platform(pm=pm).name == "cpu"  # other platforms still work
    assert "gpu0" in caplog.text
    with pytest.raises(PluginError) as info:
        select_platform("example", pm=pm)
    assert "its probe failed: RuntimeError" in str(info.value)
    assert f"set e.g. {DEVICES_ENV}=0" in str(info.value)


def test_memory_budget_setting_is_validated(monkeypatch) -> None:
    platform = select_platform("example", pm=create_plugin_manager(autoload=True))
    assert platform.kv_cache_memory_bytes(4096) == 2**30
    monkeypatch.setenv("PAGEDLM_EXAMPLE_MEMORY_GIB", "lots")
    with pytest.raises(ValueError, match="PAGEDLM_EXAMPLE_MEMORY_GIB must be a number"):
        platform.kv_cache_memory_bytes(4096)
