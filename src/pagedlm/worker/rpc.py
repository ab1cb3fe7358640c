"""``collective_rpc`` on a worker (vLLM's worker RPC): what a call names and how it runs.

A call names a method of the worker (``Worker``'s own, such as ``apply_model``, or one a
``--worker-extension-cls`` mixes in, ``pagedlm.worker.extension``) or passes a function
that takes the worker as its first argument. Every worker of the engine runs it with the
same arguments; the results come back one per worker, in rank order.

What may be passed depends on where the workers run. A worker in the engine's process
(the "uni" executor) takes any Python values and returns any. A worker in another process
("mp", "ray") gets the call through ``rpc_codec``, which pickles nothing: msgspec-encodable
values, and functions or classes by their importable names.

Invariant: an exception raised by the method reaches the caller as ``WorkerRpcError``
naming the rank and the method; the worker, and the engine, carry on.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

RpcMethod = str | Callable[..., Any]
"""A method name on the worker, or a function called as ``function(worker, *args, **kwargs)``."""


class WorkerRpcError(RuntimeError):
    """A worker's ``collective_rpc`` call raised; ``rank`` is the first rank that did."""

    def __init__(self, message: str, rank: int, method: str) -> None:
        super().__init__(message)
        self.rank = rank
        self.method = method


def method_label(method: RpcMethod) -> str:
    """How errors name a call: the method's name, or the function's qualified name."""
    if isinstance(method, str):
        return method
    module = getattr(method, "__module__", None)
    name = getattr(method, "__qualname__", None) or type(method).__name__
    return f"{module}:{name}" if module else name


def check_call(method: RpcMethod, timeout: float | None) -> None:
    """The caller's mistakes, refused before any worker sees the call."""
    if not isinstance(method, str) and not callable(method):
        raise TypeError(
            f"collective_rpc takes a worker method's name or a function, not a "
            f"{type(method).__name__}."
        )
    if timeout is not None and not (isinstance(timeout, int | float) and timeout > 0):
        raise ValueError(f"collective_rpc timeout={timeout!r}: give seconds above 0, or None.")
    if isinstance(timeout, float) and math.isinf(timeout):
        raise ValueError("collective_rpc timeout=inf: pass None to wait without a bound.")


def run_on_worker(
    worker: Any, method: RpcMethod, args: Sequence[Any], kwargs: Mapping[str, Any]
) -> Any:
    """Run one call on ``worker`` (its exceptions propagate)."""
    if not isinstance(method, str):
        return method(worker, *args, **kwargs)
    target = getattr(worker, method, None)
    if target is None or not callable(target):
        raise AttributeError(
            f"the worker ({type(worker).__name__}) has no method {method!r}; add it with "
            "--worker-extension-cls (worker_extension_cls=), or pass a function that takes "
            "the worker as its first argument."
        )
    return target(*args, **kwargs)


def call_on_worker(
    worker: Any, rank: int, method: RpcMethod, args: Sequence[Any], kwargs: Mapping[str, Any]
) -> Any:
    """``run_on_worker`` for a worker in this process: its exception as ``WorkerRpcError``."""
    try:
        return run_on_worker(worker, method, args, kwargs)
    except Exception as error:
        label = method_label(method)
        raise WorkerRpcError(
            failure_message(label, [rank], f"{type(error).__name__}: {error}"), rank, label
        ) from error


def failure_message(label: str, ranks: list[int], error: str) -> str:
    which = "rank" if len(ranks) == 1 else "ranks"
    return (
        f"collective_rpc {label!r} failed on worker {which} {', '.join(map(str, ranks))}: {error}"
    )
