"""The benchmarks' proposer: the target's own greedy continuation, each draft wrong with
probability ``1 - acceptance_rate``.

Random weights make real proposers' acceptance meaningless, so ``pagedlm bench latency
--spec-acceptance A`` first runs the prompts without speculation, writes each prompt's
greedy continuation to a JSON file (``reference_path``), then runs them again with this
proposer: drafts at positions the continuation covers are its tokens, each replaced by a
different token with probability ``1 - A`` (positions past it are always wrong). A greedy
verification then accepts a run that ends at the first wrong draft, so a step yields
``(1 - A^(k+1)) / (1 - A)`` tokens on average: the machinery measured at a known acceptance.

Which positions are wrong is drawn once per request, when it is admitted: a position's
draft is verified at most once (a verification settles it, accepted or not, and later
drafts start after it), so the draws are independent Bernoulli trials as if made at each
proposal, and a proposal is a single gather from the slot's drafted sequence: the
benchmark's proposer adds two kernels per step to what it measures.
"""

from __future__ import annotations

import json

import numpy as np
import torch

from pagedlm.sample.host_copy import tensor_to_device
from pagedlm.spec_decode.proposer import ProposalRequests, Proposer, SampledStep
from pagedlm.step import NewRequestData
from pagedlm.worker.input_batch import InputBatch


class AcceptanceProposer(Proposer):
    def __init__(
        self, batch: InputBatch, reference_path: str, acceptance_rate: float, vocab_size: int
    ) -> None:
        super().__init__(batch)
        with open(reference_path) as file:
            pairs = json.load(file)
        self.references = {tuple(prompt): prompt + continuation for prompt, continuation in pairs}
        self.acceptance_rate = acceptance_rate
        self.vocab_size = vocab_size
        self.drafted = torch.zeros(batch.token_ids.shape, dtype=torch.int64, device=batch.device)
        """[slot] what the slot's request drafts at each position: the reference's token,
        or another token where the draw made it wrong (every position past the
        reference)."""
        self.rng = np.random.default_rng(0)

    def admit(self, data: NewRequestData, slot: int) -> None:
        width = self.drafted.shape[1]
        reference = self.references.get(tuple(data.token_ids[: data.num_prompt_tokens]), [])
        row = np.zeros(width, dtype=np.int64)
        row[: len(reference)] = reference[:width]
        keep = self.rng.random(width) < self.acceptance_rate
        keep[len(reference) :] = False
        offset = self.rng.integers(1, self.vocab_size, width)
        row = np.where(keep, row, (row + offset) % self.vocab_size)
        self.drafted[slot] = tensor_to_device(torch.from_numpy(row), self.batch.device)

    def propose(
        self, step: SampledStep, requests: ProposalRequests
    ) -> tuple[torch.Tensor, torch.Tensor]:
        width = self.drafted.shape[1]
        columns = torch.arange(requests.max_drafts, device=self.batch.device)
        positions = (requests.num_tokens[:, None] + columns).clamp_(max=width - 1)
        return self.drafted[requests.slots_device[:, None], positions], requests.num_drafts_device
