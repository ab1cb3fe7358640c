"""The body of ``POST /v1/responses`` (OpenAI's Responses API) and its mapping onto chat.

A Responses request is served by the chat path: ``input`` items become chat messages,
flat function tools become chat tools, ``text.format`` becomes ``response_format``
(``ResponsesRequest.chat_request``). Fields of OpenAI's API this server does not serve
(``background``, hosted tools such as ``web_search``, ``conversation``, ...) are a 400
naming the field, never silently dropped: they change what the client gets back.
"""

from __future__ import annotations

import json
import re
from typing import Any, Literal

from pydantic import Field, ValidationError

from pagedlm.entrypoints.openai.cache_salt import CacheSalt
from pagedlm.entrypoints.openai.errors import APIError
from pagedlm.entrypoints.openai.protocol import ChatCompletionRequest, OpenAIModel
from pagedlm.entrypoints.openai.request_body import validation_message
from pagedlm.entrypoints.openai.responses_input import ChatLayout
from pagedlm.sampling_params import MAX_TEMPERATURE

TEXT_PART_TYPES = frozenset({"input_text", "output_text", "text"})
UNSERVED_PART_TYPES = frozenset({"input_image", "input_file", "input_audio"})
"""Parts ``_text`` refuses; a message's ``input_image`` parts go to the chat path instead."""
MESSAGE_ROLES = frozenset({"user", "assistant", "system", "developer"})
SKIPPED_ITEM_TYPES = frozenset({"reasoning"})
"""Input items sent back from an earlier output that the prompt leaves out (as chat
leaves out ``reasoning_content``)."""
OUTPUT_LOGPROBS = "message.output_text.logprobs"
INCLUDABLE = frozenset({OUTPUT_LOGPROBS, "reasoning.encrypted_content"})
"""``include`` values served. ``reasoning.encrypted_content`` asks for reasoning a
stateless client can send back: reasoning items here carry their text in the clear (no
``encrypted_content``), and reasoning sent back is left out of the prompt either way."""
CHAT_FIELD_NAMES = (
    (re.compile(r"\bmax_(?:completion_)?tokens\b"), "max_output_tokens"),
    (re.compile(r"\btools\.(\d+)\.function\."), r"tools.\1."),
    (re.compile(r"\bresponse_format(?:\.json_schema)?\b"), "text.format"),
)
"""Chat's names of the fields ``chat_request`` fills, and the Responses fields they
come from (chat's errors name its own fields)."""


class TextConfig(OpenAIModel):
    field_path = "text"
    format: dict[str, Any] | None = None
    verbosity: str | None = None


class ReasoningConfig(OpenAIModel):
    """OpenAI's ``reasoning``: ``effort`` is handed to the chat template (as chat's
    ``reasoning_effort``; a template that does not read it ignores it). Summaries are
    not written: a reasoning parser's output is the reasoning item's full text, as in
    vLLM, which accepts ``summary`` the same way."""

    field_path = "reasoning"
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None
    """OpenAI's deprecated spelling of ``summary``."""

    def echoed(self) -> dict[str, Any]:
        """The response's ``reasoning``."""
        return {"effort": self.effort, "summary": self.summary or self.generate_summary}


class ResponsesRequest(OpenAIModel):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=MAX_TEMPERATURE)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    service_tier: str | None = None
    reasoning: ReasoningConfig | None = None
    include: list[str] | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    """Alternatives per token with ``include=["message.output_text.logprobs"]``."""
    cache_salt: CacheSalt = None
    """vLLM's (``cache_salt.py``): the prompt shares prefix-cache blocks only with prompts
    of the same salt."""
    # OpenAI fields this server does not serve: sent with a value, they are a 400.
    background: bool | None = None
    conversation: str | dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None
    max_tool_calls: int | None = None
    truncation: str | None = None

    def check_served(self) -> None:
        """400 naming the first field whose value asks for what this server cannot do."""
        refused = {
            "background": self.background is True,
            "conversation": self.conversation is not None,
            "prompt": self.prompt is not None,
            "max_tool_calls": self.max_tool_calls is not None,
            "truncation": self.truncation not in (None, "disabled"),
        }
        for name, sent in refused.items():
            if sent:
                raise APIError(
                    f"{name} is not supported by this server's /v1/responses; leave it out.",
                    param=name,
                )
        for i, value in enumerate(self.include or []):
            if value not in INCLUDABLE:
                raise APIError(
                    f"include.{i}: {value!r} is not served by this server's /v1/responses; "
                    f"include may name {sorted(INCLUDABLE)}.",
                    param=f"include.{i}",
                )

    def input_messages(self) -> list[dict[str, Any]]:
        """``input`` as chat messages (``ChatMessage`` dicts), instructions excluded."""
        return self._converted()[0]

    def chat_layout(self, num_previous: int) -> ChatLayout:
        """Where this request's parts land in its chat request, after ``num_previous``
        messages of the previous response's conversation."""
        sources = self._converted()[1]
        types = (
            [] if isinstance(self.input, str) else [i.get("type", "message") for i in self.input]
        )
        return ChatLayout(bool(self.instructions), num_previous, sources, tuple(types))

    def _converted(self) -> tuple[list[dict[str, Any]], tuple[tuple[int, ...], ...]]:
        """(chat messages, per message the indices of the input items it came from)."""
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}], ((0,),)
        messages: list[dict[str, Any]] = []
        sources: list[list[int]] = []
        for i, item in enumerate(self.input):
            before = len(messages)
            _append_item(messages, item, f"input.{i}")
            if len(messages) > before:
                sources.append([i])
            elif item.get("type") == "function_call":  # merged into the turn before it
                sources[-1].append(i)
        return messages, tuple(tuple(source) for source in sources)

    def chat_request(self, messages: list[dict[str, Any]]) -> ChatCompletionRequest:
        """The streaming chat request that generates this response from ``messages``."""
        if self.instructions:
            messages = [{"role": "system", "content": self.instructions}, *messages]
        if not messages:
            raise APIError("input is empty; send a string or at least one item.", param="input")
        try:
            chat = self._chat_request(messages)
        except ValidationError as error:  # an item that maps onto a malformed chat field
            message, param = validation_message(error)
            raise APIError(message, param=param) from None
        chat._body_bytes = self.body_bytes  # its work grows with this body
        return chat

    def _chat_request(self, messages: list[dict[str, Any]]) -> ChatCompletionRequest:
        return ChatCompletionRequest.model_validate(
            {
                "model": self.model,
                "messages": messages,
                "max_completion_tokens": self.max_output_tokens,
                "temperature": self.temperature,
                "top_p": self.top_p,
                "tools": _chat_tools(self.tools) if self.tools else None,
                "tool_choice": _chat_tool_choice(self.tool_choice),
                "parallel_tool_calls": self.parallel_tool_calls,
                "response_format": _response_format(self.text),
                "user": self.user,
                "logprobs": self.output_logprobs,
                "top_logprobs": self.top_logprobs if self.output_logprobs else None,
                "chat_template_kwargs": self._template_kwargs(),
                "cache_salt": self.cache_salt,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
        )

    @property
    def output_logprobs(self) -> bool:
        return OUTPUT_LOGPROBS in (self.include or [])

    def _template_kwargs(self) -> dict[str, Any] | None:
        # not chat's reasoning_effort field: OpenAI's Responses efforts outnumber chat's
        effort = self.reasoning.effort if self.reasoning is not None else None
        return {"reasoning_effort": effort} if effort is not None else None


def responses_error(error: APIError, layout: ChatLayout) -> APIError:
    """An error of the chat request that serves a response, naming the Responses
    request's fields (``max_output_tokens``, not chat's ``max_tokens``; ``input.4``, not
    chat's ``messages.3``: ``layout``)."""
    message = layout.located(error.message)
    param = layout.param(error.param) if error.param is not None else None
    for chat_name, name in CHAT_FIELD_NAMES:
        message = chat_name.sub(name, message)
        param = chat_name.sub(name, param) if param is not None else None
    return APIError(message, error.status, param)


def _text(content: Any, where: str) -> str:
    """A message's or tool output's content (a string or text parts) as text."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(f"{where} must be a string or a list of content parts.", param=where)
    return "\n".join(_part_text(part, f"{where}.{j}") for j, part in enumerate(content))


def _part_text(part: Any, place: str) -> str:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind in TEXT_PART_TYPES and isinstance(part.get("text"), str):
        return part["text"]
    if kind in UNSERVED_PART_TYPES:
        raise APIError(
            f"{place}: {kind!r} parts are not supported: this server serves a text-only "
            'model; send {"type": "input_text", "text": ...} parts.',
            param=place,
        )
    raise APIError(
        f'{place} must be {{"type": "input_text", "text": ...}} (or "output_text").',
        param=place,
    )


def _message_content(content: Any, where: str) -> str | list[dict[str, Any]]:
    """A message's content for the chat template: text, or, where it holds ``input_image``
    parts, chat parts (images by URL, which the chat path loads: a 400 there for a text-only
    model or a bad image)."""
    images = isinstance(content, list) and any(
        isinstance(part, dict) and part.get("type") == "input_image" for part in content
    )
    if not images:
        return _text(content, where)
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        place = f"{where}.{j}"
        if isinstance(part, dict) and part.get("type") == "input_image":
            url = part.get("image_url")
            if not isinstance(url, str) or not url:
                raise APIError(
                    f"{place}: an input_image part needs image_url (a data: URL or an http(s) "
                    "URL); file_id is not served here.",
                    param=place,
                )
            parts.append({"type": "input_image", "image_url": url})
        else:
            parts.append({"type": "text", "text": _part_text(part, place)})
    return parts


def _append_item(messages: list[dict[str, Any]], item: Any, where: str) -> None:
    if not isinstance(item, dict):
        raise APIError(
            f"{where} must be an object (a message or a function call item).", param=where
        )
    kind = item.get("type", "message")
    if kind == "message":
        role = item.get("role")
        if role not in MESSAGE_ROLES:
            raise APIError(
                f"{where}.role must be one of {sorted(MESSAGE_ROLES)}, got {role!r}.", param=where
            )
        content = _message_content(item.get("content"), f"{where}.content")
        messages.append({"role": role, "content": content})
    elif kind == "function_call":
        call_id, name, arguments = (item.get(key) for key in ("call_id", "name", "arguments"))
        if not all(isinstance(value, str) for value in (call_id, name, arguments)):
            raise APIError(
                f"{where}: a function_call needs call_id, name and arguments.", param=where
            )
        try:
            json.loads(arguments)
        except ValueError as error:
            raise APIError(
                f"{where}.arguments is not valid JSON ({error}); send the call's arguments as "
                "a JSON object in a string.",
                param=f"{where}.arguments",
            ) from None
        call = {
            "id": call_id,
            "type": "function",
            "function": {"name": name, "arguments": arguments},
        }
        last = messages[-1] if messages else None
        if last is not None and last["role"] == "assistant":
            last.setdefault("tool_calls", []).append(call)  # one turn: text then its calls
        else:
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
    elif kind == "function_call_output":
        if not isinstance(item.get("call_id"), str):
            raise APIError(f"{where}: a function_call_output needs its call_id.", param=where)
        output = _text(item.get("output"), f"{where}.output")
        messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": output})
    elif kind not in SKIPPED_ITEM_TYPES:
        raise APIError(
            f"{where}: input items of type {kind!r} are not supported; send message, "
            "function_call or function_call_output items.",
            param=where,
        )


def _chat_tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    chat_tools = []
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise APIError(
                f"tools.{i}: tools of type {kind!r} are not supported; this server serves "
                'function tools ({"type": "function", "name": ..., "parameters": {...}}).',
                param=f"tools.{i}.type",
            )
        function = {key: tool[key] for key in ("name", "description", "parameters") if key in tool}
        chat_tools.append({"type": "function", "function": function})
    return chat_tools


def _chat_tool_choice(tool_choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if tool_choice is None or isinstance(tool_choice, str):
        return tool_choice  # "none" / "auto" / "required"; chat checks the value
    if tool_choice.get("type") == "function" and isinstance(tool_choice.get("name"), str):
        return {"type": "function", "function": {"name": tool_choice["name"]}}
    raise APIError(
        'tool_choice must be "none", "auto", "required" or {"type": "function", "name": ...}.',
        param="tool_choice",
    )


def _response_format(text: TextConfig | None) -> dict[str, Any] | None:
    spec = text.format if text is not None else None
    if spec is None or spec.get("type") == "text":
        return None
    if spec.get("type") == "json_object":
        return {"type": "json_object"}
    if spec.get("type") == "json_schema":
        if not isinstance(spec.get("schema"), dict):
            raise APIError(
                'text.format.schema must be a JSON schema object: {"type": "json_schema", '
                '"name": ..., "schema": {...}}.',
                param="text.format.schema",
            )
        schema = {"name": spec.get("name", "output"), "schema": spec["schema"]}
        return {"type": "json_schema", "json_schema": schema}
    raise APIError(
        f"text.format type {spec.get('type')!r} is not supported; use 'text', 'json_object' "
        "or 'json_schema'.",
        param="text.format",
    )
