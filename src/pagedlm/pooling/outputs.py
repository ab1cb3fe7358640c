"""What pooling requests give back, with vLLM's names: ``LLM.encode`` returns
``PoolingRequestOutput`` (``outputs.data``, a tensor), ``LLM.embed`` returns
``EmbeddingRequestOutput`` (``outputs.embedding``, a list of floats), ``LLM.classify``
``ClassificationRequestOutput`` (``outputs.probs``) and ``LLM.score``
``ScoringRequestOutput`` (``outputs.score``). ``LLM.reward`` and the token-wise tasks
return ``PoolingRequestOutput`` with one row per prompt token."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pagedlm.step import TensorData


def pooled_tensor(pooled: list[float] | TensorData) -> torch.Tensor:
    """The engine's raw pooled output as a float32 tensor: a vector ``[dims]``, or a
    token-wise task's rows ``[num_rows, dims]``."""
    if isinstance(pooled, TensorData):
        array = np.frombuffer(pooled.data, dtype=np.dtype(pooled.dtype)).reshape(pooled.shape)
        return torch.from_numpy(array.copy())  # writable, owning its memory
    return torch.tensor(pooled, dtype=torch.float32)


def as_tensor_data(rows: torch.Tensor) -> TensorData:
    """Host float32 rows ``[num_rows, dims]`` as the step protocol carries them."""
    array = rows.contiguous().numpy()
    return TensorData(str(array.dtype), list(array.shape), array.tobytes())


@dataclass
class PoolingOutput:
    data: torch.Tensor
    """float32: the prompt's pooled (and, by default, normalized) vector ``[dims]``; for
    the token-wise tasks (``token_embed``, ``token_classify``, ``LLM.reward``) one row per
    prompt token (STEP pooling: per step tag) ``[num_rows, hidden or num_labels]``."""


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
