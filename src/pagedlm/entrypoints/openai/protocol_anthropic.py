"""Request bodies of the Anthropic Messages API (``/v1/messages``, ``/count_tokens``).

Tools arrive in Anthropic's shapes and are turned into the OpenAI ones the chat templates
and ``structured_request.plan_tools`` already take: a tool ``{name, description,
input_schema}`` becomes a function tool; ``tool_choice`` auto/any/tool/none becomes
"auto"/"required"/a named function/"none"; an assistant ``tool_use`` block becomes a
``tool_calls`` entry and a user ``tool_result`` block a ``tool`` message.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import ConfigDict, Field, model_validator

from pagedlm.entrypoints.openai.errors import APIError
from pagedlm.entrypoints.openai.fail_fast import FailFastModel
from pagedlm.entrypoints.openai.request_body import RequestModel

TOOL_SCHEMA_FIELD = "tools.{index}.input_schema"
"""Where a tool's parameter schema is (``structured_request.plan_tools``' ``schema_field``),
so that a schema's 400 names the field the client sent."""


class AnthropicModel(RequestModel):
    """Every request model of this API."""


class ContentBlock(FailFastModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: Any = None
    # tool_use (assistant turns)
    id: str | None = None
    name: str | None = None
    input: dict[str, Any] | None = None
    # tool_result (user turns)
    tool_use_id: str | None = None
    content: str | list[dict[str, Any]] | None = None
    # thinking (assistant turns)
    thinking: Any = None


def _block_text(block: ContentBlock, where: str) -> str:
    """The text of a ``text`` block; a 400 naming ``where`` for a malformed one."""
    if not isinstance(block.text, str):
        got = "none" if block.text is None else type(block.text).__name__
        raise APIError(
            f'{where}: a "text" block needs "text" to be a string, got {got}.', param=where
        )
    return block.text


def _unsupported_block(block: ContentBlock, where: str, allowed: str) -> APIError:
    why = (
        "this server serves a text-only model"
        if block.type in ("image", "document")
        else "this server does not support them here"
    )
    return APIError(
        f"{where}: content blocks of type {block.type!r} are not supported ({why}); send "
        f"{allowed}.",
        param=where,
    )


def _text_part(text: str) -> dict[str, str]:
    return {"type": "text", "text": text}


def system_content(content: str | list[ContentBlock]) -> str | list[dict[str, str]]:
    """``system`` as chat-template content: a string, or its text blocks as text parts."""
    if isinstance(content, str):
        return content
    parts = []
    for j, block in enumerate(content):
        if block.type != "text":
            raise _unsupported_block(block, f"system.{j}", "text blocks")
        parts.append(_text_part(_block_text(block, f"system.{j}")))
    return parts


def _blocks(content: str | list[ContentBlock]) -> list[ContentBlock]:
    return [ContentBlock(type="text", text=content)] if isinstance(content, str) else content


def _result_content(
    content: str | list[dict[str, Any]] | None, where: str
) -> str | list[dict[str, str]]:
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for block in content:
        if block.get("type") != "text" or not isinstance(block.get("text"), str):
            raise APIError(f"{where}: a tool_result holds text blocks only.", param=where)
        parts.append(_text_part(block["text"]))
    return parts


class AnthropicMessage(AnthropicModel):
    field_path = "messages[]"
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]

    def template_messages(self, where: str) -> list[dict[str, Any]]:
        """This turn as chat-template messages: tool results (as ``tool`` messages) first,
        then the turn's text and tool calls. Text blocks stay content parts, as an OpenAI
        chat message's text parts do: the server's content format (a template that prints
        a string gets them joined by newlines) applies to both alike. An assistant turn's
        thinking is its ``reasoning_content`` (the templates that show thoughts read it and
        choose which turns' to show); a redacted one, opaque, is left out."""
        if isinstance(self.content, str):
            return [{"role": self.role, "content": self.content}]
        parts, calls, results, thoughts = [], [], [], []
        for j, block in enumerate(self.content):
            at = f"{where}.{j}"
            if block.type == "text":
                parts.append(_text_part(_block_text(block, at)))
            elif block.type == "tool_use" and self.role == "assistant":
                if not block.name or block.id is None:
                    raise APIError(f"{at}: a tool_use block needs id and name.", param=at)
                function = {"name": block.name, "arguments": block.input or {}}
                calls.append({"id": block.id, "type": "function", "function": function})
            elif block.type == "thinking" and self.role == "assistant":
                if not isinstance(block.thinking, str):
                    raise APIError(
                        f'{at}: a "thinking" block needs "thinking" to be a string.', param=at
                    )
                thoughts.append(block.thinking)
            elif block.type == "redacted_thinking" and self.role == "assistant":
                continue
            elif block.type == "tool_result" and self.role == "user":
                if block.tool_use_id is None:
                    raise APIError(f"{at}: a tool_result block needs tool_use_id.", param=at)
                content = _result_content(block.content, at)
                results.append(
                    {"role": "tool", "tool_call_id": block.tool_use_id, "content": content}
                )
            else:
                raise _unsupported_block(
                    block,
                    at,
                    "text, tool_use and thinking (assistant) or tool_result (user) blocks",
                )
        messages = results
        if parts or calls or thoughts or not results:
            message: dict[str, Any] = {"role": self.role, "content": parts or ""}
            if thoughts:
                message["reasoning_content"] = "".join(thoughts)
            if calls:
                message["tool_calls"] = calls
            messages.append(message)
        return messages


class CountTokensRequest(AnthropicModel):
    model: str
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[ContentBlock] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _turns_have_content(self) -> CountTokensRequest:
        """Anthropic's rule: every turn holds a block, but a final assistant turn (an empty
        prefill)."""
        for i, message in enumerate(self.messages):
            last_assistant = i == len(self.messages) - 1 and message.role == "assistant"
            if message.content == [] and not last_assistant:
                raise APIError(
                    f"messages.{i}.content: a turn needs at least one content block (only "
                    "a final assistant turn may be empty); send its text, or drop the turn.",
                    param=f"messages.{i}.content",
                )
        return self

    def conversation(self) -> list[dict[str, Any]]:
        """The chat-template messages. Consecutive turns of one role are one turn, their
        blocks in order, as Anthropic combines them (a template that needs the roles to
        alternate would refuse them otherwise); each turn is checked on its own first, so
        a 400 names the block as the request numbers it."""
        conversation = []
        if self.system:
            conversation.append({"role": "system", "content": system_content(self.system)})
        turns: list[tuple[AnthropicMessage, list[dict[str, Any]]]] = []
        for i, message in enumerate(self.messages):
            messages = message.template_messages(f"messages.{i}.content")
            if turns and turns[-1][0].role == message.role:
                blocks = _blocks(turns[-1][0].content) + _blocks(message.content)
                merged = AnthropicMessage.model_construct(role=message.role, content=blocks)
                turns[-1] = (merged, merged.template_messages("messages"))
            else:
                turns.append((message, messages))
        for _, messages in turns:
            conversation.extend(messages)
        return conversation

    @property
    def continues_assistant(self) -> bool:
        """A final assistant message is a prefill: the reply continues it."""
        return self.messages[-1].role == "assistant"

    def function_tools(self) -> list[dict[str, Any]] | None:
        """``tools`` as OpenAI function tools."""
        if not self.tools:
            return None
        functions = []
        for i, tool in enumerate(self.tools):
            name, schema = tool.get("name"), tool.get("input_schema")
            if not isinstance(name, str) or not isinstance(schema, dict):
                raise APIError(
                    f"tools.{i} must be {{'name': ..., 'input_schema': {{...}}}} (a custom "
                    "tool); server tools are not supported.",
                    param=f"tools.{i}",
                )
            if not name:
                raise APIError(f"tools.{i}.name must be a non-empty string.", param=f"tools.{i}")
            function = {"name": name, "parameters": schema}
            if tool.get("description") is not None:
                function["description"] = tool["description"]
            functions.append({"type": "function", "function": function})
        return functions

    def function_tool_choice(self) -> tuple[str | dict[str, Any] | None, bool]:
        """(OpenAI ``tool_choice``, ``parallel_tool_calls``) for ``tool_choice``."""
        choice = self.tool_choice
        if choice is None:
            return None, True
        parallel = not choice.get("disable_parallel_tool_use", False)
        kind = choice.get("type")
        if kind in ("auto", "none"):
            return kind, parallel
        if kind == "any":
            return "required", parallel
        if kind == "tool" and isinstance(choice.get("name"), str):
            return {"type": "function", "function": {"name": choice["name"]}}, parallel
        raise APIError(
            'tool_choice must be {"type": "auto"}, {"type": "any"}, {"type": "none"} or '
            '{"type": "tool", "name": ...}.',
            param="tool_choice",
        )


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=1)
    stream: bool = False
    metadata: dict[str, Any] | None = None
