"""Python-list calls (Llama 3.2, Llama 4, ToolACE): ``[get_weather(city="Paris"), f(x=1)]``,
optionally between Llama 4's ``<|python_start|>`` and ``<|python_end|>``.

The first non-blank text decides: an output that opens with ``[`` is read as calls, the
others stream as content. Each element is read with ``ast`` when it is complete (a scan of
brackets and string literals finds its end): a call of a plain name with keyword arguments
whose values are literals (numbers, strings, booleans, None, lists, tuples, dicts) becomes
a call, its arguments converted to JSON; nothing is evaluated. A list whose first element is
not such a call is content, all of it; after calls, what does not read as one (an element,
words after the list) is content.
"""

from __future__ import annotations

import ast
import enum

from pagedlm.entrypoints.openai.tool_parsers.abstract import (
    BufferedToolParser,
    ParsedDelta,
    ToolCall,
    ToolCallDelta,
    arguments_json,
)

PYTHON_START = "<|python_start|>"
PYTHON_END = "<|python_end|>"
_CLOSING = {")": "(", "]": "[", "}": "{"}


class _State(enum.Enum):
    START = 0
    LIST = 1
    AFTER_LIST = 2
    CONTENT = 3


class PythonicToolParser(BufferedToolParser):
    def __init__(self) -> None:
        super().__init__()
        self._state = _State.START
        self._scan = 0
        """How far the element scan has read ``_buffer`` (past ``_pos``)."""
        self._brackets: list[str] = []
        self._quote: str | None = None
        """The delimiter of the string literal the scan is in (``'``, ``\"\"\"``, ...)."""

    def _advance(self, final: bool) -> ParsedDelta:
        calls: list[ToolCallDelta] = []
        if self._state is _State.START:
            self._start(final)
        if self._state is _State.LIST:
            self._scan_list(final, calls)
        if self._state is _State.AFTER_LIST:
            self._after_list(final)
        content = ""
        if self._state is _State.CONTENT:
            content = self._buffer[self._pos :]
            self._pos = len(self._buffer)
        return ParsedDelta(content, tuple(calls))

    def _start(self, final: bool) -> None:
        head = self._buffer.lstrip()
        if head.startswith(PYTHON_START):
            head = head[len(PYTHON_START) :].lstrip()
        elif head and not final and PYTHON_START.startswith(head):
            return
        if head.startswith("["):
            self._pos = self._scan = len(self._buffer) - len(head) + 1
            self._state = _State.LIST
        elif head or final:
            self._state = _State.CONTENT

    def _scan_list(self, final: bool, calls: list[ToolCallDelta]) -> None:
        """Read elements up to the closing ``]``; ``_pos`` is where the current one starts."""
        buffer = self._buffer
        while self._scan < len(buffer):
            char = buffer[self._scan]
            if self._quote is not None:
                if char == "\\":
                    self._scan += 2
                elif buffer.startswith(self._quote, self._scan):
                    self._scan += len(self._quote)
                    self._quote = None
                elif len(self._quote) == 3 and self._quote.startswith(buffer[self._scan :]):
                    if not final:
                        return  # the end of a triple-quoted string may be arriving
                    self._scan += 1
                else:
                    self._scan += 1
                continue
            if char in "'\"":
                triple = char * 3
                if (
                    not final
                    and len(buffer) - self._scan < 3
                    and triple.startswith(buffer[self._scan :])
                ):
                    return  # one quote or three?
                self._quote = triple if buffer.startswith(triple, self._scan) else char
                self._scan += len(self._quote)
                continue
            if char in "([{":
                self._brackets.append(char)
            elif char in ")]}" and self._brackets:
                if self._brackets.pop() != _CLOSING[char]:
                    self._broken()
                    return
            elif char in ")]}" or (char == "," and not self._brackets):
                self._element_end(char, calls)
                if self._state is not _State.LIST:
                    return
            self._scan += 1
        if final:
            self._close_open_list(calls)

    def _element_end(self, char: str, calls: list[ToolCallDelta]) -> None:
        """The current element ends at ``char`` (at ``_scan``): a call, the list's end, or
        the end of the calls."""
        source = self._buffer[self._pos : self._scan].strip()
        if char in ")}" or (not source and (char == "," or not self._num_calls)):
            self._broken()
            return
        if source:
            call = _call_from_source(source)
            if call is None:
                self._broken()
                return
            calls.append(self._new_call(call.name, call.arguments))
        self._pos = self._scan + 1
        if char == "]":
            self._state = _State.AFTER_LIST

    def _close_open_list(self, calls: list[ToolCallDelta]) -> None:
        """The text ended inside the list: a whole last element still counts (models stop
        at EOS before the ``]``)."""
        source = self._buffer[self._pos :].strip()
        call = None
        if source and self._quote is None and not self._brackets:
            call = _call_from_source(source)
        if call is None:
            self._broken()
            return
        calls.append(self._new_call(call.name, call.arguments))
        self._pos = len(self._buffer)
        self._state = _State.AFTER_LIST

    def _broken(self) -> None:
        if not self._num_calls:
            self._pos = 0  # no call at all: the whole output is content
        self._state = _State.CONTENT

    def _after_list(self, final: bool) -> None:
        rest = self._buffer[self._pos :]
        stripped = rest.lstrip()
        if stripped.startswith(PYTHON_END):
            self._pos += len(rest) - len(stripped) + len(PYTHON_END)
            rest = stripped = self._buffer[self._pos :].lstrip()
        if not stripped:
            if final:
                self._pos = len(self._buffer)
        elif final or not PYTHON_END.startswith(stripped):
            self._pos = len(self._buffer) - len(stripped)
            self._state = _State.CONTENT


def _call_from_source(source: str) -> ToolCall | None:
    """``name(key=literal, ...)`` as a call with JSON arguments, else None."""
    try:
        node = ast.parse(source, mode="eval").body
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
            return None
        arguments = {}
        for keyword in node.keywords:
            if keyword.arg is None:  # **kwargs
                return None
            arguments[keyword.arg] = ast.literal_eval(keyword.value)
        return ToolCall(node.func.id, arguments_json(arguments, allow_nan=False))
    except (SyntaxError, ValueError, TypeError, MemoryError, RecursionError):
        return None
