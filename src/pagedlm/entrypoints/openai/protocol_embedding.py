"""The ``/v1/embeddings`` request body (OpenAI's fields, and vLLM's ``normalize`` or
``use_activation``, ``truncate_prompt_tokens``, ``add_special_tokens``, chat form, binary
encodings and the fields of every pooling body: ``cache_salt``, ``request_id``,
``priority``, ``truncation_side``, ``padding``)."""

from __future__ import annotations

from pydantic import Field

from pagedlm.entrypoints.openai.protocol_pooling import (
    EncodingFields,
    InputOrMessages,
    PoolingBodyFields,
)


class EmbeddingRequest(InputOrMessages, EncodingFields, PoolingBodyFields):
    model: str | None = None
    dimensions: int | None = Field(None, ge=1)
    """Cut each embedding to its first this many values (Matryoshka models only)."""
    user: str | None = None
    # vLLM extras
    normalize: bool | None = None
    """L2-normalize (None: as the model's sentence-transformers config says)."""
    use_activation: bool | None = None
    """vLLM's newer name for ``normalize`` (send one, or both alike)."""
    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    """At most this many tokens per input (-1: ``max_model_len``), as ``PoolingParams``."""
