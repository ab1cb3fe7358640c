"""A Responses request's ``input`` after the fact: the items ``GET
/v1/responses/{id}/input_items`` lists, and where each chat message came from.

``input_items`` gives every input item as OpenAI returns it: with an ``id`` (the client's,
else a new one), a message's content as parts (``input_text``; an assistant's
``output_text``), a call's and a call output's fields.

``ChatLayout`` records how the chat request that serves a response was laid out (the
instructions' system message first, then the previous response's conversation, then the
input's messages, a ``function_call`` item merged into the assistant turn before it), so a
chat error naming ``messages.3.tool_calls.0.function.arguments`` can name the Responses
field instead (``input.4.arguments``): ``param``, ``located``. A place that maps onto no single item
loses its index (``input``), one in the previous response's conversation names
``previous_response_id``: never a wrong index.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from pagedlm.entrypoints.openai.responses_output import new_item_id

CHAT_PLACE = re.compile(r"\bmessages\.(\d+)((?:\.\w+)*)")
"""A place in chat's request ("messages.3.tool_calls.0.function.arguments")."""
CALL_FIELDS = {".function.arguments": ".arguments", ".function.name": ".name", ".id": ".call_id"}
"""Places in a chat tool call and the ``function_call`` item fields they come from."""
ITEM_ID_PREFIXES = {"message": "msg", "function_call": "fc", "function_call_output": "fco"}


@dataclass(frozen=True)
class ChatLayout:
    has_instructions: bool
    num_previous: int
    """Messages of the previous response's conversation."""
    sources: tuple[tuple[int, ...], ...]
    """Per input message, the indices of the input items it was made from (one, or a
    message item and the function_call items merged into its turn)."""
    item_types: tuple[str, ...]
    """Per input item, its type (a string input: none)."""

    def place(self, index: int, rest: str) -> str:
        """The Responses field of chat's ``messages.{index}{rest}``."""
        first_input = int(self.has_instructions) + self.num_previous
        if index < int(self.has_instructions):
            return "instructions"
        if index < first_input:
            return "previous_response_id"
        if index - first_input >= len(self.sources) or not self.item_types:
            return "input"
        sources = self.sources[index - first_input]
        calls = [i for i in sources if self.item_types[i] == "function_call"]
        text_item = sources[0] if self.item_types[sources[0]] != "function_call" else None
        if rest.startswith(".tool_calls."):
            number, _, field = rest.removeprefix(".tool_calls.").partition(".")
            if not number.isdigit() or int(number) >= len(calls):
                return "input"
            return f"input.{calls[int(number)]}{CALL_FIELDS.get('.' + field, '')}"
        if rest.startswith((".content", ".tool_call_id")) and text_item is not None:
            if rest.startswith(".tool_call_id"):
                return f"input.{text_item}.call_id"
            if self.item_types[text_item] == "function_call_output":
                return f"input.{text_item}.output"
            # A message with images keeps its parts one for one (else its text is joined).
            return f"input.{text_item}.content{rest.removeprefix('.content')}"
        return f"input.{sources[0]}" if len(sources) == 1 else "input"

    def param(self, name: str) -> str:
        """A chat error's ``param`` as the Responses field."""
        if name == "messages":
            return "input"
        match = CHAT_PLACE.fullmatch(name)
        return self.place(int(match[1]), match[2]) if match else name

    def located(self, text: str) -> str:
        """``text`` with every chat place in it named as the Responses field."""

        def named(match: re.Match[str]) -> str:
            place = self.place(int(match[1]), match[2])
            if place == "previous_response_id":
                return "a message of an earlier turn (previous_response_id)"
            return place

        return CHAT_PLACE.sub(named, text)


def input_items(input_: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The request's input items as ``input_items`` lists them (input already checked)."""
    if isinstance(input_, str):
        return [_message({"role": "user", "content": input_})]
    return [_item(item) for item in input_]


def _item(item: dict[str, Any]) -> dict[str, Any]:
    kind = item.get("type", "message")
    if kind == "message":
        return _message(item)
    listed = {**item, "id": _item_id(item, kind)}
    if kind in ("function_call", "function_call_output"):
        listed.setdefault("status", "completed")
    return listed


def _message(item: dict[str, Any]) -> dict[str, Any]:
    assistant = item["role"] == "assistant"
    content = item["content"]
    if isinstance(content, str):
        content = [{"type": "text", "text": content}]
    kind = "output_text" if assistant else "input_text"
    parts = [
        {
            "type": "input_image",
            "image_url": part["image_url"],
            "detail": part.get("detail", "auto"),
        }
        if part.get("type") == "input_image"
        else {"type": kind, "text": part["text"]}
        for part in content
    ]
    if assistant:
        parts = [{**part, "annotations": []} for part in parts]
    return {
        "id": _item_id(item, "message"),
        "type": "message",
        "role": item["role"],
        "status": item.get("status", "completed"),
        "content": parts,
    }


def _item_id(item: dict[str, Any], kind: str) -> str:
    given = item.get("id")
    return given if isinstance(given, str) else new_item_id(ITEM_ID_PREFIXES.get(kind, "item"))
