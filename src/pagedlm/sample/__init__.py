"""Batched sampling: per-request parameters as tensors, seeded generators, raw logprobs."""

from pagedlm.sample.logprobs import LogprobsTensors, compute_logprobs
from pagedlm.sample.metadata import SamplingMetadata
from pagedlm.sample.penalties import TokenHistory, token_history_from_lists
from pagedlm.sample.row import SamplingRow
from pagedlm.sample.sampler import Sampler, SamplerOutput

__all__ = [
    "LogprobsTensors",
    "Sampler",
    "SamplerOutput",
    "SamplingMetadata",
    "SamplingRow",
    "TokenHistory",
    "compute_logprobs",
    "token_history_from_lists",
]
