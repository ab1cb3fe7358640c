"""The ``/v1/embeddings`` request body (OpenAI's fields, and vLLM's ``normalize``)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from pagedlm.entrypoints.openai.protocol import OpenAIModel, engine_prompts


class EmbeddingRequest(OpenAIModel):
    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    """A text, texts, one token-id list, or token-id lists: one embedding each."""
    encoding_format: Literal["float", "base64"] = "float"
    """"base64": each embedding as little-endian float32 bytes in base64 (as OpenAI)."""
    dimensions: int | None = Field(None, ge=1)
    """Cut each embedding to its first this many values (Matryoshka models only)."""
    user: str | None = None
    # vLLM extras
    normalize: bool | None = None
    """L2-normalize (None: as the model's sentence-transformers config says)."""
    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    """At most this many tokens per input (-1: ``max_model_len``), as ``PoolingParams``."""

    def prompts(self) -> list[str | dict[str, Any]]:
        """The input field as engine prompts (text or token ids)."""
        return engine_prompts(self.input, "input")
