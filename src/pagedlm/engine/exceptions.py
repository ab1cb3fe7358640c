"""Errors the front end raises about the engine core itself, and about one request the
core failed while serving the others."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

FAILED = "error"
"""The finish reason of a sample the engine core failed (vLLM's ``FinishReason.ERROR``): a
callable of its own, a custom logits processor, raised in a step, or its LoRA adapter could
not be read when a step needed it; its stop reason says how."""


class EngineDeadError(RuntimeError):
    """The engine-core process died, was shut down, or stopped answering.

    Every pending and future call on the engine raises this; build a new engine to
    continue.
    """


class EngineStalledError(RuntimeError):
    """The engine-core process is alive but makes no progress: it is stopped (SIGSTOP),
    frozen, or hung inside a step. It may recover (SIGCONT); requests are not failed."""


class RequestFailedError(RuntimeError):
    """The engine core failed this request (finish reason "error"): a custom logits
    processor raised for it in a step, or its LoRA adapter could not be read when a step
    needed it. The engine and its other requests carry on.

    ``request_id`` and ``message`` (the processor or adapter, and why); ``outputs``: where a
    call ran several requests (``LLM.generate``, ``LLM.embed``, ...), every one's final
    output in order, the others complete (as the call returns them) and the failed ones
    ending with finish reason "error" (a ``RequestOutput``, also for a pooling call)."""

    def __init__(self, request_id: str, message: str, outputs: Sequence[Any] | None = None) -> None:
        super().__init__(f"Request {request_id!r} failed: {message}")
        self.request_id = request_id
        self.message = message
        self.outputs = list(outputs) if outputs is not None else None


def request_failure(output: Any) -> str | None:
    """The message of a request output one of whose samples the core failed, else None.
    A pooling request the core failed pooled nothing: its output is a ``RequestOutput``
    whose one sample says so, as a generating request's is."""
    samples = getattr(output, "outputs", None)
    if not isinstance(samples, list):  # a pooled output: its request finished pooling
        return None
    for sample in samples:
        if getattr(sample, "finish_reason", None) == FAILED:
            return str(sample.stop_reason)
    return None
