"""The tool-parser interface: model text in, content and tool-call deltas out.

A parser is fed the model's text delta by delta (``feed``) and told when the text ends
(``finish``). Each call returns what became certain: content to show and tool-call pieces.
Invariants every parser keeps:

- It never raises on model output; text it cannot read as a call comes back as content.
- Feeding the same text split at any positions yields the same concatenated content and the
  same calls (a parser holds text back until it knows what it is).
- Non-streaming parsing is ``feed(text)`` then ``finish()``: one implementation for both.
"""

from __future__ import annotations

import functools
import inspect
import json
import re
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar


@dataclass(frozen=True)
class ToolCallDelta:
    """A piece of the ``index``-th call; ``name`` is set on (only) its first piece."""

    index: int
    name: str | None
    arguments: str


@dataclass(frozen=True)
class ParsedDelta:
    """What one ``feed``/``finish`` made certain: content text and call pieces."""

    content: str = ""
    calls: tuple[ToolCallDelta, ...] = ()


@dataclass(frozen=True)
class ToolCall:
    """One complete call: the function name and its arguments as JSON text."""

    name: str
    arguments: str


@dataclass(frozen=True)
class ParsedOutput:
    """A whole output: content (possibly empty) and calls in order."""

    content: str
    calls: tuple[ToolCall, ...]


class ToolParser(ABC):
    """Stateful, one instance per output (per choice).

    A parser whose constructor takes ``tools`` (the request's OpenAI function tools) is
    given them by the server; others are built with no arguments.
    """

    needs_special_tokens: ClassVar[bool] = False
    """Its markers are special tokens of the model's tokenizer: a request it parses is
    detokenized with ``skip_special_tokens=False``, or it would never see them."""

    def __init__(self) -> None:
        self._num_calls = 0

    @classmethod
    def new_call_id(cls) -> str:
        """A fresh id for a call this family's model made (OpenAI's ``call_`` form unless the
        family's chat template checks another when the conversation comes back)."""
        return f"call_{uuid.uuid4().hex[:24]}"

    @abstractmethod
    def feed(self, text: str) -> ParsedDelta:
        """Take the next piece of model text; return what became certain."""

    @abstractmethod
    def finish(self) -> ParsedDelta:
        """The text ended: decide everything held back (unfinished calls become content)."""

    def _new_call(self, name: str, arguments: str) -> ToolCallDelta:
        delta = ToolCallDelta(self._num_calls, name, arguments)
        self._num_calls += 1
        return delta


class BufferedToolParser(ToolParser):
    """A parser that keeps all text in ``_buffer`` and decides it left to right.

    Everything before ``_buffer[_pos]`` has been decided and returned; ``_advance`` decides
    what it can of the rest (everything, when ``final``).
    """

    def __init__(self) -> None:
        super().__init__()
        self._buffer = ""
        self._pos = 0

    def feed(self, text: str) -> ParsedDelta:
        self._buffer += text
        return self._advance(final=False)

    def finish(self) -> ParsedDelta:
        return self._advance(final=True)

    @abstractmethod
    def _advance(self, final: bool) -> ParsedDelta: ...


@dataclass
class ToolCallAccumulator:
    """Joins deltas into content and whole calls (the non-streaming response)."""

    content: list[str] = field(default_factory=list)
    names: list[str] = field(default_factory=list)
    arguments: list[list[str]] = field(default_factory=list)

    def add(self, delta: ParsedDelta) -> None:
        self.content.append(delta.content)
        for call in delta.calls:
            if call.name is not None:
                self.names.append(call.name)
                self.arguments.append([])
            self.arguments[call.index].append(call.arguments)

    def result(self) -> ParsedOutput:
        calls = tuple(ToolCall(n, "".join(a)) for n, a in zip(self.names, self.arguments))
        return ParsedOutput("".join(self.content), calls)


def parser_factory(
    parser_class: type[ToolParser], tools: list[dict[str, Any]] | None
) -> Callable[[], ToolParser]:
    """Makes ``parser_class`` parsers (one per choice), given the request's ``tools`` where
    the constructor takes them."""
    if "tools" in inspect.signature(parser_class).parameters:
        return functools.partial(parser_class, tools=tools)
    return parser_class


def parse_all(parser: ToolParser, text: str) -> ParsedOutput:
    """Parse a whole output at once."""
    accumulator = ToolCallAccumulator()
    accumulator.add(parser.feed(text))
    accumulator.add(parser.finish())
    return accumulator.result()


def call_from_json(value: Any) -> ToolCall | None:
    """A call from a decoded ``{"name": ..., "arguments"|"parameters": {...}}``, else None.

    Arguments given as a JSON string holding an object are accepted too (some models do
    that); the result's arguments are always compact-ish JSON of an object.
    """
    if not isinstance(value, dict):
        return None
    name = value.get("name")
    if not isinstance(name, str) or not name or _SURROGATE.search(name):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(name, arguments_json(arguments))


_SURROGATE = re.compile(r"[\ud800-\udfff]")


def arguments_json(value: Any, allow_nan: bool = True) -> str:
    """``value`` as call arguments: JSON text with non-ASCII characters as themselves.

    A model's JSON (or Python) may escape half of a surrogate pair, which decodes to a lone
    surrogate that no UTF-8 response can carry (the response would fail): those stay escaped
    (``\\ud83d``); a pair written as two escapes is the character it spells.
    """
    text = json.dumps(value, ensure_ascii=False, allow_nan=allow_nan)
    if _SURROGATE.search(text) is None:
        return text
    text = text.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "surrogatepass")
    return _SURROGATE.sub(lambda match: f"\\u{ord(match.group()):04x}", text)


def held_tag_prefix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for length in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:length]):
            return length
    return 0
