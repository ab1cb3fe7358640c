"""Chat completion chunks turned into Responses output items and stream events.

The chat path (``serving_chat``) already splits a choice's text into reasoning, content
and tool-call deltas; ``OutputBuilder`` regroups those deltas as OpenAI's output items,
one open at a time, in the order the model produced them:

- reasoning  -> a ``reasoning`` item with one ``reasoning_text`` part
  (``response.content_part.added``, ``response.reasoning_text.delta``*,
  ``response.reasoning_text.done``, ``response.content_part.done``),
- content    -> a ``message`` item with one ``output_text`` part
  (``response.content_part.added``, ``response.output_text.delta``*,
  ``response.output_text.done``, ``response.content_part.done``),
- a tool call -> a ``function_call`` item (``response.function_call_arguments.delta``*,
  ``response.function_call_arguments.done``),

each between ``response.output_item.added`` and ``response.output_item.done``. Events
come without ``sequence_number``; the server numbers what it sends.

Chat's token logprobs (``include=["message.output_text.logprobs"]``) go with the text
deltas. A chat chunk's logprobs are those of the tokens since the last chunk, including
tokens the parsers held back (a ``</think>`` tag, say) and wrote nothing for: a content
delta gets the last of them whose text spells the delta (``_spelling``); the rest, and
those of reasoning or tool-call deltas, are not output text and are dropped.
"""

from __future__ import annotations

import copy
import uuid
from typing import Any


def new_item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _event(kind: str, **fields: Any) -> dict[str, Any]:
    return {"type": kind, **fields}


def _spelling(logprobs: list[dict[str, Any]], text: str) -> list[dict[str, Any]]:
    """The fewest last ``logprobs`` whose tokens spell ``text``; all of them where no
    run does (tokens that are not text: byte pieces, ``token_id:`` spellings)."""
    spelled = ""
    for start in range(len(logprobs) - 1, -1, -1):
        spelled = logprobs[start]["token"] + spelled
        if spelled == text:
            return logprobs[start:]
        if len(spelled) > len(text):
            break
    return logprobs


class OutputBuilder:
    """Feed one choice's chat chunks (``feed``), then ``finish``; ``items`` is the
    response's ``output``, ``finish_reason`` and ``usage`` come from the chunks."""

    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []
        self.finish_reason: str | None = None
        self.usage: dict[str, Any] | None = None
        self._open: dict[str, Any] | None = None
        self._pieces: list[str] = []
        self._logprobs: list[dict[str, Any]] = []
        """The open message's token logprobs."""
        self._pending_logprobs: list[dict[str, Any]] = []
        """Logprobs of tokens whose text the chat parsers still hold."""

    def feed(self, chunk: dict[str, Any]) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        for choice in chunk.get("choices", []):
            delta = choice.get("delta") or {}
            self._pending_logprobs += (choice.get("logprobs") or {}).get("content") or []
            if delta.get("reasoning_content"):
                events += self._text("reasoning", delta["reasoning_content"])
            if delta.get("content"):
                events += self._text("message", delta["content"])
            elif delta.get("reasoning_content") or delta.get("tool_calls"):
                self._pending_logprobs = []
            for call in delta.get("tool_calls") or []:
                events += self._call(call)
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
        return events

    def finish(self) -> list[dict[str, Any]]:
        """Close the item still open (its status says whether the output was cut: by
        ``max_output_tokens``, or by an abort)."""
        cut = self.finish_reason in ("length", "abort")
        return self._close("incomplete" if cut else "completed")

    def fail(self) -> list[dict[str, Any]]:
        """Close the item still open as cut: the generation failed."""
        return self._close("incomplete")

    def _start(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        events = self._close("completed")
        self._open, self._pieces, self._logprobs = item, [], []
        self.items.append(item)
        events.append(
            _event(
                "response.output_item.added",
                output_index=len(self.items) - 1,
                item=copy.deepcopy(item),
            )
        )
        return events

    def _where(self) -> dict[str, Any]:
        assert self._open is not None
        return {"item_id": self._open["id"], "output_index": len(self.items) - 1}

    def _text(self, kind: str, text: str) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if self._open is None or self._open["type"] != kind:
            if kind == "message":
                item = {"id": new_item_id("msg"), "type": "message", "status": "in_progress"}
                item |= {"role": "assistant", "content": []}
            else:
                item = {"id": new_item_id("rs"), "type": "reasoning", "summary": [], "content": []}
            events += self._start(item)
            part = (
                {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
                if kind == "message"
                else {"type": "reasoning_text", "text": ""}
            )
            events.append(
                _event("response.content_part.added", **self._where(), content_index=0, part=part)
            )
        self._pieces.append(text)
        name = (
            "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta"
        )
        extra = {}
        if kind == "message":
            extra["logprobs"] = _spelling(self._pending_logprobs, text)
            self._logprobs += extra["logprobs"]
            self._pending_logprobs = []
        events.append(_event(name, **self._where(), content_index=0, delta=text, **extra))
        return events

    def _call(self, call: dict[str, Any]) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        function = call.get("function") or {}
        if call.get("id") is not None:  # chat's first delta of a call carries its id and name
            item = {"id": new_item_id("fc"), "type": "function_call", "status": "in_progress"}
            item |= {"call_id": call["id"], "name": function.get("name", ""), "arguments": ""}
            events += self._start(item)
        arguments = function.get("arguments") or ""
        if arguments and self._open is not None:
            self._pieces.append(arguments)
            events.append(
                _event("response.function_call_arguments.delta", **self._where(), delta=arguments)
            )
        return events

    def _close(self, status: str) -> list[dict[str, Any]]:
        item = self._open
        if item is None:
            return []
        where, text = self._where(), "".join(self._pieces)
        events: list[dict[str, Any]] = []
        if item["type"] == "message":
            logprobs = self._logprobs
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}
            item["content"], item["status"] = [part], status
            events.append(
                _event(
                    "response.output_text.done",
                    **where,
                    content_index=0,
                    text=text,
                    logprobs=logprobs,
                )
            )
            events.append(_event("response.content_part.done", **where, content_index=0, part=part))
        elif item["type"] == "reasoning":
            part = {"type": "reasoning_text", "text": text}
            item["content"] = [part]
            events.append(
                _event("response.reasoning_text.done", **where, content_index=0, text=text)
            )
            events.append(_event("response.content_part.done", **where, content_index=0, part=part))
        else:
            item["arguments"], item["status"] = text, status
            events.append(
                _event(
                    "response.function_call_arguments.done",
                    **where,
                    name=item["name"],
                    arguments=text,
                )
            )
        events.append(
            _event("response.output_item.done", output_index=where["output_index"], item=item)
        )
        self._open = None
        return events

    def assistant_message(self) -> dict[str, Any]:
        """The output as one chat assistant message (for the stored conversation)."""
        text = "".join(
            part["text"]
            for item in self.items
            if item["type"] == "message"
            for part in item["content"]
        )
        calls = [
            {
                "id": item["call_id"],
                "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]},
            }
            for item in self.items
            if item["type"] == "function_call"
        ]
        message: dict[str, Any] = {"role": "assistant", "content": text or (None if calls else "")}
        if calls:
            message["tool_calls"] = calls
        return message
