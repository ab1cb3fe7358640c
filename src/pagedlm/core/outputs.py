"""Data that crosses the scheduler/executor boundary, once per step.

Everything here is plain data (no tensors, no callables) so that it can later be
serialized to worker processes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np

    from pagedlm.sampling_params import SamplingParams


@dataclass(frozen=True)
class NewRequestData:
    """A request the workers have not seen yet, or one resumed after preemption.

    ``token_ids`` holds every token known so far (prompt + outputs); ``block_ids`` the
    request's whole block table.
    """

    req_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int


@dataclass(frozen=True)
class CachedRequestData:
    """A request the workers already hold: only what changed since its last step.

    The workers append the token they sampled for it last step themselves.
    """

    req_id: str
    new_block_ids: list[int]
    num_computed_tokens: int


@dataclass(frozen=True)
class GrammarBitmask:
    """Allowed next tokens of the structured-output requests that sample this step.

    Row ``i`` of ``bitmask`` (numpy int32 ``[len(req_ids), ceil(vocab_size / 32)]``)
    belongs to ``req_ids[i]``; bit ``j`` of word ``w`` set = token ``32 * w + j`` allowed.
    """

    req_ids: list[str]
    bitmask: np.ndarray


@dataclass(frozen=True)
class SchedulerOutput:
    """What to compute this step.

    ``num_scheduled_tokens[req_id]`` tokens of each request are fed, starting at its
    ``num_computed_tokens``. The order of ``scheduled_new_reqs + scheduled_cached_reqs``
    is the order of rows in the flattened batch.
    """

    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: list[CachedRequestData]
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    finished_req_ids: set[str] = field(default_factory=set)
    """Requests that ended since the last step: workers drop their state."""
    preempted_req_ids: set[str] = field(default_factory=set)
    grammar_bitmask: GrammarBitmask | None = None
    """Token masks for constrained requests (None when no sampled request has a grammar)."""
    num_steps: int = 1
    """Decode steps to run back to back (multi-step decoding). Above 1, every request
    schedules one token, holds slots for ``num_steps`` tokens, and each step feeds the
    token the previous step sampled; the workers return ``num_steps`` tokens per request."""
    inputs_from_previous: bool = False
    """A window scheduled while the previous SchedulerOutput's window still runs (its
    tokens not yet seen by the host): each request's first input is the token the
    previous window sampled last, still on the workers' device. Its requests are a subset
    of the previous window's, and ``num_computed_tokens`` already counts that window."""

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


@dataclass(frozen=True)
class LogprobsLists:
    """Logprobs for a run of positions of one request.

    Row i holds ``token_ids[i]`` (the sampled or actual token first, then the top-k),
    their ``logprobs[i]`` and the first token's rank in ``ranks[i]``.
    """

    token_ids: list[list[int]]
    logprobs: list[list[float]]
    ranks: list[int]


@dataclass(frozen=True)
class ModelRunnerOutput:
    """One step's results, one entry per scheduled request (in batch order).

    ``sampled_token_ids[i]`` is empty for a request whose prompt is still being
    prefilled (a partial chunk), and may hold more than one token once speculative
    decoding accepts drafts.
    """

    req_ids: list[str]
    sampled_token_ids: list[list[int]]
    logprobs: dict[str, LogprobsLists] = field(default_factory=dict)
    prompt_logprobs: dict[str, LogprobsLists] = field(default_factory=dict)


@dataclass(frozen=True)
class EngineCoreOutput:
    """What happened to one request in one step, as reported to the front end."""

    req_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    new_logprobs: LogprobsLists | None = None
    new_prompt_logprobs: LogprobsLists | None = None
    num_cached_tokens: int = 0
    queued_seconds: float | None = None
    """Seconds from arrival to first scheduling (None until the request was scheduled)."""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
