"""Scheduler -> workers: which tokens of which requests one step computes."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from pagedlm.lora.request import LoRARequest
from pagedlm.sampling_params import SamplingParams
from pagedlm.step.kv_transfer import KVConnectorMetadata
from pagedlm.step.multimodal import MultiModalFeature, TensorData
from pagedlm.step.pooling import PoolingSpec


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
    lora_request: LoRARequest | None = None
    """The adapter the request runs with (None: the base model); workers remember it, so
    cached requests carry nothing."""
    mm_features: list[MultiModalFeature] = field(default_factory=list)
    """The prompt's images (sorted by offset); workers keep them while the request lives,
    so ``SchedulerOutput.scheduled_encoder_inputs`` names them by index."""
    pooling: PoolingSpec | None = None
    """A pooling model's request: what its workers pool (None: the model's own task)."""
    prompt_embeds: TensorData | None = None
    """A prompt given as embeddings (``enable_prompt_embeds``): ``[num_prompt_tokens,
    hidden]`` rows in the model's dtype, fed at the prompt's positions in place of the
    embeddings of ``token_ids`` (placeholders there). Sent with every admission, a resumed
    request's included; workers drop it once the prompt is computed."""


@dataclass(frozen=True)
class CachedRequestData:
    """The requests the workers already hold, as columns (entry ``i`` of each list is
    ``req_ids[i]``'s): only what changed since their last step. One object per step, not
    one per request: a step of a few hundred decoding requests builds three lists.

    The workers know the tokens they sampled for a request themselves (on the device),
    also those the scheduler has not seen yet under asynchronous scheduling.
    """

    req_ids: list[str] = field(default_factory=list)
    new_block_ids: list[list[int]] = field(default_factory=list)
    """Blocks appended to each request's table (mostly empty)."""
    num_computed_tokens: list[int] = field(default_factory=list)
    new_token_ids: list[list[int]] = field(default_factory=list)
    """Pipeline parallelism only (else empty): each request's output tokens among the tokens
    this step feeds, the last ``len(new_token_ids[i])`` of them. Stages before the last never
    see the ids the last stage samples, so the scheduler hands them on (vLLM's field)."""

    def __len__(self) -> int:
        return len(self.req_ids)


@dataclass(frozen=True)
class SchedulerOutput:
    """What to compute this step.

    ``num_scheduled_tokens[req_id]`` tokens of each request are fed, starting at its
    ``num_computed_tokens``; of those, the last ``len(scheduled_spec_decode_tokens[req_id])``
    are drafted (speculative) tokens, which the workers verify. The new requests, then the
    cached ones, are the rows of the flattened batch, in that order (``req_ids``). A request samples this step when its scheduled tokens reach the end of every
    token it has (known, in flight or drafted); the others are prefill chunks.
    """

    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    """Draft tokens each verifying request feeds after its last sampled token: the ids its
    workers' proposer drafted after the request's previous sampling step, or ``-1`` where
    the host has not seen them yet (asynchronous scheduling). The workers hold the drafts
    in their token table either way; they verify the first ``min(len, drafts they hold)``."""
    finished_req_ids: set[str] = field(default_factory=set)
    """Requests that ended since the last step: workers drop their state."""
    preempted_req_ids: set[str] = field(default_factory=set)
    """Requests preempted this step: workers release their rows, keeping what must survive
    a resume (a seeded request's generator)."""
    structured_output_req_ids: list[str] = field(default_factory=list)
    """Constrained requests that sample this step: ``sample_tokens`` gets their bitmask."""
    num_drafts_to_propose: dict[str, int] = field(default_factory=dict)
    """Requests that sample this step and whose proposer drafts up to this many tokens for
    their next step (speculative decoding; the drafts come back in the runner output)."""
    num_drafts_in_flight: dict[str, int] = field(default_factory=dict)
    """Requests whose ``num_computed_tokens`` counts every draft of the step still in flight
    as accepted (asynchronous scheduling): how many drafts that step verifies. The workers
    subtract the ones it rejects from where the request's tokens start."""
    scheduled_encoder_inputs: dict[str, list[int]] = field(default_factory=dict)
    """Per request, the indices of its ``mm_features`` the workers encode this step (into
    their encoder cache) before the forward; the others its tokens reach are cached."""
    free_encoder_mm_hashes: list[str] = field(default_factory=list)
    """Encoder-cache entries (feature identifiers) the workers drop before this step."""
    kv_connector_metadata: KVConnectorMetadata | None = None
    """A KV connector's loads and saves for this step (``pagedlm.kv_transfer``); None when
    there are none. A step may carry loads and no tokens: it still runs on the workers."""

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0

    @property
    def req_ids(self) -> list[str]:
        """Every scheduled request, in batch order."""
        return [r.req_id for r in self.scheduled_new_reqs] + self.scheduled_cached_reqs.req_ids

    @property
    def num_computed_tokens(self) -> list[int]:
        """Where each request's scheduled tokens start, in batch order."""
        return [
            r.num_computed_tokens for r in self.scheduled_new_reqs
        ] + self.scheduled_cached_reqs.num_computed_tokens


@dataclass(frozen=True)
class GrammarBitmask:
    """Allowed next tokens of the structured-output requests that sample this step.

    Row ``i`` of ``bitmask`` (numpy int32 ``[len(req_ids), ceil(vocab_size / 32)]``)
    belongs to ``req_ids[i]``; bit ``j`` of word ``w`` set = token ``32 * w + j`` allowed.
    A request that verifies ``k`` drafts has ``1 + k`` consecutive rows (the same id):
    the tokens allowed at each of its positions, given the drafts before it.
    Built after the previous step's tokens advanced the grammars, so it travels with
    ``sample_tokens``, not with the ``SchedulerOutput``.
    """

    req_ids: list[str]
    bitmask: np.ndarray
