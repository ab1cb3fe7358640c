"""The requests a worker holds, as rows of persistent device tables.

Each request owns a *slot*: a row of ``token_ids`` ``[max_num_reqs, max_model_len + 1]`` (every
token it has: prompt, outputs, and what the last launched step sampled, written there on
the device) and of ``block_table`` ``[max_num_reqs + 1, max_blocks_per_req]`` (its block
ids; the extra last row is all zeros, for padding rows of a captured graph). The tables
change incrementally: a new or resumed request writes its row once, a running one appends
the blocks it was given, and sampled tokens are scattered into ``token_ids`` on the device
by the step that sampled them, so the next step reads them without a host round trip.

Invariants:
- A slot belongs to at most one request; it is freed when the request finishes, is
  aborted or is preempted, and reused only by a later step. Device work runs in launch
  order, so a step that wrote a freed slot's row has run before the next owner's writes.
- ``num_admitted_tokens[slot]`` is how many tokens the request had when (re)admitted: a
  step samples for it once the tokens it feeds, drafts aside, reach past them (every step
  after its prompt does). Per-slot numbers live in numpy arrays, so a step reads them for
  all its requests at once.
- Speculative decoding writes a verifying step's outputs and the drafts for the next step
  into the row too, at positions the host may not know yet (asynchronous scheduling); a
  step reads a row only up to positions earlier steps have written.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np
import torch

from pagedlm.lora.request import LoRARequest
from pagedlm.sampling_params import SamplingParams
from pagedlm.step import NewRequestData, SchedulerOutput
from pagedlm.worker.host_to_device import HostToDevice


@dataclass
class RequestState:
    """What a worker remembers about one request between steps."""

    req_id: str
    slot: int
    """Its row in the device tables; -1 while preempted."""
    num_prompt_tokens: int
    sampling_params: SamplingParams
    generator: torch.Generator | None
    """A seeded request's own generator; it survives preemption, so a seeded request
    samples the same tokens whether or not it was preempted."""
    num_blocks: int
    lora_request: LoRARequest | None = None
    serial: int = field(default_factory=itertools.count().__next__)
    """Unique over the process's lifetime (request ids may be reused once finished)."""

    @property
    def needs_token_history(self) -> bool:
        """Whether sampling reads its earlier tokens (penalties, bad words of several
        tokens)."""
        params = self.sampling_params
        return (
            params.repetition_penalty != 1.0
            or params.frequency_penalty != 0.0
            or params.presence_penalty != 0.0
            or any(len(ids) > 1 for ids in params.bad_words_token_ids)
        )


class InputBatch:
    def __init__(
        self,
        max_num_reqs: int,
        max_model_len: int,
        block_size: int,
        device: torch.device,
    ) -> None:
        self.max_num_reqs = max_num_reqs
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.max_blocks_per_req = -(-max_model_len // block_size)
        self.device = device
        # One column more than max_model_len: a request that samples at its last position
        # writes the token it will never feed there.
        self.token_ids = torch.zeros(
            (max_num_reqs, max_model_len + 1), dtype=torch.int32, device=device
        )
        self.row_length = max_model_len + 1
        self.block_table = torch.zeros(
            (max_num_reqs + 1, self.max_blocks_per_req), dtype=torch.int32, device=device
        )
        self.padding_slot = max_num_reqs
        """The all-zero block-table row that padding rows read."""
        self.num_admitted_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        """[slot] tokens the slot's request had when admitted (see the invariants)."""
        self.requests: dict[str, RequestState] = {}
        self.num_prompt_logprob_requests = 0
        """Requests in ``requests`` that asked for prompt logprobs."""
        self._free_slots = list(range(max_num_reqs - 1, -1, -1))
        self._writes = HostToDevice(4096, torch.int64, device)
        self._token_writes: list[tuple[int, list[int]]] = []
        self._block_writes: list[tuple[int, int, list[int]]] = []

    def update(self, scheduler_output: SchedulerOutput) -> None:
        """Apply a step's request changes; the table writes are queued by ``flush``."""
        for req_id in scheduler_output.finished_req_ids:
            state = self.requests.pop(req_id, None)
            if state is not None:
                self._release(state)
                if state.sampling_params.prompt_logprobs is not None:
                    self.num_prompt_logprob_requests -= 1
        for req_id in scheduler_output.preempted_req_ids:
            state = self.requests.get(req_id)
            if state is not None:
                self._release(state)
        for data in scheduler_output.scheduled_new_reqs:
            self._admit(data)
        cached = scheduler_output.scheduled_cached_reqs
        for req_id, new_block_ids in zip(cached.req_ids, cached.new_block_ids, strict=True):
            if new_block_ids:
                state = self.requests[req_id]
                self._block_writes.append((state.slot, state.num_blocks, new_block_ids))
                state.num_blocks += len(new_block_ids)

    def _admit(self, data: NewRequestData) -> None:
        state = self.requests.get(data.req_id)
        if state is None:
            generator = None
            if data.sampling_params.seed is not None:
                generator = torch.Generator(device=self.device)
                generator.manual_seed(data.sampling_params.seed)
            state = RequestState(
                data.req_id,
                -1,
                data.num_prompt_tokens,
                data.sampling_params,
                generator,
                0,
                data.lora_request,
            )
            self.requests[data.req_id] = state
            if data.sampling_params.prompt_logprobs is not None:
                self.num_prompt_logprob_requests += 1
        elif state.slot >= 0:
            raise RuntimeError(f"request {data.req_id!r} was admitted twice without a release")
        if not self._free_slots:
            raise RuntimeError(
                f"more than max_num_seqs={self.max_num_reqs} requests hold rows; the scheduler "
                "must release a request (finish or preempt) before admitting another"
            )
        state.slot = self._free_slots.pop()
        self.num_admitted_tokens[state.slot] = len(data.token_ids)
        state.num_blocks = len(data.block_ids)
        self._token_writes.append((state.slot, data.token_ids))
        self._block_writes.append((state.slot, 0, data.block_ids))

    def _release(self, state: RequestState) -> None:
        if state.slot >= 0:
            self._free_slots.append(state.slot)
            state.slot = -1

    def flush(self) -> None:
        """Queue the pending row writes (new requests' tokens, new block ids) on the device."""
        if not self._token_writes and not self._block_writes:
            return
        length = self.row_length
        width = self.max_blocks_per_req
        index = [np.arange(len(t), dtype=np.int64) + s * length for s, t in self._token_writes]
        index += [
            np.arange(start, start + len(b), dtype=np.int64) + s * width
            for s, start, b in self._block_writes
        ]
        num_token_writes = sum(len(t) for _, t in self._token_writes)
        n = num_token_writes + sum(len(b) for _, _, b in self._block_writes)
        host = self._writes.host(2 * n)
        host[:n] = np.concatenate(index)
        values = host[n:]
        offset = 0
        for chunk in [t for _, t in self._token_writes] + [b for _, _, b in self._block_writes]:
            values[offset : offset + len(chunk)] = chunk
            offset += len(chunk)
        device = self._writes.copy(2 * n)
        self._token_writes.clear()
        self._block_writes.clear()
        token_index, block_index = device[:num_token_writes], device[num_token_writes:n]
        if num_token_writes:
            self.token_ids.view(-1).index_put_(
                (token_index,), device[n : n + num_token_writes].to(torch.int32)
            )
        if n > num_token_writes:
            self.block_table.view(-1).index_put_(
                (block_index,), device[n + num_token_writes :].to(torch.int32)
            )
