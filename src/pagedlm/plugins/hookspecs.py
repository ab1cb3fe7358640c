"""Every hook a pagedlm plugin can implement.

A plugin is a module (or any object) with functions decorated by ``pagedlm.hookimpl`` and
the contract version it is built for (``PAGEDLM_CONTRACT_VERSION = "1.0"``; a plugin built
for another major version is refused, see ``contract.py``), made known through the
``pagedlm`` entry-point group::

    [project.entry-points.pagedlm]
    my_tpu = "my_tpu_plugin.plugin"

The in-tree hardware packages (``pagedlm_cpu``, ``pagedlm_cuda``, ``pagedlm_rocm``) are
registered exactly this way; ``docs/plugins.md`` is the author's guide, and
``pagedlm.testing`` checks a plugin against the contract. Set ``PAGEDLM_DISABLE_PLUGIN_AUTOLOAD=1`` to load no entry
points; ``PAGEDLM_PLUGINS=mod1,mod2`` then names modules to load explicitly.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from pagedlm.config import EngineConfig
    from pagedlm.platforms import Platform
    from pagedlm.plugins.specs import BackendSpec, ExecutorSpec, PlatformSpec

PROJECT_NAME = "pagedlm"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)
"""Marker for plugin hook implementations (public API: ``from pagedlm import hookimpl``)."""


@hookspec
def pagedlm_register_platforms() -> list[PlatformSpec]:
    """Return the platforms this plugin provides.

    Called once when the registry is built. Selection order: the explicit ``platform=``
    argument, then ``PAGEDLM_PLATFORM``, then the available platform of highest priority
    (a tie is an error). Probes run lazily and their failures are reported.
    """


@hookspec
def pagedlm_register_attention_backends(platform: Platform) -> list[BackendSpec]:
    """Return attention backends that run on ``platform`` (return [] for others).

    The platform's ``default_attention_backend`` is used unless the user names another
    (``attention_backend=``); a spec's ``name`` must equal its class's ``name``.
    """


@hookspec
def pagedlm_register_executors(platform: Platform) -> list[ExecutorSpec]:
    """Return executors that can drive ``platform`` (e.g. uniproc, multiproc, ray).

    The one named by the engine config's ``executor`` is used, else the platform's
    ``default_executor``.
    """


@hookspec
def pagedlm_configure(config: EngineConfig, platform: Platform) -> EngineConfig | None:
    """Adjust the engine configuration for ``platform`` before the engine starts.

    Return a new config (``dataclasses.replace``) or None to keep it. Implementations
    run in registration order, each seeing the previous one's result.
    """
