"""The plugin system: hook specifications, the ``hookimpl`` marker, and the registry."""

from pagedlm.plugins.hookspecs import hookimpl
from pagedlm.plugins.specs import BackendSpec, ExecutorSpec, PlatformSpec

__all__ = ["BackendSpec", "ExecutorSpec", "PlatformSpec", "hookimpl"]
