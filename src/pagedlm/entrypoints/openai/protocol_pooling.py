"""Request bodies of the pooling routes besides /v1/embeddings, with vLLM's fields:
``/classify``, ``/score``, ``/rerank`` (Jina's and Cohere's shape) and ``/pooling``."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field

from pagedlm.entrypoints.openai.protocol import OpenAIModel, engine_prompts

_USE_ACTIVATION = "use use_activation, which means the same"


class ActivationFields(OpenAIModel):
    """``use_activation`` (None: the model's activation applies; False: raw logits), the
    older names vLLM still reads, and ``truncate_prompt_tokens``."""

    deprecated_fields: ClassVar[dict[str, str]] = {
        "activation": _USE_ACTIVATION,
        "softmax": _USE_ACTIVATION,
    }
    use_activation: bool | None = None
    activation: bool | None = None
    softmax: bool | None = None
    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    """At most this many tokens per prompt (-1: ``max_model_len``), as ``PoolingParams``."""

    def activation_choice(self) -> bool | None:
        for value in (self.use_activation, self.activation, self.softmax):
            if value is not None:
                return value
        return None


class ClassificationRequest(ActivationFields):
    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    """A text, texts, one token-id list, or token-id lists: one classification each."""
    user: str | None = None

    def prompts(self) -> list[str | dict[str, Any]]:
        return engine_prompts(self.input, "input")


class ScoreRequest(ActivationFields):
    model: str | None = None
    text_1: str | list[str]
    """One text (scored against every ``text_2``) or as many as ``text_2`` (pairwise)."""
    text_2: str | list[str]


class RerankRequest(ActivationFields):
    model: str | None = None
    query: str
    documents: list[str]
    top_n: int = Field(0, ge=0)
    """Return the best this many documents (0: all of them), best first."""


class PoolingRequest(ActivationFields):
    """The model's pooled output as it is: an embedding, or a classifier's probabilities."""

    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    normalize: bool | None = None
    user: str | None = None

    def prompts(self) -> list[str | dict[str, Any]]:
        return engine_prompts(self.input, "input")
