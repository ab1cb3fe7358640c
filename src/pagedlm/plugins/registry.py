"""Builds the plugin manager and selects platforms, attention backends and executors."""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, TypeVar

import pluggy

from pagedlm.plugins import hookspecs
from pagedlm.plugins.contract import contract_refusal
from pagedlm.plugins.specs import BackendSpec, ExecutorSpec, PlatformSpec, import_target

if TYPE_CHECKING:
    from pagedlm.attention import AttentionBackend
    from pagedlm.config import EngineConfig
    from pagedlm.executor import Executor
    from pagedlm.platforms import Platform

logger = logging.getLogger(__name__)

AUTOLOAD_ENV = "PAGEDLM_DISABLE_PLUGIN_AUTOLOAD"
EXPLICIT_PLUGINS_ENV = "PAGEDLM_PLUGINS"
PLATFORM_ENV = "PAGEDLM_PLATFORM"

# Core components every platform can use, registered like any other plugin.
_BUILTIN_PLUGINS = ("pagedlm.executor.plugin",)

_S = TypeVar("_S", PlatformSpec, BackendSpec, ExecutorSpec)


class PluginError(ValueError):
    """A component was asked for that no plugin provides or that cannot run here."""


class PluginManager(pluggy.PluginManager):
    """pluggy's manager, refusing plugins built for another contract version.

    Every registration goes through ``register`` (entry points, ``PAGEDLM_PLUGINS``, tests),
    so a refused plugin contributes no hook; the reason is logged and kept in ``refused``
    (name -> reason) for the selection errors to repeat. Core's own modules
    (``_BUILTIN_PLUGINS``) are versioned with core and not checked.
    """

    def __init__(self) -> None:
        super().__init__(hookspecs.PROJECT_NAME)
        self.add_hookspecs(hookspecs)
        self.refused: dict[str, str] = {}

    def register(self, plugin: object, name: str | None = None) -> str | None:
        plugin_name = name or self.get_canonical_name(plugin)
        if plugin_name not in _BUILTIN_PLUGINS:
            reason = contract_refusal(plugin, plugin_name)
            if reason is not None:
                logger.warning("Refusing plugin %r: %s", plugin_name, reason)
                self.refused[plugin_name] = reason
                # Blocked, so that loading entry points again does not import it again.
                self.set_blocked(plugin_name)
                return None
        return super().register(plugin, name)


def create_plugin_manager(autoload: bool | None = None) -> PluginManager:
    """A fresh manager with the built-ins, entry points (unless disabled) and
    ``PAGEDLM_PLUGINS`` modules registered."""
    import importlib

    pm = PluginManager()
    for name in _BUILTIN_PLUGINS:
        pm.register(importlib.import_module(name), name=name)
    if autoload is None:
        autoload = os.environ.get(AUTOLOAD_ENV, "").lower() not in ("1", "true", "yes")
    if autoload:
        pm.load_setuptools_entrypoints(hookspecs.PROJECT_NAME)
    for name in filter(None, os.environ.get(EXPLICIT_PLUGINS_ENV, "").split(",")):
        name = name.strip()
        if pm.get_plugin(name) is None and not pm.is_blocked(name):
            pm.register(importlib.import_module(name), name=name)
    return pm


@functools.lru_cache(maxsize=1)
def get_plugin_manager() -> PluginManager:
    """The process-wide manager (built on first use)."""
    return create_plugin_manager()


def _collect(results: Sequence[Sequence[_S] | None]) -> list[_S]:
    return [spec for specs in results if specs for spec in specs]


def _probe(spec: PlatformSpec) -> tuple[bool, str]:
    try:
        ok = bool(spec.is_available())
    except Exception as exc:  # a broken probe is reported, never swallowed silently
        logger.warning("Platform %r probe failed: %s", spec.name, exc)
        return False, f"its probe failed: {type(exc).__name__}: {exc}"
    return ok, "" if ok else "not available on this machine (its probe returned False)"


def _describe(probes: dict[str, tuple[bool, str]], pm: pluggy.PluginManager) -> str:
    known = ", ".join(
        f"{name} ({'available' if ok else why})" for name, (ok, why) in sorted(probes.items())
    )
    return (known or "none") + _refusals(pm)


def _refusals(pm: pluggy.PluginManager) -> str:
    """The refused plugins, for error messages: a platform a user asks for may be in one."""
    refused = getattr(pm, "refused", {})
    if not refused:
        return ""
    return "; refused plugins: " + "; ".join(
        reason.rstrip(".") for _, reason in sorted(refused.items())
    )


def registered_platforms(pm: pluggy.PluginManager | None = None) -> dict[str, PlatformSpec]:
    """Every registered platform by name, available or not (probes are not run)."""
    pm = pm or get_plugin_manager()
    by_name: dict[str, PlatformSpec] = {}
    for spec in _collect(pm.hook.pagedlm_register_platforms()):
        if spec.name in by_name:
            raise PluginError(f"Two plugins register a platform named {spec.name!r}.")
        by_name[spec.name] = spec
    return by_name


def select_platform(name: str | None = None, pm: pluggy.PluginManager | None = None) -> Platform:
    """The platform named (argument, then ``PAGEDLM_PLATFORM``) or the best available."""
    pm = pm or get_plugin_manager()
    by_name = registered_platforms(pm)
    if not by_name:
        raise PluginError(
            "No platform is registered. Install pagedlm with its hardware packages, or if "
            f"{AUTOLOAD_ENV} is set, name plugins in {EXPLICIT_PLUGINS_ENV} "
            f"(e.g. PAGEDLM_PLUGINS=pagedlm_cpu.plugin){_refusals(pm)}."
        )
    name = name or os.environ.get(PLATFORM_ENV) or None
    probes = {spec.name: _probe(spec) for spec in by_name.values()}
    if name is not None:
        if name not in by_name:
            raise PluginError(
                f"Unknown platform {name!r}; known platforms: {_describe(probes, pm)}."
            )
        ok, why = probes[name]
        if not ok:
            raise PluginError(
                f"Platform {name!r} cannot be used: {why}; known platforms: "
                f"{_describe(probes, pm)}."
            )
        chosen = by_name[name]
    else:
        available = [s for s in by_name.values() if probes[s.name][0]]
        if not available:
            raise PluginError(
                f"No platform is available; known platforms: {_describe(probes, pm)}."
            )
        best = max(s.priority for s in available)
        top = [s for s in available if s.priority == best]
        if len(top) > 1:
            names = ", ".join(sorted(s.name for s in top))
            raise PluginError(
                f"Platforms {names} are available with the same priority {best}; "
                f"choose one with platform= or {PLATFORM_ENV}."
            )
        chosen = top[0]
    platform_cls = import_target(chosen.target)
    return platform_cls()


def _select_component(
    kind: str,
    specs: list[_S],
    name: str | None,
    default: str | None,
    fits: Callable[[_S], bool],
) -> _S:
    usable = [s for s in specs if fits(s)]
    known = ", ".join(sorted(s.name for s in usable)) or "none"
    wanted = name or default
    if wanted is not None:
        for spec in usable:
            if spec.name == wanted:
                return spec
        raise PluginError(f"Unknown {kind} {wanted!r}; known for this platform: {known}.")
    if not usable:
        raise PluginError(f"No {kind} is registered for this platform.")
    return max(usable, key=lambda s: s.priority)


def select_attention_backend(
    platform: Platform, name: str | None = None, pm: pluggy.PluginManager | None = None
) -> type[AttentionBackend]:
    spec = _select_component(
        "attention backend",
        attention_backends_for(platform, pm),
        name,
        getattr(platform, "default_attention_backend", None),
        lambda s: True,
    )
    return import_target(spec.target)


def attention_backends_for(
    platform: Platform, pm: pluggy.PluginManager | None = None
) -> list[BackendSpec]:
    """The attention backends registered for ``platform`` (its name in ``spec.platform``)."""
    pm = pm or get_plugin_manager()
    specs = _collect(pm.hook.pagedlm_register_attention_backends(platform=platform))
    return [spec for spec in specs if spec.platform == platform.name]


def select_executor(
    platform: Platform, name: str | None = None, pm: pluggy.PluginManager | None = None
) -> type[Executor]:
    pm = pm or get_plugin_manager()
    specs = _collect(pm.hook.pagedlm_register_executors(platform=platform))
    spec = _select_component(
        "executor",
        specs,
        name,
        platform.default_executor,
        lambda s: not s.platforms or platform.name in s.platforms,
    )
    return import_target(spec.target)


def configure(
    config: EngineConfig, platform: Platform, pm: pluggy.PluginManager | None = None
) -> EngineConfig:
    """Let every plugin adjust the config in turn (see ``pagedlm_configure``)."""
    pm = pm or get_plugin_manager()
    for impl in pm.hook.pagedlm_configure.get_hookimpls():
        result = impl.function(config=config, platform=platform)
        if result is not None:
            config = result
    return config
