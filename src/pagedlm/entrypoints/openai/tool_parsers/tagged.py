"""Calls written as tagged blocks in free text: ``content <start>body<end> content ...``.

The machinery of the tag-pair formats (Hermes's JSON, Qwen3-Coder's XML, DeepSeek's special tokens,
InternLM's actions): text outside the blocks is content; a block whose body decodes to
calls gives those calls, any other block stays in the content verbatim. Whitespace next to
a call is dropped (models put newlines between calls). A block left open at the end still
counts if its body decodes (models often stop at EOS before the closing tag). Text that may
be the start of a tag is held back, so any split of the same text gives the same result.
"""

from __future__ import annotations

from abc import abstractmethod

from pagedlm.entrypoints.openai.tool_parsers.abstract import (
    BufferedToolParser,
    ParsedDelta,
    ToolCall,
    ToolCallDelta,
    held_tag_prefix,
)


class TaggedBlockToolParser(BufferedToolParser):
    blocks: tuple[tuple[str, str], ...]
    """(start tag, end tag) of each kind of block; the earliest start in the text wins."""

    def __init__(self) -> None:
        super().__init__()
        self._after_call = False

    @abstractmethod
    def _decode(self, start: str, body: str, closed: bool) -> list[ToolCall] | None:
        """The calls of a block that opened with ``start`` (None or none: not a call block);
        ``closed`` is False for a block left open at the end of the text."""

    def _next_start(self, text: str) -> tuple[int, str, str]:
        """(index, start tag, end tag) of the first block start in ``text``; index -1: none."""
        found = [(i, start, end) for start, end in self.blocks if (i := text.find(start)) != -1]
        return min(found, default=(-1, "", ""))

    def _certain_length(self, text: str) -> int:
        """How much of ``text`` (with no block start in it) is content for sure: a tag may
        be arriving at its end, and trailing whitespace may turn out to precede a call."""
        held = max(held_tag_prefix(text, start) for start, _ in self.blocks)
        return len(text[: len(text) - held].rstrip())

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
            start, start_tag, end_tag = self._next_start(rest)
            if start == -1:
                cut = len(rest) if final else self._certain_length(rest)
                content.append(rest[:cut])
                self._pos += cut
                break
            before = rest[:start].rstrip()
            content.append(before)
            self._pos += len(before)
            gap = rest[len(before) : start]
            body_start = start + len(start_tag)
            end = rest.find(end_tag, body_start)
            if end == -1 and not final:
                break
            body_end = len(rest) if end == -1 else end
            block_end = len(rest) if end == -1 else end + len(end_tag)
            decoded = self._decode_safely(start_tag, rest[body_start:body_end], end != -1)
            if not decoded:
                content.append(gap + rest[start:block_end])
            else:
                calls.extend(self._new_call(call.name, call.arguments) for call in decoded)
                self._after_call = True
            self._pos += len(gap) + block_end - start
        return ParsedDelta("".join(content), tuple(calls))

    def _decode_safely(self, start: str, body: str, closed: bool) -> list[ToolCall] | None:
        try:
            return self._decode(start, body, closed)
        except (ValueError, TypeError, RecursionError):  # model text is never an error
            return None
