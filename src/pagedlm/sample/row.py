"""One row of a batch to sample: the request's parameters and what its stages read."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedlm.sampling_params import SamplingParams

GREEDY_TEMPERATURE = 1e-5
"""Temperatures below this are greedy: dividing by them would overflow to inf/nan."""


@dataclass(frozen=True)
class SamplingRow:
    """One row of the batch to sample (one request).

    ``generator`` is the request's own seeded generator (``params.seed`` set), on the
    logits' device, else ``None``. ``num_output_tokens`` counts the tokens generated so far
    (the ``min_tokens`` mask reads it). Penalties read the tokens themselves, through the
    batch's ``TokenHistory`` (``penalties.py``).
    """

    params: SamplingParams
    generator: torch.Generator | None
    num_output_tokens: int = 0

    @property
    def is_penalized(self) -> bool:
        params = self.params
        return (
            params.repetition_penalty != 1.0
            or params.frequency_penalty != 0.0
            or params.presence_penalty != 0.0
        )


def is_greedy(params: SamplingParams) -> bool:
    return params.temperature < GREEDY_TEMPERATURE
