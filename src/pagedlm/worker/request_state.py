"""What a worker remembers about each request between steps."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedlm.core.outputs import NewRequestData
from pagedlm.sample.metadata import SamplingRow
from pagedlm.sampling_params import SamplingParams


@dataclass
class CachedRequestState:
    """Invariant: ``token_ids[:num_computed_tokens]`` have their K/V in the blocks of
    ``block_ids``; ``token_ids[num_prompt_tokens:]`` are the outputs sampled so far."""

    req_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    generator: torch.Generator | None

    @classmethod
    def from_new(cls, data: NewRequestData, device: torch.device) -> CachedRequestState:
        generator = None
        if data.sampling_params.seed is not None:
            generator = torch.Generator(device=device)
            generator.manual_seed(data.sampling_params.seed)
        return cls(
            req_id=data.req_id,
            token_ids=list(data.token_ids),
            num_prompt_tokens=data.num_prompt_tokens,
            sampling_params=data.sampling_params,
            block_ids=list(data.block_ids),
            num_computed_tokens=data.num_computed_tokens,
            generator=generator,
        )

    def resume(self, data: NewRequestData) -> None:
        """Re-admitted after preemption: new blocks, recompute from ``num_computed_tokens``.

        The generator keeps its state, so a seeded request samples the same tokens whether
        or not it was preempted.
        """
        self.token_ids = list(data.token_ids)
        self.block_ids = list(data.block_ids)
        self.num_computed_tokens = data.num_computed_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    def sampling_row(self) -> SamplingRow:
        """This request's row for the sampler. The token lists are copied only when a stage
        reads them (penalties; the ``min_tokens`` mask): slicing every prompt each step
        would cost more than the rest of the batch's host work."""
        params = self.sampling_params
        penalized = (
            params.repetition_penalty != 1.0
            or params.frequency_penalty != 0.0
            or params.presence_penalty != 0.0
        )
        return SamplingRow(
            params,
            self.generator,
            self.prompt_token_ids if penalized else (),
            self.output_token_ids if penalized or params.min_tokens else (),
        )
