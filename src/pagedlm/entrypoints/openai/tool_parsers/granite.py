"""IBM Granite 3.x calls: the output is ``<|tool_call|>[{"name": ..., "arguments": {...}}, ...]``
(Granite 3.0's special token; 3.1+ may write ``<tool_call>`` or no marker at all).

The first non-blank text decides: an output that opens with a marker and ``[`` (or with
``[`` alone) is read as calls, item by item; anything else is plain content and streams as
it comes. An array whose first item is not a call is content (marker included); after
calls, text that is not a call (a broken item, words after the array) is content.
"""

from __future__ import annotations

import enum

from pagedlm.entrypoints.openai.tool_parsers.abstract import (
    BufferedToolParser,
    ParsedDelta,
    ToolCallDelta,
)
from pagedlm.entrypoints.openai.tool_parsers.json_array import ArrayStatus, read_call_items

MARKERS = ("<|tool_call|>", "<tool_call>")


class _State(enum.Enum):
    START = 0
    ARRAY = 1
    AFTER_ARRAY = 2
    CONTENT = 3


class GraniteToolParser(BufferedToolParser):
    def __init__(self) -> None:
        super().__init__()
        self._state = _State.START

    def _advance(self, final: bool) -> ParsedDelta:
        calls: list[ToolCallDelta] = []
        if self._state is _State.START:
            self._start(final)
        if self._state is _State.ARRAY:
            items = read_call_items(self._buffer[self._pos :], final)
            calls = [self._new_call(call.name, call.arguments) for call in items.calls]
            self._pos += items.consumed
            if items.status is ArrayStatus.CLOSED:
                self._state = _State.AFTER_ARRAY
            elif items.status is ArrayStatus.BROKEN:
                if not self._num_calls:
                    self._pos = 0  # no call at all: the whole output is content
                self._state = _State.CONTENT
        if self._state is _State.AFTER_ARRAY:
            rest = self._buffer[self._pos :]
            if rest.strip():
                self._pos += len(rest) - len(rest.lstrip())
                self._state = _State.CONTENT
            elif final:
                self._pos = len(self._buffer)
        content = ""
        if self._state is _State.CONTENT:
            content = self._buffer[self._pos :]
            self._pos = len(self._buffer)
        return ParsedDelta(content, tuple(calls))

    def _start(self, final: bool) -> None:
        head = self._buffer.lstrip()
        marker = next((m for m in MARKERS if head.startswith(m)), None)
        if marker is not None:
            head = head[len(marker) :].lstrip()
        elif not final and any(m.startswith(head) for m in MARKERS):
            return  # a marker may be arriving (or nothing but blanks yet)
        if head.startswith("["):
            self._pos = len(self._buffer) - len(head) + 1
            self._state = _State.ARRAY
        elif final or head:
            self._state = _State.CONTENT
