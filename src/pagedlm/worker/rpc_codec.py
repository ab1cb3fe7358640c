"""``collective_rpc`` across processes: msgspec msgpack, nothing pickled.

Used where a call or its results leave the process: engine -> worker processes (the "mp"
and "ray" executors, ``executor/worker_messages.py``) and the ``AsyncLLM`` front end ->
its engine-core process (``engine/messages.py``).

What crosses:

- values msgspec encodes: None, bool, int, float, str, bytes, lists, tuples, dicts,
  dataclasses and msgspec Structs, enums, datetimes. They arrive as msgpack decodes them
  untyped: tuples and sets as lists, dataclasses and Structs as dicts;
- functions and classes by importable name (``module:qualname``, a msgpack extension of
  code ``FUNCTION_EXT``), imported again on arrival: the ``method`` of a call, or an
  argument such as ``apply_model``'s function. A lambda, a closure, a bound method or
  anything defined in ``__main__`` has no name another process can import, and is refused.

Anything else (a tensor, an arbitrary object) is refused with a ``TypeError`` that says
what to pass instead, before anything is sent.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import msgspec

from pagedlm.qualified_names import import_object, qualified_name
from pagedlm.worker.rpc import RpcMethod, WorkerRpcError

FUNCTION_EXT = 1
"""msgpack extension code of a function or class sent by its importable name."""


class RpcCall(msgspec.Struct, frozen=True):
    method: Any
    """A worker method's name (str) or a function (sent by name)."""
    args: list[Any]
    kwargs: dict[str, Any]
    timeout: float | None = None
    """Seconds the engine core waits for its workers (``AsyncLLM`` -> engine core only)."""


class RpcFailure(msgspec.Struct, frozen=True):
    """An engine core's refusal of a call, rebuilt as the same exception by the front end."""

    kind: str
    """The exception: "worker" (``WorkerRpcError``), "timeout", "type", "value" or
    "unsupported" (``NotImplementedError``)."""
    message: str
    rank: int = -1
    method: str = ""


class RpcReply(msgspec.Struct, frozen=True):
    """An engine core's answer to ``AsyncLLM.collective_rpc``."""

    results: list[Any] = []
    failure: RpcFailure | None = None


TENSOR_HINT = (
    " Tensors do not cross: send small ones as .tolist(), and move weights over a "
    "torch.distributed group that a --worker-extension-cls method sets up (vLLM's pattern: "
    "collective_rpc for control messages), or save them and call update_weights_from_disk."
)


def importable_name(obj: Any, where: str) -> str:
    """``module:qualname`` of a function or class that another process can import."""
    name = qualified_name(obj)
    try:
        importable = obj.__module__ != "__main__" and import_object(name, "") is obj
    except (ValueError, AttributeError):
        importable = False
    if not importable:
        raise TypeError(
            f"collective_rpc cannot send the function {name!r} {where}: it has no name "
            "another process can import, and nothing is pickled. Define it at the top "
            "level of an importable module (not __main__), or make it a method of a "
            "--worker-extension-cls class and pass the method's name."
        )
    return name


def _encode_hook(where: str) -> Callable[[Any], Any]:
    def hook(obj: Any) -> Any:
        if isinstance(obj, types.FunctionType | types.BuiltinFunctionType | type):
            return msgspec.msgpack.Ext(FUNCTION_EXT, importable_name(obj, where).encode())
        kind = f"{type(obj).__module__}.{type(obj).__qualname__}"
        raise TypeError(
            f"collective_rpc cannot send a {kind} {where} (nothing is pickled); pass "
            "msgspec-encodable values (None, bool, int, float, str, bytes, lists, tuples, "
            "dicts, dataclasses, msgspec Structs) and functions or classes by importable "
            "name." + TENSOR_HINT
        )

    return hook


def _ext_hook(code: int, data: memoryview) -> Any:
    if code != FUNCTION_EXT:
        raise ValueError(f"collective_rpc: unknown msgpack extension {code}")
    return import_object(bytes(data).decode(), "collective_rpc function")


_call_encoder = msgspec.msgpack.Encoder(enc_hook=_encode_hook("to the workers"))
_value_encoder = msgspec.msgpack.Encoder(enc_hook=_encode_hook("back from a worker"))
_call_decoder = msgspec.msgpack.Decoder(RpcCall, ext_hook=_ext_hook)
_value_decoder = msgspec.msgpack.Decoder(ext_hook=_ext_hook)
_reply_decoder = msgspec.msgpack.Decoder(RpcReply, ext_hook=_ext_hook)


def _encode(encoder: msgspec.msgpack.Encoder, message: Any) -> bytes:
    try:
        return encoder.encode(message)
    except TypeError:
        raise
    except (OverflowError, ValueError, msgspec.EncodeError) as error:
        raise TypeError(f"collective_rpc cannot encode its values ({error}).") from None


def encode_call(
    method: RpcMethod,
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    timeout: float | None = None,
) -> bytes:
    return _encode(_call_encoder, RpcCall(method, list(args), dict(kwargs), timeout))


def decode_call(data: bytes | memoryview) -> RpcCall:
    return _call_decoder.decode(data)


def encode_value(value: Any) -> bytes:
    """A worker's result (or an engine core's list of them)."""
    return _encode(_value_encoder, value)


def decode_value(data: bytes | memoryview) -> Any:
    return _value_decoder.decode(data)


# ---- AsyncLLM front end <-> engine core ----------------------------------------------


def answer(run: Callable[..., list[Any]], payload: bytes | memoryview) -> bytes:
    """The engine core's side: run a decoded call with ``run(method, timeout, args,
    kwargs)`` and encode its results, or the caller's and the workers' errors, as an
    ``RpcReply``. Other exceptions (a worker that died) propagate: the core cannot go on."""
    try:
        call = decode_call(payload)
        results = run(call.method, call.timeout, call.args, call.kwargs)
        return encode_value(RpcReply(results=results))
    except WorkerRpcError as error:
        failure = RpcFailure("worker", str(error), error.rank, error.method)
    except TimeoutError as error:
        failure = RpcFailure("timeout", str(error))
    except TypeError as error:
        failure = RpcFailure("type", str(error))
    except ValueError as error:
        failure = RpcFailure("value", str(error))
    except NotImplementedError as error:
        failure = RpcFailure("unsupported", str(error))
    return encode_value(RpcReply(failure=failure))


_FAILURES: dict[str, type[Exception]] = {
    "timeout": TimeoutError,
    "type": TypeError,
    "value": ValueError,
    "unsupported": NotImplementedError,
}


def results_of(reply: bytes | memoryview) -> list[Any]:
    """The front end's side: the results of ``answer``'s reply, or its error raised."""
    decoded = _reply_decoder.decode(reply)
    failure = decoded.failure
    if failure is None:
        return decoded.results
    if failure.kind == "worker":
        raise WorkerRpcError(failure.message, failure.rank, failure.method)
    raise _FAILURES.get(failure.kind, RuntimeError)(failure.message)
