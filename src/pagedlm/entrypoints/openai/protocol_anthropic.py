"""Request bodies of the Anthropic Messages API (``/v1/messages``, ``/count_tokens``)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from pagedlm.entrypoints.openai.errors import APIError


class AnthropicModel(BaseModel):
    model_config = ConfigDict(extra="ignore")


class ContentBlock(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


def _blocks_text(content: str | list[ContentBlock], where: str) -> str:
    if isinstance(content, str):
        return content
    texts = []
    for block in content:
        if block.type != "text" or block.text is None:
            raise APIError(
                f"{where}: content blocks of type {block.type!r} are not supported; this "
                "server accepts text blocks only.",
                param=where,
            )
        texts.append(block.text)
    return "".join(texts)


class AnthropicMessage(AnthropicModel):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]


class CountTokensRequest(AnthropicModel):
    model: str
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[ContentBlock] | None = None

    def conversation(self) -> list[dict[str, str]]:
        conversation = []
        if self.system:
            conversation.append({"role": "system", "content": _blocks_text(self.system, "system")})
        for i, message in enumerate(self.messages):
            text = _blocks_text(message.content, f"messages.{i}.content")
            conversation.append({"role": message.role, "content": text})
        return conversation

    @property
    def continues_assistant(self) -> bool:
        """A final assistant message is a prefill: the reply continues it."""
        return self.messages[-1].role == "assistant"


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    temperature: float = Field(1.0, ge=0.0, le=1.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=1)
    stream: bool = False
    metadata: dict[str, Any] | None = None
