"""What pooling requests give back, with vLLM's names: ``LLM.encode`` returns
``PoolingRequestOutput`` (``outputs.data``, a tensor), ``LLM.embed`` returns
``EmbeddingRequestOutput`` (``outputs.embedding``, a list of floats), ``LLM.classify``
``ClassificationRequestOutput`` (``outputs.probs``) and ``LLM.score``
``ScoringRequestOutput`` (``outputs.score``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PoolingOutput:
    data: torch.Tensor
    """[dims] float32: the prompt's pooled (and, by default, normalized) vector."""


@dataclass
class PoolingRequestOutput:
    request_id: str
    outputs: PoolingOutput
    prompt_token_ids: list[int]
    finished: bool = True
    prompt: str | None = None
    num_cached_tokens: int = 0


@dataclass
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput:
    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True

    @classmethod
    def from_base(cls, output: PoolingRequestOutput) -> EmbeddingRequestOutput:
        return cls(
            output.request_id,
            EmbeddingOutput(output.outputs.data.tolist()),
            output.prompt_token_ids,
            output.finished,
        )


@dataclass
class ClassificationOutput:
    probs: list[float]
    """One value per label: probabilities after the model's activation (softmax, or
    sigmoid for one label), the raw logits with ``use_activation=False``."""

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ClassificationRequestOutput:
    request_id: str
    outputs: ClassificationOutput
    prompt_token_ids: list[int]
    finished: bool = True

    @classmethod
    def from_base(cls, output: PoolingRequestOutput) -> ClassificationRequestOutput:
        return cls(
            output.request_id,
            ClassificationOutput(output.outputs.data.tolist()),
            output.prompt_token_ids,
            output.finished,
        )


@dataclass
class ScoringOutput:
    score: float
    """A cross-encoder's output for the pair (after its activation unless
    ``use_activation=False``), or the cosine similarity of an embedding model's vectors."""


@dataclass
class ScoringRequestOutput:
    request_id: str
    outputs: ScoringOutput
    prompt_token_ids: list[int]
    """The pair's tokens: a cross-encoder's joined prompt, or both texts' tokens in
    order for an embedding model."""
    finished: bool = True
