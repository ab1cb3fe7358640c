"""What pooling requests give back, with vLLM's names: ``LLM.encode`` returns
``PoolingRequestOutput`` (``outputs.data``, a tensor), ``LLM.embed`` returns
``EmbeddingRequestOutput`` (``outputs.embedding``, a list of floats)."""

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
