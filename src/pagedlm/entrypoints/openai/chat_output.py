"""One chat choice's text turned into OpenAI message fields: reasoning, content, tool calls.

The model's text goes through the reasoning parser (if the server has one), and the
content that comes out goes through the tool parser (if the request uses one). Streaming
and non-streaming responses use the same deltas, so they always agree. Each call gets an id
in its model family's form (``ToolParser.new_call_id``). A request's reasoning parsers are
made for its rendered prompt (``reasoning_factory``): a template or a prefill may have opened
the thought or closed it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pagedlm.entrypoints.openai.reasoning_parsers import (
    ReasoningParser,
    reasoning_parser_factory,
)
from pagedlm.entrypoints.openai.reasoning_parsers.prompt import current_turn
from pagedlm.entrypoints.openai.tool_parsers import ParsedDelta, ToolCallDelta, ToolParser


def reasoning_factory(
    parser_class: type[ReasoningParser] | None,
    tokenizer: Any,
    prompt_token_ids: Sequence[int],
    constrained: bool = False,
) -> Callable[[], ReasoningParser] | None:
    """Makes a request's reasoning parsers (one per choice) given how its prompt ends: the
    text of its current turn (``current_turn``); no tokenizer, nothing known of the prompt.
    ``constrained``: the engine constrains the output with a grammar from its first token
    (it applies grammars after the thought only with a reasoning parser of its own:
    ``structured_outputs_config``), so the output starts after any thought."""
    if parser_class is None:
        return None
    tail = current_turn(parser_class, tokenizer, prompt_token_ids)
    return reasoning_parser_factory(parser_class, tail, closed=constrained)


@dataclass
class ChatOutputParser:
    """Per-choice parser chain; ``feed``/``finish`` return an OpenAI ``delta`` dict (or {})."""

    reasoning_parser: ReasoningParser | None = None
    tool_parser: ToolParser | None = None
    new_call_id: Callable[[], str] | None = None
    """Names each call; None: the tool parser's own ``new_call_id``."""
    reasoning: list[str] = field(default_factory=list)
    content: list[str] = field(default_factory=list)
    call_ids: list[str] = field(default_factory=list)
    call_names: list[str] = field(default_factory=list)
    call_arguments: list[list[str]] = field(default_factory=list)
    num_reasoning_tokens: int = 0
    """Output tokens of the reasoning, its markers and framing left out (vLLM's
    ``reasoning_tokens``); see ``_count_reasoning``."""
    _held_tokens: int = field(default=0, repr=False)
    _held_chars: int = field(default=0, repr=False)

    @classmethod
    def build(
        cls,
        new_reasoning_parser: Callable[[], ReasoningParser] | None,
        new_tool_parser: Callable[[], ToolParser] | None,
        new_call_id: Callable[[], str] | None = None,
    ) -> ChatOutputParser:
        return cls(
            new_reasoning_parser() if new_reasoning_parser else None,
            new_tool_parser() if new_tool_parser else None,
            new_call_id,
        )

    def feed(self, text: str, num_tokens: int = 0) -> dict[str, Any]:
        """The delta for the next ``text``, which ``num_tokens`` output tokens spell."""
        delta = self._step(text, final=False)
        self._count_reasoning(delta, text, num_tokens)
        return delta

    def finish(self) -> dict[str, Any]:
        delta = self._step("", final=True)
        self._count_reasoning(delta, "", 0)
        return delta

    def _count_reasoning(self, delta: dict[str, Any], text: str, num_tokens: int) -> None:
        """A step's tokens are reasoning when all it wrote is reasoning. Tokens whose text
        the parsers held (a marker, or what might have been one) wait for the step that
        releases it: they are reasoning when all of their text came out as reasoning (no
        marker was consumed). A step that ends the thought and starts the answer at once
        (several tokens in one step) counts by the reasoning's share of its text."""
        if not delta:
            self._held_tokens += num_tokens
            self._held_chars += len(text)
            return
        reasoning = len(delta.get("reasoning_content", ""))
        other = len(delta.get("content", "")) + len(delta.get("tool_calls", []))
        if reasoning and not other:
            self.num_reasoning_tokens += num_tokens
            if reasoning >= self._held_chars + len(text):
                self.num_reasoning_tokens += self._held_tokens
        elif reasoning:
            self.num_reasoning_tokens += num_tokens * reasoning // (reasoning + other)
        self._held_tokens = self._held_chars = 0

    def _step(self, text: str, final: bool) -> dict[str, Any]:
        reasoning, content = "", text
        if self.reasoning_parser is not None:
            piece = self.reasoning_parser.finish() if final else self.reasoning_parser.feed(text)
            reasoning, content = piece.reasoning, piece.content
        parsed = ParsedDelta(content)
        if self.tool_parser is not None:
            parsed = self.tool_parser.feed(content)
            if final:
                last = self.tool_parser.finish()
                parsed = ParsedDelta(parsed.content + last.content, parsed.calls + last.calls)
        delta: dict[str, Any] = {}
        if reasoning:
            self.reasoning.append(reasoning)
            delta["reasoning_content"] = reasoning
        if parsed.content:
            self.content.append(parsed.content)
            delta["content"] = parsed.content
        if parsed.calls:
            delta["tool_calls"] = [self._call_delta(call) for call in parsed.calls]
        return delta

    def _call_delta(self, call: ToolCallDelta) -> dict[str, Any]:
        if call.name is not None:
            assert self.tool_parser is not None  # only a tool parser makes calls
            new_call_id = self.new_call_id or self.tool_parser.new_call_id
            self.call_ids.append(new_call_id())
            self.call_names.append(call.name)
            self.call_arguments.append([])
            self.call_arguments[call.index].append(call.arguments)
            return {
                "index": call.index,
                "id": self.call_ids[call.index],
                "type": "function",
                "function": {"name": call.name, "arguments": call.arguments},
            }
        self.call_arguments[call.index].append(call.arguments)
        return {"index": call.index, "function": {"arguments": call.arguments}}

    @property
    def has_tool_calls(self) -> bool:
        return bool(self.call_ids)

    def message(self, role: str = "assistant") -> dict[str, Any]:
        """The whole ``message`` of a non-streaming response."""
        content = "".join(self.content)
        message: dict[str, Any] = {"role": role, "content": content}
        if self.reasoning_parser is not None:
            message["reasoning_content"] = "".join(self.reasoning) or None
        if self.tool_parser is not None:
            message["tool_calls"] = [
                {
                    "id": call_id,
                    "type": "function",
                    "function": {"name": name, "arguments": "".join(arguments)},
                }
                for call_id, name, arguments in zip(
                    self.call_ids, self.call_names, self.call_arguments
                )
            ]
            if self.has_tool_calls and not content:
                message["content"] = None
        return message
