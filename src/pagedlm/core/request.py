"""A request as the engine core sees it: token ids, progress, and its place in the cache."""

from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagedlm.lora.request import LoRARequest
    from pagedlm.sampling_params import SamplingParams
    from pagedlm.step.multimodal import MultiModalFeature, TensorData
    from pagedlm.step.pooling import PoolingSpec


class RequestStatus(enum.IntEnum):
    WAITING = 0
    WAITING_FOR_GRAMMAR = 1
    """Its structured-output grammar is compiling; other requests are admitted meanwhile."""
    RUNNING = 2
    PREEMPTED = 3
    WAITING_FOR_REMOTE_KVS = 4
    """A KV connector loads part of its prompt into its blocks (``core/external_kv.py``);
    other requests are admitted meanwhile."""
    FINISHED_STOPPED = 5
    FINISHED_LENGTH = 6
    FINISHED_ABORTED = 7
    FINISHED_IGNORED = 8
    FINISHED_ERROR = 9
    """A callable of its own (a custom logits processor) failed in a step, or its LoRA
    adapter could not be read for one: vLLM's "error"."""

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_IGNORED: "length",
    RequestStatus.FINISHED_ERROR: "error",
}


class Request:
    """One sequence being generated (a child of an n>1 request is its own Request).

    Invariants:
    - ``all_token_ids`` is the one list of the request's tokens: the prompt, then the
      outputs sampled so far (``prompt_token_ids`` and ``output_token_ids`` are copies of
      its two parts, for callers off the hot path).
    - ``num_output_placeholders`` tokens have been sampled by launched steps whose results
      the scheduler has not seen yet (asynchronous scheduling: at most one step ahead).
      The workers hold their values; the scheduler counts them, as tokens to come.
    - ``0 <= num_computed_tokens <= num_tokens + num_output_placeholders``: tokens whose
      K/V are in the cache or being written by a launched step. For a running request in
      decode, exactly one token is still to be fed: the last sampled one (known or not).
    - A step that verifies ``k`` drafts counts ``1 + k`` placeholders and advances
      ``num_computed_tokens`` by ``1 + k`` as if every draft were accepted; collecting it
      takes back the rejected ones. Draft tokens never enter ``all_token_ids``.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_ids: set[int] | None = None,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
        mm_features: list[MultiModalFeature] | None = None,
        pooling: PoolingSpec | None = None,
        prompt_embeds: TensorData | None = None,
        reasoning_ended: bool | None = True,
    ) -> None:
        self.request_id = request_id
        self.sampling_params = sampling_params
        self.max_tokens: int = sampling_params.max_tokens  # type: ignore[assignment]
        """Output tokens it may make (the input processor resolved ``max_tokens``): an
        attribute, not a property, since every step reads it per request."""
        self.eos_token_ids = set() if sampling_params.ignore_eos else set(eos_token_ids or ())
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.cache_salt = cache_salt
        self.priority = priority
        """Under the "priority" scheduling policy, lower values are served first."""
        self.lora_request = lora_request
        """The adapter it runs with (None: the base model)."""
        self.mm_features: list[MultiModalFeature] = list(mm_features or ())
        """The prompt's images, sorted by placeholder offset (empty: a text prompt)."""
        self.pooling = pooling
        """A pooling model's request: its task (None: the model's own, or generating)."""
        self.prompt_embeds = prompt_embeds
        """A prompt given as embeddings ``[num_prompt_tokens, hidden]`` (the prompt's token
        ids are then placeholders); None: token ids."""
        self.reasoning_ended = reasoning_ended
        """Where its output starts, for a grammar that applies after the model's thought
        (vLLM's name; the input processor reads it from the prompt): True, after it (the
        grammar applies from the first token); False, inside a thought (it applies after
        the end marker); None, the first token decides (a start marker opens a thought)."""

        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.all_token_ids)
        self.num_computed_tokens = 0
        self.num_output_placeholders = 0
        self.num_cached_tokens = -1
        """Prompt tokens served from the prefix cache or a KV connector at first scheduling
        (-1: not yet)."""
        self.num_external_computed_tokens = 0
        """Tokens of its prompt a KV connector is loading or has loaded into the blocks it
        holds (vLLM's name)."""
        self.num_external_cached_tokens = 0
        """Of ``num_cached_tokens``, those a KV connector had loaded (fixed with it)."""
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.num_preemptions = 0
        self.num_prompt_logprobs_reported = 0
        """Prompt positions whose logprobs went to the front end (a preempted request
        computes some again; they are not reported twice)."""
        self.queued_seconds: float | None = None
        """Seconds between arrival and first scheduling, set when first scheduled."""
        self.block_hashes: list[bytes] = []
        """Chained digests of this request's full blocks, maintained by the KV manager."""
        # Speculative decoding (``core/speculation.py``); all unused when it is off.
        self.spec_token_ids: list[int] = []
        """Drafts its proposer made after its last collected sampling step: what its next
        step verifies (none right after admission)."""
        self.num_scheduled_drafts = 0
        """Drafts the last step scheduled for it verifies."""
        self.num_requested_drafts = 0
        """Drafts its last sampling step asked the proposer for (asynchronous scheduling
        verifies that many placeholders before they reach the host)."""
        self.spec_acceptance = 1.0
        """Running mean of its drafts' acceptance rate (the never-hurts policy reads it)."""
        self.num_steps_without_drafts = 0
        """Steps the policy kept it from proposing since it last did (for its probes)."""
        self.num_empty_proposals = 0
        """Proposals in a row (the last collected included) that found no draft."""

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.all_token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens :]

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def last_token_id(self) -> int:
        return self.all_token_ids[-1]

    def append_output_token_ids(self, token_ids: list[int]) -> None:
        self.all_token_ids.extend(token_ids)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, "
            f"computed={self.num_computed_tokens}/{self.num_tokens})"
        )
