"""Batched sampling: per-request parameters as tensors, seeded generators, raw logprobs."""

from pagedlm.sample.logprobs import LogprobsTensors, compute_logprobs
from pagedlm.sample.metadata import SamplingMetadata, SamplingRow
from pagedlm.sample.sampler import Sampler, SamplerOutput

__all__ = [
    "LogprobsTensors",
    "Sampler",
    "SamplerOutput",
    "SamplingMetadata",
    "SamplingRow",
    "compute_logprobs",
]
