"""What the engine core reports to the front end about each request, once per step."""

from __future__ import annotations

from typing import NamedTuple

from pagedlm.step import LogprobsLists, TensorData


class EngineCoreOutput(NamedTuple):
    """What happened to one request in one step, as reported to the front end.

    A named tuple: a step makes one per request that produced something, and a tuple is
    built several times faster than a frozen dataclass.
    """

    req_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    new_logprobs: LogprobsLists | None = None
    new_prompt_logprobs: LogprobsLists | None = None
    num_cached_tokens: int = 0
    queued_seconds: float | None = None
    """Seconds from arrival to first scheduling (None until the request was scheduled)."""
    pooled: list[float] | TensorData | None = None
    """A pooling request's vector (float32 values, before normalization), or a token-wise
    task's rows (float32 ``[num_rows, dims]``), in the output that finishes it."""
    engine_index: int = 0
    """The data-parallel replica that ran the request (``engine.data_parallel``; 0 with one
    engine): the ``engine`` label of its metrics, as vLLM's engine index."""
    num_external_computed_tokens: int = 0
    """Of ``num_cached_tokens``, the tokens a KV connector loaded (vLLM's name); the rest
    hit the local prefix cache (``prompt_tokens_by_source``)."""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
