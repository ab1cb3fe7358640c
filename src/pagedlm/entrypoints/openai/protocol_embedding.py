"""The ``/v1/embeddings`` request body (OpenAI's fields, and vLLM's ``normalize``,
``truncate_prompt_tokens`` and chat form)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from pagedlm.entrypoints.openai.chat_message import ChatMessage
from pagedlm.entrypoints.openai.errors import APIError
from pagedlm.entrypoints.openai.protocol import ChatTemplateFields, OpenAIModel, engine_prompts


class EmbeddingRequest(OpenAIModel):
    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]] | None = None
    """A text, texts, one token-id list, or token-id lists: one embedding each."""
    messages: list[ChatMessage] | None = None
    """vLLM's chat form instead of ``input``: one embedding of the conversation as the
    chat template renders it (``add_generation_prompt`` off unless asked)."""
    add_generation_prompt: bool = False
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
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
        if self.input is None:
            raise APIError("Send input (texts or token ids) or messages (a chat).", param="input")
        return engine_prompts(self.input, "input")

    def chat(self) -> ChatTemplateFields | None:
        """The chat form's fields (None: the request sends ``input``)."""
        if self.messages is None:
            return None
        if self.input is not None:
            raise APIError("Send input or messages, not both.", param="messages")
        if not self.messages:
            raise APIError("messages is empty; send at least one message.", param="messages")
        return ChatTemplateFields.model_construct(
            messages=self.messages,
            add_generation_prompt=self.add_generation_prompt,
            continue_final_message=self.continue_final_message,
            chat_template=self.chat_template,
            chat_template_kwargs=self.chat_template_kwargs,
        )
