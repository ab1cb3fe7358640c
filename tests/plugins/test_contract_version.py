"""The plugin contract version: plugins built for another major version (or a newer minor,
or none declared) are refused at registration, with messages naming both versions."""

from __future__ import annotations

import logging
import textwrap
from pathlib import Path

import pytest

from pagedlm import hookimpl
from pagedlm.plugins import CONTRACT_VERSION, PlatformSpec
from pagedlm.plugins.contract import contract_refusal, parse_version
from pagedlm.plugins.registry import PluginError, create_plugin_manager, select_platform

CORE_MAJOR, CORE_MINOR = parse_version(CONTRACT_VERSION)


def plugin_for(version: str | None) -> object:
    class Plugin:
        @hookimpl
        def pagedlm_register_platforms(self):
            return [PlatformSpec(name="tpu", target="pagedlm_cpu.platform:CpuPlatform")]

    if version is not None:
        Plugin.PAGEDLM_CONTRACT_VERSION = version
    return Plugin()


def test_in_tree_packages_declare_the_current_contract() -> None:
    import pagedlm_cpu.plugin
    import pagedlm_cuda.plugin
    import pagedlm_rocm.plugin

    for module in (pagedlm_cpu.plugin, pagedlm_cuda.plugin, pagedlm_rocm.plugin):
        assert contract_refusal(module, module.__name__) is None


def test_same_major_older_or_equal_minor_is_accepted() -> None:
    pm = create_plugin_manager(autoload=False)
    assert pm.register(plugin_for(f"{CORE_MAJOR}.0"), name="tpu_plugin") == "tpu_plugin"
    assert select_platform("tpu", pm=pm).name == "cpu"  # its target is the CPU class
    assert not pm.refused


def test_another_major_is_refused_naming_both_versions(caplog) -> None:
    other = f"{CORE_MAJOR + 1}.0"
    pm = create_plugin_manager(autoload=True)
    with caplog.at_level(logging.WARNING):
        assert pm.register(plugin_for(other), name="tpu_plugin") is None
    assert "Refusing plugin 'tpu_plugin'" in caplog.text
    assert pm.get_plugin("tpu_plugin") is None
    with pytest.raises(PluginError) as info:
        select_platform("tpu", pm=pm)
    message = str(info.value)
    assert "Unknown platform 'tpu'" in message
    assert f"built for plugin contract {other}" in message
    assert f"implements contract {CONTRACT_VERSION}" in message
    # A refused plugin leaves the others usable.
    assert select_platform("cpu", pm=pm).name == "cpu"


@pytest.mark.parametrize(
    ("version", "expected"),
    [
        (None, f'add PAGEDLM_CONTRACT_VERSION = "{CONTRACT_VERSION}"'),
        (f"{CORE_MAJOR}.{CORE_MINOR + 1}", "upgrade pagedlm"),
        ("1", "not a contract version of the form 'MAJOR.MINOR'"),
        (1.0, "not a contract version"),
    ],
)
def test_missing_newer_or_malformed_versions_are_refused(version, expected) -> None:
    pm = create_plugin_manager(autoload=False)
    assert pm.register(plugin_for(version), name="tpu_plugin") is None
    assert expected in pm.refused["tpu_plugin"]


def test_entry_point_of_an_old_plugin_is_refused(tmp_path: Path, monkeypatch) -> None:
    """The real discovery path: a distribution whose entry point names a plugin module
    built for an older major version."""
    old = f"{CORE_MAJOR - 1}.4" if CORE_MAJOR > 0 else f"{CORE_MAJOR + 1}.0"
    (tmp_path / "old_tpu_plugin.py").write_text(
        textwrap.dedent(
            f"""
            from pagedlm import hookimpl
            from pagedlm.plugins import PlatformSpec

            PAGEDLM_CONTRACT_VERSION = "{old}"

            @hookimpl
            def pagedlm_register_platforms():
                return [PlatformSpec(name="old_tpu", target="x:Y")]
            """
        )
    )
    dist_info = tmp_path / "old_tpu-0.1.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: old-tpu\nVersion: 0.1\n")
    (dist_info / "entry_points.txt").write_text("[pagedlm]\nold_tpu = old_tpu_plugin\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    pm = create_plugin_manager(autoload=True)
    assert "old_tpu" in pm.refused and pm.get_plugin("old_tpu") is None
    with pytest.raises(PluginError, match=rf"'old_tpu' was built for plugin contract {old}"):
        select_platform("old_tpu", pm=pm)
