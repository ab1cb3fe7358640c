"""The step protocol on the wire: msgspec msgpack, nothing pickled.

Imported only where steps cross a process boundary (msgspec is part of the server extra).
The dataclasses are encoded as msgspec encodes dataclasses (their annotated fields), and the
one non-plain value, a numpy bitmask, as its dtype, shape and bytes.
"""

from __future__ import annotations

import functools
from typing import Any, TypeVar

import msgspec
import numpy as np

from pagedlm.step.runner_output import ModelRunnerOutput
from pagedlm.step.scheduler_output import GrammarBitmask, SchedulerOutput

T = TypeVar("T", SchedulerOutput, ModelRunnerOutput, GrammarBitmask)


def _enc_hook(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        return {"dtype": obj.dtype.str, "shape": list(obj.shape), "data": obj.tobytes()}
    raise NotImplementedError(f"the step protocol cannot encode {type(obj).__name__}")


def _dec_hook(type_: type, obj: Any) -> Any:
    if type_ is np.ndarray:
        array = np.frombuffer(obj["data"], dtype=np.dtype(obj["dtype"]))
        return array.reshape(obj["shape"]).copy()  # writable, owning its memory
    raise NotImplementedError(f"the step protocol cannot decode {type_.__name__}")


_encoder = msgspec.msgpack.Encoder(enc_hook=_enc_hook)


def encode(message: SchedulerOutput | ModelRunnerOutput | GrammarBitmask) -> bytes:
    return _encoder.encode(message)


@functools.cache
def _decoder(message_type: type) -> msgspec.msgpack.Decoder:
    # Building a decoder walks the type's fields (SamplingParams included): ~0.4 ms for a
    # SchedulerOutput, more than decoding a 256-request step, so each type builds one once.
    return msgspec.msgpack.Decoder(message_type, dec_hook=_dec_hook)


def decode(data: bytes | memoryview, message_type: type[T]) -> T:
    return _decoder(message_type).decode(data)
