"""The plugin system: hook specifications, the ``hookimpl`` marker, the registry, and the
version of the contract plugins are built for (``docs/plugins.md``)."""

from pagedlm.plugins.contract import CONTRACT_VERSION
from pagedlm.plugins.hookspecs import hookimpl
from pagedlm.plugins.specs import BackendSpec, ExecutorSpec, PlatformSpec

__all__ = ["CONTRACT_VERSION", "BackendSpec", "ExecutorSpec", "PlatformSpec", "hookimpl"]
