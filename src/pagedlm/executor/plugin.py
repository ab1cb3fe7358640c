"""Registers the core executors, through the same hooks third-party plugins use."""

from __future__ import annotations

from pagedlm.plugins.hookspecs import hookimpl
from pagedlm.plugins.specs import ExecutorSpec


@hookimpl
def pagedlm_register_executors(platform: object) -> list[ExecutorSpec]:
    return [
        ExecutorSpec(name="uni", target="pagedlm.executor.uniproc:UniprocExecutor"),
        ExecutorSpec(name="mp", target="pagedlm.executor.multiproc:MultiprocExecutor"),
        ExecutorSpec(name="ray", target="pagedlm.executor.ray_executor:RayExecutor"),
    ]
