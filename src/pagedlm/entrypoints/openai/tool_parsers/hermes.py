"""Hermes-style calls (Hermes 2/3, Qwen 2.5/3, SmolLM): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.

Text outside the tags is content. A block whose body is not a JSON call object stays in
the content verbatim. Whitespace next to a call is dropped (models put newlines between
calls). A block left open at the end still counts if its body is a whole call (models often
stop at EOS before the closing tag). Some checkpoints make the tags special tokens, so the
text is read with them kept (as vLLM's parser does).
"""

from __future__ import annotations

import json

from pagedlm.entrypoints.openai.tool_parsers.abstract import (
    BufferedToolParser,
    ParsedDelta,
    ToolCall,
    ToolCallDelta,
    call_from_json,
    held_tag_prefix,
)

START = "<tool_call>"
END = "</tool_call>"


class HermesToolParser(BufferedToolParser):
    needs_special_tokens = True

    def __init__(self) -> None:
        super().__init__()
        self._after_call = False

    def _advance(self, final: bool) -> ParsedDelta:
        content: list[str] = []
        calls: list[ToolCallDelta] = []
        while self._pos < len(self._buffer):
            rest = self._buffer[self._pos :]
            if self._after_call:
                stripped = rest.lstrip()
                self._pos += len(rest) - len(stripped)
                if not stripped:
                    break
                rest = stripped
                self._after_call = False
            start = rest.find(START)
            if start == -1:
                if final:
                    cut = len(rest)
                else:
                    # A tag may be arriving; whitespace may turn out to precede a call.
                    cut = len(rest[: len(rest) - held_tag_prefix(rest, START)].rstrip())
                content.append(rest[:cut])
                self._pos += cut
                break
            before = rest[:start].rstrip()
            content.append(before)
            self._pos += len(before)
            gap = rest[len(before) : start]
            end = rest.find(END, start)
            if end == -1 and not final:
                break
            body_end = len(rest) if end == -1 else end
            call = _decode_call(rest[start + len(START) : body_end])
            block_end = len(rest) if end == -1 else end + len(END)
            if call is None:
                content.append(gap + rest[start:block_end])
            else:
                calls.append(self._new_call(call.name, call.arguments))
                self._after_call = True
            self._pos += len(gap) + block_end - start
        return ParsedDelta("".join(content), tuple(calls))


def _decode_call(body: str) -> ToolCall | None:
    try:
        return call_from_json(json.loads(body))
    except ValueError:
        return None
