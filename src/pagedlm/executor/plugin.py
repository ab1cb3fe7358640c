"""Registers the core executors, through the same hooks third-party plugins use."""

from __future__ import annotations

from pagedlm.plugins.hookspecs import hookimpl
from pagedlm.plugins.specs import ExecutorSpec


@hookimpl
def pagedlm_register_executors(platform: object) -> list[ExecutorSpec]:
    return [ExecutorSpec(name="uniproc", target="pagedlm.executor.uniproc:UniprocExecutor")]
