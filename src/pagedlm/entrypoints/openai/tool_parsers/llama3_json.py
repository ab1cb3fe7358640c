"""Llama 3.x JSON calls: the output is ``{"name": ..., "parameters": {...}}`` objects,
optionally after ``<|python_tag|>`` and separated by ``;``.

The first non-blank character decides: an output that starts with ``{`` (or the python
tag) is read call by call with ``json.JSONDecoder.raw_decode``; anything else is plain
content and streams as it comes. From the first piece that is not a call object, the rest
of the output is content.
"""

from __future__ import annotations

import json

from pagedlm.entrypoints.openai.tool_parsers.abstract import (
    BufferedToolParser,
    ParsedDelta,
    ToolCallDelta,
    call_from_json,
)

PYTHON_TAG = "<|python_tag|>"
_DECODER = json.JSONDecoder()


class Llama3JsonToolParser(BufferedToolParser):
    def __init__(self) -> None:
        super().__init__()
        self._content_mode = False
        self._started = False

    def _advance(self, final: bool) -> ParsedDelta:
        calls: list[ToolCallDelta] = []
        if not self._content_mode and not self._started:
            head = self._buffer.lstrip()
            if head.startswith(PYTHON_TAG):
                self._started = True
                self._pos = len(self._buffer) - len(head) + len(PYTHON_TAG)
            elif head.startswith("{"):
                self._started = True
            elif head and not (PYTHON_TAG.startswith(head) and not final):
                self._content_mode = True
            elif not final:
                return ParsedDelta()
        while not self._content_mode and self._pos < len(self._buffer):
            rest = self._buffer[self._pos :]
            stripped = rest.lstrip().lstrip(";").lstrip()
            if not stripped:
                if final:
                    self._pos = len(self._buffer)
                break
            offset = len(rest) - len(stripped)
            try:
                value, end = _DECODER.raw_decode(stripped)
            except ValueError:
                if final or not stripped.startswith("{"):
                    self._content_mode = True
                break
            call = call_from_json(value)
            if call is None:
                self._content_mode = True
                break
            calls.append(self._new_call(call.name, call.arguments))
            self._pos += offset + end
        content = ""
        if self._content_mode:
            content = self._buffer[self._pos :]
            self._pos = len(self._buffer)
        return ParsedDelta(content, tuple(calls))
