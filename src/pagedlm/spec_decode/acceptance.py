"""The benchmarks' proposer: the target's own greedy continuation, each draft wrong with
probability ``1 - acceptance_rate``.

Random weights make real proposers' acceptance meaningless, so ``pagedlm bench latency
--spec-acceptance A`` first runs the prompts without speculation, writes each prompt's
greedy continuation to a JSON file (``reference_path``), then runs them again with this
proposer: drafts at positions the continuation covers are its tokens, each replaced by a
different token with probability ``1 - A`` (positions past it are always wrong). A greedy
verification then accepts a run that ends at the first wrong draft, so a step yields
``(1 - A^(k+1)) / (1 - A)`` tokens on average: the machinery measured at a known acceptance.
"""

from __future__ import annotations

import json

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
        device = batch.device
        self.tokens = torch.zeros(batch.token_ids.shape, dtype=torch.int64, device=device)
        """[slot] the reference sequence (prompt + continuation) of the slot's request."""
        self.lengths = torch.zeros(batch.max_num_reqs, dtype=torch.int64, device=device)
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(0)

    def admit(self, data: NewRequestData, slot: int) -> None:
        reference = self.references.get(tuple(data.token_ids[: data.num_prompt_tokens]), [])
        reference = reference[: self.tokens.shape[1]]
        self.lengths[slot] = len(reference)
        if reference:
            row = torch.tensor(reference, dtype=torch.int64)
            self.tokens[slot, : len(reference)] = tensor_to_device(row, self.batch.device)

    def propose(
        self, step: SampledStep, requests: ProposalRequests
    ) -> tuple[torch.Tensor, torch.Tensor]:
        device = self.batch.device
        slots = requests.slots_device
        count = requests.max_drafts
        positions = requests.num_tokens[:, None] + torch.arange(count, device=device)
        width = self.tokens.shape[1]
        right = self.tokens[slots[:, None], positions.clamp(max=width - 1)]
        shape = (len(requests.slots), count)
        keep = torch.rand(shape, device=device, generator=self.generator) < self.acceptance_rate
        keep &= positions < self.lengths[slots][:, None]
        offset = torch.randint(1, self.vocab_size, shape, device=device, generator=self.generator)
        drafts = torch.where(keep, right, (right + offset) % self.vocab_size)
        return drafts, requests.num_drafts_device
