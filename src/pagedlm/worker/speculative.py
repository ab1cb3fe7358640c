"""The model runner's speculative-decoding component: verification, then proposals.

Per slot it keeps on the device how many drafts the request's proposer holds in its row
(``num_valid``: a verification checks no more, whatever was scheduled) and how many its
last verification rejected (``num_rejected``: what ``StepInputBuilder`` subtracts for a
request whose start counted an in-flight step's drafts as accepted).

``verify`` runs the rejection sampler over a step's ``1 + k`` rows per sampled request and
writes what each request emitted into its row of the token table; ``after_step`` lets the
proposer see the step and draft the next step's tokens into the rows, after the emitted
ones. Without a speculative config there is no proposer, no step ever has drafts, and
``after_step`` returns at once.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from pagedlm.config import EngineConfig
from pagedlm.sample.host_copy import arrays_to_device
from pagedlm.sample.metadata import SamplingMetadata
from pagedlm.sample.rejection_sampler import (
    FusedGreedyVerifier,
    RejectionOutput,
    RejectionSampler,
)
from pagedlm.sample.sampler import Sampler
from pagedlm.spec_decode import build_proposer
from pagedlm.spec_decode.model_drafter import TargetParts
from pagedlm.spec_decode.proposer import Allocate, ProposalRequests, SampledStep
from pagedlm.step import SchedulerOutput
from pagedlm.structured_output.bitmask import apply_token_bitmask
from pagedlm.worker.input_batch import InputBatch
from pagedlm.worker.step_inputs import StepInputs


@dataclass(frozen=True)
class Proposals:
    """Drafts made after a step, still on the device: request ``req_index[i]`` (an index
    into the step's ``req_ids``) drafted ``drafts[i, :num_valid[i]]``."""

    req_index: list[int]
    drafts: torch.Tensor
    num_valid: torch.Tensor


class Speculator:
    def __init__(
        self,
        config: EngineConfig,
        batch: InputBatch,
        target: TargetParts,
        sampler: Sampler,
        host_lengths_exact: bool,
        greedy_verifier: FusedGreedyVerifier | None = None,
    ) -> None:
        """``host_lengths_exact``: the attention backend plans from host lengths, so the
        proposers' layouts must carry exact ones (read from the device, a wait).
        ``greedy_verifier``: the platform's kernel for all-greedy verification steps
        (None: the rejection sampler's torch ops)."""
        self.batch = batch
        self.host_lengths_exact = host_lengths_exact
        self.greedy_verifier = greedy_verifier
        spec = config.speculative
        self.proposer = None if spec is None else build_proposer(spec, batch, target, config.model)
        device = batch.device
        self.num_valid = torch.zeros(batch.max_num_reqs, dtype=torch.int64, device=device)
        self.num_rejected = torch.zeros(batch.max_num_reqs, dtype=torch.int32, device=device)
        self.rejection_sampler = RejectionSampler(sampler)

    def kv_bytes_per_block(self) -> int:
        return 0 if self.proposer is None else self.proposer.kv_bytes_per_block()

    def initialize_kv_cache(self, num_blocks: int, allocate: Allocate) -> None:
        if self.proposer is not None:
            self.proposer.initialize_kv_cache(num_blocks, allocate)

    def capture_graphs(self, runner: object) -> None:
        """Let the proposer capture its forwards (the platform replays graphs)."""
        if self.proposer is not None:
            self.proposer.capture_graphs(runner)

    def release_kv_cache(self) -> None:
        if self.proposer is not None:
            self.proposer.release_kv_cache()

    def weight_modules(self) -> list[nn.Module]:
        return [] if self.proposer is None else self.proposer.weight_modules()

    def admit(self, scheduler_output: SchedulerOutput) -> None:
        """Requests (re)admitted this step hold no drafts yet."""
        if self.proposer is None or not scheduler_output.scheduled_new_reqs:
            return
        slots = []
        for data in scheduler_output.scheduled_new_reqs:
            slot = self.batch.requests[data.req_id].slot
            self.proposer.admit(data, slot)
            slots.append(slot)
        (slots_dev,) = arrays_to_device([np.array(slots)], self.batch.device)
        self.num_valid[slots_dev] = 0

    def verify(
        self,
        logits: torch.Tensor,
        metadata: SamplingMetadata,
        bitmask: torch.Tensor | None,
        inputs: StepInputs,
    ) -> RejectionOutput:
        """Verify the step's drafts; emitted tokens go into the token table."""
        if self.greedy_verifier is not None and metadata.all_greedy:
            return self._verify_greedy(self.greedy_verifier, logits, metadata, bitmask, inputs)
        sampled = inputs.sampled
        rows = inputs.num_sampling_rows
        num_rows = int(rows.sum())
        request = np.repeat(np.arange(len(rows)), rows)
        position = np.arange(num_rows) - np.repeat(np.cumsum(rows) - rows, rows)
        slot_ids = [inputs.states[i].slot for i in sampled]
        slots, num_drafts, request_dev, position_dev = arrays_to_device(
            [np.array(slot_ids), rows - 1, request, position], self.batch.device
        )
        num_verified = torch.minimum(num_drafts, self.num_valid[slots])
        assert inputs.logits_indices is not None, "a verifying step has explicit logits rows"
        last = inputs.layout.num_tokens - 1
        draft_ids = inputs.input_ids[(inputs.logits_indices[:num_rows] + 1).clamp(max=last)]
        out = self.rejection_sampler(
            logits, metadata, draft_ids.to(torch.int64), rows, num_verified, bitmask,
            row_map=(request_dev, position_dev),
        )  # fmt: skip
        flat = inputs.sample_token_index[request_dev] + position_dev
        emitted = out.token_ids[request_dev, position_dev].to(torch.int32)
        self.batch.token_ids.view(-1).index_put_((flat,), emitted)
        self.num_rejected[slots] = (num_drafts + 1 - out.num_emitted).to(torch.int32)
        return out

    def _verify_greedy(
        self,
        verifier: FusedGreedyVerifier,
        logits: torch.Tensor,
        metadata: SamplingMetadata,
        bitmask: torch.Tensor | None,
        inputs: StepInputs,
    ) -> RejectionOutput:
        """``verify`` of an all-greedy step through the platform's kernel: the same
        tokens, counts and writes as the rejection sampler's path."""
        rows = inputs.num_sampling_rows
        row_starts = np.concatenate([[0], np.cumsum(rows)])
        slots = [inputs.states[i].slot for i in inputs.sampled]
        row_starts_dev, slots_dev = arrays_to_device([row_starts, slots], self.batch.device)
        if bitmask is not None:
            logits = apply_token_bitmask(logits, bitmask)
        raw_logits = logits
        if metadata.logit_adjustments is not None or metadata.penalties is not None:
            logits = Sampler.adjust_logits(logits, metadata)
        assert inputs.logits_indices is not None, "a verifying step has explicit logits rows"
        token_ids, num_emitted, emitted = verifier(
            logits, inputs.input_ids, inputs.logits_indices, inputs.layout.num_tokens - 1,
            row_starts_dev, slots_dev, self.num_valid, inputs.sample_token_index,
            self.batch.token_ids.view(-1), self.num_rejected, int(rows.max()),
        )  # fmt: skip
        logprobs = None
        if metadata.max_num_logprobs is not None:
            logprobs = self.rejection_sampler.sampler.logprobs(
                raw_logits, logits, emitted, metadata.max_num_logprobs
            )
        return RejectionOutput(token_ids, num_emitted, logprobs)

    def after_step(
        self,
        inputs: StepInputs,
        hidden: torch.Tensor,
        num_emitted: torch.Tensor | None,
        to_propose: dict[str, int],
    ) -> Proposals | None:
        """Show the proposer the step (its emitted tokens in the table), then draft for
        the requests in ``to_propose``."""
        if self.proposer is None:
            return None
        device = self.batch.device
        sampled = inputs.sampled
        if num_emitted is None:
            num_emitted = torch.ones(len(sampled), dtype=torch.int64, device=device)
        step = SampledStep(inputs, hidden, num_emitted)
        self.proposer.observe(step)
        index = np.array(
            [i for i, r in enumerate(sampled) if inputs.req_ids[r] in to_propose], dtype=np.int64
        )
        if not len(index):
            return None
        request = sampled[index]
        slots = np.array([inputs.states[r].slot for r in request], dtype=np.int64)
        counts = np.array([to_propose[inputs.req_ids[r]] for r in request], dtype=np.int64)
        # Each draft's owner and column in the rows, after each request's emitted tokens
        # (the scheduler left room), and its flat index in the token table less its row's
        # token count (known on the device only); copied with the proposal's index arrays
        # in one go.
        owner = np.repeat(np.arange(len(counts)), counts)
        column = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
        row_column = slots[owner] * self.batch.row_length + column
        fed_drafts = inputs.num_drafts[request]
        arrays = [index, slots, counts, request, fed_drafts, owner, column, row_column]
        (
            index_dev, slots_dev, counts_dev, request_dev, fed_drafts_dev, owner_dev,
            column_dev, row_column_dev,
        ) = arrays_to_device(arrays, self.batch.device)  # fmt: skip
        # Tokens in each row now: those before the step's first output, plus what it emitted.
        lengths = inputs.layout.seq_lens[request_dev].to(torch.int64)
        num_tokens = lengths - fed_drafts_dev + step.num_emitted[index_dev]
        first_output = inputs.seq_lens[request] - fed_drafts
        exact = self.host_lengths_exact
        if exact:  # the backend plans from host lengths: read how many were emitted
            num_tokens_host = first_output + step.num_emitted[index_dev].cpu().numpy()
        else:
            num_tokens_host = first_output + 1 + fed_drafts
        requests = ProposalRequests(
            sampled_index=index,
            slots=slots,
            num_drafts=counts,
            num_tokens=num_tokens,
            num_tokens_host=num_tokens_host.astype(np.int64),
            exact=exact,
            sampled_index_device=index_dev,
            slots_device=slots_dev,
            num_drafts_device=counts_dev,
        )
        drafts, num_valid = self.proposer.propose(step, requests)
        if int(counts.min()) == drafts.shape[1]:  # every request drafts its whole row
            placed = drafts.reshape(-1)
        else:
            placed = drafts[owner_dev, column_dev]
        flat = row_column_dev + num_tokens[owner_dev]
        self.batch.token_ids.view(-1)[flat] = placed.to(torch.int32)
        self.num_valid[slots_dev] = num_valid
        return Proposals(request.tolist(), drafts, num_valid)
