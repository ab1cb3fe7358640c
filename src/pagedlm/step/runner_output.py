"""Workers -> scheduler: what one step computed, and the handle that delivers it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from pagedlm.step.kv_transfer import KVConnectorOutput
from pagedlm.step.multimodal import TensorData


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
    prefilled (a partial chunk); it holds one token per sampled position, so more than
    one once speculative decoding accepts drafts (then ``len - 1`` drafts were accepted).
    ``logprobs[req_id]`` has one row per sampled token. ``pooler_output[req_id]`` is a
    pooling model's vector for a request whose prompt finished this step, or for a
    token-wise task its rows, float32 ``[num_rows, dims]`` as ``TensorData``.
    ``draft_token_ids[req_id]`` are the tokens its proposer drafted for its next step (only
    for requests in ``SchedulerOutput.num_drafts_to_propose``; possibly fewer, or none).
    """

    req_ids: list[str]
    sampled_token_ids: list[list[int]]
    logprobs: dict[str, LogprobsLists] = field(default_factory=dict)
    prompt_logprobs: dict[str, LogprobsLists] = field(default_factory=dict)
    pooler_output: dict[str, list[float] | TensorData] = field(default_factory=dict)
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)
    kv_connector_output: KVConnectorOutput | None = None
    """A KV connector's outcome of the step's loads and saves (None: no connector)."""
    failed: dict[str, str] = field(default_factory=dict)
    """Requests that a callable of their own failed in this step (a custom logits
    processor raised), or whose LoRA adapter could not be read for it, with the message:
    their tokens of the step are not theirs, and the scheduler ends them with finish reason
    "error"."""


class StepResult(Protocol):
    """A launched step; ``result()`` waits for it and returns its output. Handles are
    collected once each, in launch order."""

    def result(self) -> ModelRunnerOutput: ...


class FinishedStep:
    """A step whose output is already known: ``result()`` returns it."""

    def __init__(self, output: ModelRunnerOutput) -> None:
        self.output = output

    def result(self) -> ModelRunnerOutput:
        return self.output
