"""Messages between the front end and the engine-core process, as msgspec structs.

Everything that crosses the ZMQ sockets is one of the structs below, encoded with
msgpack; nothing is pickled. Two tagged unions describe the two directions:
``FrontendMessage`` (front end -> core) and ``CoreMessage`` (core -> front end).

``WireSamplingParams`` is derived from the ``SamplingParams`` dataclass fields, so a field
added there travels without touching this module; ``WireRequest`` mirrors ``Request``'s
constructor (a test checks they stay in step). Step outputs travel as what they are:
msgspec encodes the ``EngineCoreOutput`` named tuple (an array) and its ``LogprobsLists``
natively, so neither side converts them per request per step.
"""

from __future__ import annotations

import dataclasses
import typing

import msgspec

from pagedlm.core.outputs import EngineCoreOutput
from pagedlm.core.request import Request
from pagedlm.core.scheduler_interface import SchedulerStats
from pagedlm.engine.arg_utils import EngineArgs
from pagedlm.lora.request import LoRARequest
from pagedlm.sampling_params import SamplingParams
from pagedlm.step.multimodal import MultiModalFeature, TensorData
from pagedlm.step.pooling import PoolingSpec

_SAMPLING_FIELDS = [f.name for f in dataclasses.fields(SamplingParams)]
_SAMPLING_HINTS = typing.get_type_hints(SamplingParams)

WireSamplingParams = msgspec.defstruct(
    "WireSamplingParams",
    [(name, _SAMPLING_HINTS[name]) for name in _SAMPLING_FIELDS],
    array_like=True,
    module=__name__,
)
"""A msgspec mirror of every ``SamplingParams`` dataclass field, in declaration order."""


def sampling_params_to_wire(params: SamplingParams) -> msgspec.Struct:
    return WireSamplingParams(*(getattr(params, name) for name in _SAMPLING_FIELDS))


def sampling_params_from_wire(wire: msgspec.Struct) -> SamplingParams:
    values = {name: getattr(wire, name) for name in _SAMPLING_FIELDS}
    params = SamplingParams(**values)
    # __post_init__ recomputes derived fields (all_stop_token_ids from stop_token_ids);
    # the front end already resolved them, so its values win.
    for name, value in values.items():
        setattr(params, name, value)
    return params


class WireRequest(msgspec.Struct, array_like=True):
    """The constructor arguments of one engine-core ``Request`` (one child of ``n``)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: WireSamplingParams  # type: ignore[valid-type]
    eos_token_ids: list[int]
    arrival_time: float
    cache_salt: str | None = None
    priority: int = 0
    lora_request: LoRARequest | None = None
    mm_features: list[MultiModalFeature] = []
    pooling: PoolingSpec | None = None
    prompt_embeds: TensorData | None = None
    reasoning_ended: bool | None = True


def request_to_wire(request: Request) -> WireRequest:
    return WireRequest(
        request.request_id,
        request.prompt_token_ids,
        sampling_params_to_wire(request.sampling_params),
        sorted(request.eos_token_ids),
        request.arrival_time,
        request.cache_salt,
        request.priority,
        request.lora_request,
        request.mm_features,
        request.pooling,
        request.prompt_embeds,
        request.reasoning_ended,
    )


def request_from_wire(wire: WireRequest) -> Request:
    return Request(
        wire.request_id,
        wire.prompt_token_ids,
        sampling_params_from_wire(wire.sampling_params),
        eos_token_ids=set(wire.eos_token_ids),
        arrival_time=wire.arrival_time,
        cache_salt=wire.cache_salt,
        priority=wire.priority,
        lora_request=wire.lora_request,
        mm_features=wire.mm_features,
        pooling=wire.pooling,
        prompt_embeds=wire.prompt_embeds,
        reasoning_ended=wire.reasoning_ended,
    )


# ----------------------------------------------------------------- front end -> core


class AddRequests(msgspec.Struct, tag=True):
    """The ``n`` children of one user request: the core adds all of them or none."""

    parent_id: str
    requests: list[WireRequest]


class AbortRequests(msgspec.Struct, tag=True):
    request_ids: list[str]
    """Engine-core (child) request ids; unknown ids are ignored."""


class UtilityCall(msgspec.Struct, tag=True):
    """A question answered by ``UtilityResult`` with the same ``call_id``."""

    call_id: int
    method: str
    """"ping" (liveness), "get_stats" (a fresh ``SchedulerStats``), or an admin call:
    "reset_prefix_cache", "pause" (``args``: [mode, clear_cache as 0/1]), "resume",
    "sleep" (``args``: [level]), "wake_up" (``args``: its tags, none for all),
    "update_weights_from_disk" (``args``: [model_path]), "add_lora" (``args``: [name,
    id, path]), "remove_lora" / "pin_lora" (``args``: [id]), "list_loras",
    "start_profile" (``args``: [directory]), "stop_profile"; or "collective_rpc"
    (``payload``)."""
    args: list[int | str] = []
    payload: bytes = b""
    """"collective_rpc": the call, as ``pagedlm.worker.rpc_codec.encode_call`` wrote it."""


class CoreStart(msgspec.Struct):
    """What the front end writes (JSON) on the engine-core process's stdin to start it."""

    engine_args: EngineArgs
    log_level: str = "WARNING"
    """The core's logging level (the server's ``--log-level``)."""
    log_config_path: str | None = None
    """A ``dictConfig`` JSON file that replaces the level (``--log-config-file``)."""


class Shutdown(msgspec.Struct, tag=True):
    """Leave the loop and exit cleanly."""


FrontendMessage = AddRequests | AbortRequests | UtilityCall | Shutdown


# ----------------------------------------------------------------- core -> front end


class Ready(msgspec.Struct, tag=True):
    """Sent once, after the model is loaded and the KV cache allocated."""

    num_kv_blocks: int
    stats: SchedulerStats


class CoreOutputs(msgspec.Struct, tag=True):
    """One step's outputs and the scheduler's stats right after it."""

    outputs: list[EngineCoreOutput]
    stats: SchedulerStats
    timestamp: float = 0.0
    """``time.monotonic()`` in the core when the step ended (vLLM's engine-core timestamp):
    a request's token times, so inter-token latencies do not depend on when the front end
    got round to the message (the clock is the machine's, shared by both processes)."""


class RequestRejected(msgspec.Struct, tag=True):
    """The core refused a user request (e.g. it can never fit in the KV cache)."""

    parent_id: str
    message: str


class UtilityResult(msgspec.Struct, tag=True):
    call_id: int
    stats: SchedulerStats | None = None
    error: str | None = None
    value: bool | list[int] | None = None
    """An admin call's answer (``reset_prefix_cache``: whether the cache was reset;
    ``wake_up``: whether a part still sleeps; ``list_loras``: the adapter ids)."""
    payload: bytes | None = None
    """"collective_rpc": its ``rpc_codec.RpcReply`` (results, or the error to raise)."""


class CoreFailed(msgspec.Struct, tag=True):
    """The core hit an unrecoverable error (startup or inside a step) and is exiting."""

    message: str


class Heartbeat(msgspec.Struct, tag=True):
    """Sent every half second by a thread of the core, whether or not a step is running
    (``core_heartbeat``); silence means the process is stopped, frozen or gone."""

    num_steps: int
    """Steps finished since the core started."""
    step_running_s: float | None
    """How long the current step has been computing (None between steps), not counting
    time the process was stopped."""
    step_tokens: int
    """An upper bound on the tokens the current step computes."""
    step_allowed_s: float
    """How long the current step may compute before the core counts as hung."""


CoreMessage = Ready | CoreOutputs | RequestRejected | UtilityResult | CoreFailed | Heartbeat


def make_encoder() -> msgspec.msgpack.Encoder:
    return msgspec.msgpack.Encoder()


def make_frontend_decoder() -> msgspec.msgpack.Decoder:
    """Decodes what the front end sends (used in the core process)."""
    return msgspec.msgpack.Decoder(FrontendMessage)


def make_core_decoder() -> msgspec.msgpack.Decoder:
    """Decodes what the core sends (used in the front end)."""
    return msgspec.msgpack.Decoder(CoreMessage)
