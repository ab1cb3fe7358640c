"""What an executor and its worker processes say to each other: msgspec, nothing pickled.

Executor -> workers, one broadcast reaching every rank: a header (a tagged ``WorkerCall``)
and, for the two step calls, a second frame holding the step message as
``pagedlm.step.codec`` encodes it (for ``CollectiveRpc``, the call as
``pagedlm.worker.rpc_codec`` encodes it). Workers -> executor: a ``WorkerReply``, plus the
``ModelRunnerOutput`` frame of a step, which only the output rank sends (and each rank's
``collective_rpc`` result).

A worker's configuration travels once, at start-up, as a ``WorkerSpec`` (JSON on the
worker's stdin, or a Ray actor's argument).
"""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np
import torch

from pagedlm.config import EngineConfig

# ---- executor -> workers -------------------------------------------------------------


class ExecuteModel(msgspec.Struct, tag=True, frozen=True):
    """Frame 2: the step's ``SchedulerOutput``."""


class SampleTokens(msgspec.Struct, tag=True, frozen=True):
    """Frame 2: the step's ``GrammarBitmask``, or empty when no row is constrained."""

    step_id: int
    has_bitmask: bool


class DetermineKvBlocks(msgspec.Struct, tag=True, frozen=True):
    """Every rank answers ``KvBlocks``."""


class InitializeKvCache(msgspec.Struct, tag=True, frozen=True):
    """Every rank allocates ``num_blocks`` blocks and answers ``Done``."""

    num_blocks: int


class Sleep(msgspec.Struct, tag=True, frozen=True):
    """Every rank sleeps at ``level`` (``Worker.sleep``) and answers ``Done``."""

    level: int


class WakeUp(msgspec.Struct, tag=True, frozen=True):
    """Every rank wakes the parts ``tags`` names (``Worker.wake_up``; None: all) and
    answers ``Done``, or ``Refused`` (an unknown tag, the KV cache before the weights)."""

    tags: list[str] | None = None


class ReloadWeights(msgspec.Struct, tag=True, frozen=True):
    """Every rank loads its shard of the checkpoint at ``model_path``
    (``Worker.reload_weights``) and answers ``Done``, or ``Refused`` having loaded its last
    checkpoint again."""

    model_path: str


class CollectiveRpc(msgspec.Struct, tag=True, frozen=True):
    """Frame 2: the call (``rpc_codec.encode_call``). Every rank runs it and answers
    ``RpcResult`` with this ``call_id``."""

    call_id: int


class Shutdown(msgspec.Struct, tag=True, frozen=True):
    pass


WorkerCall = (
    ExecuteModel
    | SampleTokens
    | DetermineKvBlocks
    | InitializeKvCache
    | Sleep
    | WakeUp
    | ReloadWeights
    | CollectiveRpc
    | Shutdown
)

# ---- workers -> executor -------------------------------------------------------------


class Ready(msgspec.Struct, tag=True, frozen=True):
    """The worker built its model and subscribed to the broadcast."""

    rank: int


class KvBlocks(msgspec.Struct, tag=True, frozen=True):
    rank: int
    num_blocks: int


class Done(msgspec.Struct, tag=True, frozen=True):
    rank: int


class StepOutput(msgspec.Struct, tag=True, frozen=True):
    """Frame 2: the step's ``ModelRunnerOutput``."""

    step_id: int


class Refused(msgspec.Struct, tag=True, frozen=True):
    """An admin call the worker declined (a ``ValueError``: its message); it carries on."""

    rank: int
    message: str


class RpcResult(msgspec.Struct, tag=True, frozen=True):
    """A rank's answer to ``CollectiveRpc``. Frame 2, when ``error`` is None: the method's
    return value (``rpc_codec.encode_value``). Otherwise ``error`` is its exception (one
    line) and ``traceback`` where it was raised; the worker carries on."""

    rank: int
    call_id: int
    error: str | None = None
    traceback: str = ""


class Failed(msgspec.Struct, tag=True, frozen=True):
    """The worker hit an exception (its traceback) and exits."""

    rank: int
    message: str


WorkerReply = Ready | KvBlocks | Done | Refused | StepOutput | RpcResult | Failed


# ---- start-up ------------------------------------------------------------------------


class WorkerSpec(msgspec.Struct, frozen=True):
    """Everything a worker process needs to join its executor."""

    rank: int
    local_rank: int
    """The device index on its node."""
    distributed_init_method: str
    """``torch.distributed`` rendezvous, e.g. ``tcp://127.0.0.1:29500``."""
    broadcast_address: str
    """Where the executor publishes ``WorkerCall``s (ZMQ)."""
    reply_address: str
    """Where workers push ``WorkerReply``s (ZMQ)."""
    parent_pid: int
    """The engine process; a worker whose parent changes exits (0: do not watch)."""
    die_with_parent: bool
    """Have the kernel kill the worker with the thread that started it (Linux): only
    when that is the engine's main thread, which lives as long as the engine."""
    config: msgspec.Raw
    """The ``EngineConfig``, as ``encode_config`` wrote it."""


def _enc_hook(obj: Any) -> Any:
    if isinstance(obj, torch.dtype):
        return str(obj).removeprefix("torch.")
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, type):  # a custom logits processor class: its importable name
        from pagedlm.sample.logits_processor import portable_name

        return portable_name(obj)
    raise NotImplementedError(f"cannot send {type(obj).__name__} to a worker")


def _dec_hook(type_: type, obj: Any) -> Any:
    if type_ is torch.dtype:
        dtype = getattr(torch, obj, None)
        if isinstance(dtype, torch.dtype):
            return dtype
    raise NotImplementedError(f"a worker cannot decode {type_.__name__} from {obj!r}")


_json_encoder = msgspec.json.Encoder(enc_hook=_enc_hook)
_msgpack_encoder = msgspec.msgpack.Encoder()
_call_decoder = msgspec.msgpack.Decoder(WorkerCall)
_reply_decoder = msgspec.msgpack.Decoder(WorkerReply)


def encode_config(config: EngineConfig) -> bytes:
    return _json_encoder.encode(config)


def decode_config(data: bytes) -> EngineConfig:
    return msgspec.json.decode(data, type=EngineConfig, dec_hook=_dec_hook)


def encode_spec(spec: WorkerSpec) -> bytes:
    return _json_encoder.encode(spec)


def decode_spec(data: bytes) -> WorkerSpec:
    return msgspec.json.decode(data, type=WorkerSpec)


def encode(message: msgspec.Struct) -> bytes:
    return _msgpack_encoder.encode(message)


def decode_call(data: bytes | memoryview) -> WorkerCall:
    return _call_decoder.decode(data)


def decode_reply(data: bytes | memoryview) -> WorkerReply:
    return _reply_decoder.decode(data)
