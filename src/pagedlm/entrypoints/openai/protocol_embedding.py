"""The ``/v1/embeddings`` request body (OpenAI's fields, and vLLM's ``normalize``)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from pagedlm.entrypoints.openai.errors import APIError
from pagedlm.entrypoints.openai.protocol import INT64_MAX, INT64_MIN, OpenAIModel


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
    priority: int = Field(0, ge=INT64_MIN, le=INT64_MAX)

    def prompts(self) -> list[str | dict[str, Any]]:
        """The input field as engine prompts (text or token ids)."""
        data = self.input
        if isinstance(data, str):
            return [data]
        if not data:
            raise APIError("input is empty; pass a string or token ids.", param="input")
        if all(isinstance(item, int) for item in data):
            return [{"prompt_token_ids": list(data)}]
        if all(isinstance(item, str) for item in data):
            return list(data)
        if all(isinstance(item, list) and item for item in data):
            return [{"prompt_token_ids": list(item)} for item in data]
        raise APIError(
            "input must be a string, a list of strings, a list of token ids or a list of "
            "non-empty token-id lists; do not mix them.",
            param="input",
        )
