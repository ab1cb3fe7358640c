"""What the user gets back: ``RequestOutput`` holding one ``CompletionOutput`` per sample."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from pagedlm.lora.request import LoRARequest


class Logprob(NamedTuple):
    """One candidate token's log-probability and its rank (1 = most likely)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


SampleLogprobs = list[dict[int, Logprob]]
"""One dict per generated token: token id -> Logprob (sampled token plus the top-k)."""
PromptLogprobs = list[dict[int, Logprob] | None]
"""One entry per prompt position; the first is None (nothing predicts it)."""


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None
    """"stop" (EOS, stop token or stop string), "length" (max_tokens or context), "abort"."""
    stop_reason: int | str | None = None
    """The stop string or stop token id that ended the sample; None for EOS or length."""
    num_cached_tokens: int = field(default=0, compare=False)
    """The prompt tokens the prefix cache (or a KV connector) served this sample, whose
    request ran on its own (``RequestOutput.num_cached_tokens``: the most of them). The
    samples of one prompt are admitted together, so the first computes the prompt's
    blocks and the others find them. Not compared: it says how, not what, was generated."""

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: PromptLogprobs | None
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
    lora_request: LoRARequest | None = None
    """The adapter the request ran with (vLLM's field)."""
