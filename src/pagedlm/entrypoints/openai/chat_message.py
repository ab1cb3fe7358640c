"""A chat message of the OpenAI API (``messages[]``) and what chat templates get from it.

Content is a string or a list of parts; only text parts are served (this server runs
text-only models), and a malformed or unsupported part is a 400 naming its place
("messages.2.content.1") and the fix. Templates get the parts as they came; the renderer
hands them on as one string or as the list (``pagedlm.chat_content``).
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from pagedlm.entrypoints.openai.errors import APIError
from pagedlm.entrypoints.openai.request_body import RequestModel


class TextPart(BaseModel):
    """A content part; only text parts are served, the rest get a 400 that names them."""

    model_config = ConfigDict(extra="allow")
    type: str
    text: Any = None


UNSERVED_PART_TYPES = frozenset(
    {"image_url", "input_image", "image_embeds", "input_audio", "audio_url", "video_url", "file"}
)


def _part_text(part: TextPart, where: str) -> str:
    if part.type == "text":
        if not isinstance(part.text, str):
            got = "none" if part.text is None else type(part.text).__name__
            raise APIError(
                f'{where}: a "text" part needs "text" to be a string, got {got}.', param=where
            )
        return part.text
    if part.type in UNSERVED_PART_TYPES:
        raise APIError(
            f"{where}: content parts of type {part.type!r} are not supported: this server "
            'serves a text-only model; send {"type": "text", "text": ...} parts.',
            param=where,
        )
    raise APIError(
        f'{where}: unknown content part type {part.type!r}; send {{"type": "text", "text": ...}}.',
        param=where,
    )


class ChatMessage(RequestModel):
    field_path = "messages[]"
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None

    def template_message(self, where: str) -> dict[str, Any]:
        """The message as chat templates expect it (tool-call arguments as objects);
        ``where`` ("messages.3") locates it in errors."""
        message: dict[str, Any] = {"role": self.role, "content": self.template_content(where)}
        if self.tool_calls:
            message["tool_calls"] = [
                _template_tool_call(call, f"{where}.tool_calls.{j}")
                for j, call in enumerate(self.tool_calls)
            ]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.name is not None and self.role == "tool":
            message["name"] = self.name
        return message

    def template_content(self, where: str) -> str | list[dict[str, str]] | None:
        """The content, its parts checked and rebuilt as ``{"type": "text", "text": ...}``."""
        if self.content is None or isinstance(self.content, str):
            return self.content
        return [
            {"type": "text", "text": _part_text(part, f"{where}.content.{j}")}
            for j, part in enumerate(self.content)
        ]


def _template_tool_call(call: dict[str, Any], where: str) -> dict[str, Any]:
    # Templates (Qwen, Hermes, Llama 3) render arguments with tojson: they need an object.
    function = call.get("function")
    if isinstance(function, dict) and isinstance(function.get("arguments"), str):
        try:
            arguments = json.loads(function["arguments"])
        except ValueError as error:
            place = f"{where}.function.arguments"
            raise APIError(
                f"{place} is not valid JSON ({error}); send the call's arguments as a JSON "
                "object in a string.",
                param=place,
            ) from None
        return {**call, "function": {**function, "arguments": arguments}}
    return call
