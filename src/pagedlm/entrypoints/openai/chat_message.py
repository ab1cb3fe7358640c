"""A chat message of the OpenAI API (``messages[]``) and what chat templates get from it.

Content is a string or a list of parts: strings and objects, read as vLLM reads them
(``pagedlm.chat_content``): a part without ``"type"`` takes the type its key implies
(``{"image_url": ...}``), the text kinds (``"text"``, ``"input_text"``, ``"refusal"``, ...)
are text, null ``"text"``/``"refusal"`` parts are skipped and tool references are handed
on. The text path serves text parts only; a conversation with image parts takes the
image path (``chat_images``) on a vision model. A malformed or unsupported part is a 400
naming its place ("messages.2.content.1") and the fix. Templates get text parts as
``{"type": "text", "text": ...}``; the renderer hands them on as one string or as the list
(``pagedlm.chat_content``).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, ConfigDict, field_validator
from pydantic_core import PydanticCustomError

from pagedlm.chat_content import (
    TEXT_PART_FIELDS,
    TOOL_REFERENCE,
    ContentPartError,
    part_text,
    part_type,
    skipped_part,
    tool_reference,
)
from pagedlm.entrypoints.openai.errors import APIError
from pagedlm.entrypoints.openai.fail_fast import FailFastModel
from pagedlm.entrypoints.openai.request_body import RequestModel


class ContentPart(FailFastModel):
    """A content part as an object: ``{"type": "text", "text": ...}``, ``{"type":
    "image_url", "image_url": {"url": ...}}``, ... (a part without ``"type"`` gets the one
    its key implies); what a type does not use is kept and ignored."""

    model_config = ConfigDict(extra="allow")
    type: str
    text: Any = None


def _typed_part(part: Any) -> Any:
    """A part object with its ``"type"`` (the implied one where it has none); a 400 that
    says what to send for anything that is not a string or such an object."""
    if isinstance(part, str) or (isinstance(part, dict) and isinstance(part.get("type"), str)):
        return part
    if not isinstance(part, dict):
        got = "null" if part is None else type(part).__name__
        raise PydanticCustomError(
            "content_part",
            f"a content part is a string or an object such as "
            f'{{"type": "text", "text": "..."}}, got {got}.',
        )
    try:
        kind = part_type(part, "")
    except ContentPartError as error:
        raise PydanticCustomError("content_part", str(error).removeprefix(": ")) from None
    return {**part, "type": kind}


Part = Annotated[str | ContentPart, BeforeValidator(_typed_part)]
UNSERVED_PART_TYPES = frozenset(
    {
        "image_url",
        "input_image",
        "image_embeds",
        "input_audio",
        "audio_url",
        "audio_embeds",
        "video_url",
        "file",
        "prompt_embeds",
    }
)


def _part_text(part: str | ContentPart, where: str) -> str:
    if isinstance(part, str):
        return part
    if part.type == "text" and isinstance(part.text, str):
        return part.text
    text = part_text(part.model_dump())
    if text is not None:
        return text
    if part.type in TEXT_PART_FIELDS:
        field = TEXT_PART_FIELDS[part.type]
        value = getattr(part, field, None)
        got = "none" if value is None else type(value).__name__
        raise APIError(
            f'{where}: a "{part.type}" part needs "{field}" to be a string, got {got}.',
            param=where,
        )
    if part.type in UNSERVED_PART_TYPES:
        raise APIError(
            f"{where}: content parts of type {part.type!r} are not supported: this server "
            'serves a text-only model; send {"type": "text", "text": ...} parts.',
            param=where,
        )
    raise APIError(
        f"{where}: unknown content part type {part.type!r:.80}; send "
        '{"type": "text", "text": ...}.',
        param=where,
    )


class ChatMessage(RequestModel):
    field_path = "messages[]"
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[Part] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _check_content(cls, content: Any) -> Any:
        """One 400 that says what content may be (pydantic's would list its union's
        internal types)."""
        if content is None or isinstance(content, str | list):
            return content
        got = "an object" if isinstance(content, dict) else type(content).__name__
        fix = "; wrap the part in a list" if isinstance(content, dict) else ""
        raise PydanticCustomError(
            "content",
            "content is a string, a list of content parts (such as "
            f'[{{"type": "text", "text": "..."}}]) or null, got {got}{fix}.',
        )

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

    def texts(self) -> list[str]:
        """The text of the content: a string, or of each text part (a string part or one of
        vLLM's text kinds); other parts and malformed text parts give none."""
        if self.content is None or isinstance(self.content, str):
            return [] if self.content is None else [self.content]
        texts = (part_text(p if isinstance(p, str) else p.model_dump()) for p in self.content)
        return [text for text in texts if text is not None]

    def template_content(self, where: str) -> str | list[dict[str, str]] | None:
        """The content, its parts checked and rebuilt as ``{"type": "text", "text": ...}``
        (tool references as ``{"type": "tool_reference", "name": ...}``; null ``"text"``
        and ``"refusal"`` parts skipped, as vLLM skips them)."""
        if self.content is None or isinstance(self.content, str):
            return self.content
        parts = []
        for j, part in enumerate(self.content):
            place = f"{where}.content.{j}"
            dumped = part if isinstance(part, str) else part.model_dump()
            if skipped_part(dumped, place):
                continue
            if isinstance(part, ContentPart) and part.type == TOOL_REFERENCE:
                try:
                    parts.append(tool_reference(dumped, place))
                except ContentPartError as error:
                    raise APIError(str(error), param=place) from None
                continue
            parts.append({"type": "text", "text": _part_text(part, place)})
        return parts


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
