"""Mistral calls, after the ``[TOOL_CALLS]`` token, in the forms of each tokenizer version:

- before v11 (Mistral-7B-Instruct-v0.3, Mixtral, Nemo):
  ``[TOOL_CALLS] [{"name": "f", "arguments": {...}}, ...]``, read item by item;
- v11+ (Mistral-Small-3.1+, Magistral, Devstral): one ``[TOOL_CALLS]`` per call,
  ``[TOOL_CALLS]f[ARGS]{...}``, optionally ``[TOOL_CALLS]f[CALL_ID]a1b2c3d4e[ARGS]{...}``
  (the model's call id is not kept: the server names calls itself), or ``f{...}`` when
  ``[ARGS]`` was dropped from the text.

Text before and between calls is content, whitespace next to a call dropped; a
``[TOOL_CALLS]`` not followed by a readable call stays in the content with what follows.
``[TOOL_CALLS]``, ``[ARGS]`` and ``[CALL_ID]`` are special tokens: the text must be
detokenized with ``skip_special_tokens=False`` for this parser to see them (the server does
so for the requests it parses). Calls are named with 9 letters and digits, the only ids
Mistral's chat templates accept when the conversation is sent back.
"""

from __future__ import annotations

import enum
import json
import re
import secrets
import string

from pagedlm.entrypoints.openai.tool_parsers.abstract import (
    BufferedToolParser,
    ParsedDelta,
    ToolCall,
    ToolCallDelta,
    arguments_json,
    held_tag_prefix,
)
from pagedlm.entrypoints.openai.tool_parsers.json_array import ArrayStatus, read_call_items

TOOL_CALLS = "[TOOL_CALLS]"
ARGS = "[ARGS]"
CALL_ID = "[CALL_ID]"
_NAME = re.compile(r"[A-Za-z0-9_.\-]*")
_ID_ALPHABET = string.ascii_letters + string.digits
MISTRAL_CALL_ID_LENGTH = 9
_DECODER = json.JSONDecoder()


class _State(enum.Enum):
    CONTENT = 0
    CALL = 1
    """Just after ``[TOOL_CALLS]``: a call of either form, not decided yet."""
    ARRAY = 2


class _Read(enum.Enum):
    MORE = 0
    DONE = 1
    BROKEN = 2


class MistralToolParser(BufferedToolParser):
    needs_special_tokens = True

    @classmethod
    def new_call_id(cls) -> str:
        return "".join(secrets.choice(_ID_ALPHABET) for _ in range(MISTRAL_CALL_ID_LENGTH))

    def __init__(self) -> None:
        super().__init__()
        self._state = _State.CONTENT
        self._after_call = False
        self._marker_start = 0
        """Where the current ``[TOOL_CALLS]`` (with the blanks before it) begins."""
        self._calls_at_marker = 0

    def _advance(self, final: bool) -> ParsedDelta:
        content: list[str] = []
        calls: list[ToolCallDelta] = []
        while True:
            if self._state is _State.CONTENT:
                if not self._content(final, content):
                    break
            elif self._state is _State.CALL:
                rest = self._buffer[self._pos :]
                call_text = rest.lstrip()
                if call_text.startswith("["):
                    self._pos += len(rest) - len(call_text) + 1
                    self._state = _State.ARRAY
                    continue
                status, call, consumed = _read_named_call(call_text, final)
                if status is _Read.MORE:
                    break
                if status is _Read.BROKEN:
                    self._broken(content)
                    continue
                assert call is not None
                calls.append(self._new_call(call.name, call.arguments))
                self._pos += len(rest) - len(call_text) + consumed
                self._end_call()
            else:
                items = read_call_items(self._buffer[self._pos :], final)
                calls.extend(self._new_call(call.name, call.arguments) for call in items.calls)
                self._pos += items.consumed
                if items.status is ArrayStatus.MORE:
                    break
                if items.status is ArrayStatus.BROKEN:
                    self._broken(content)
                else:
                    self._end_call()
        return ParsedDelta("".join(content), tuple(calls))

    def _content(self, final: bool, content: list[str]) -> bool:
        """Content up to the next ``[TOOL_CALLS]``; False when nothing more can be decided."""
        rest = self._buffer[self._pos :]
        if self._after_call:
            stripped = rest.lstrip()
            self._pos += len(rest) - len(stripped)
            if not stripped:
                return False
            rest = stripped
            self._after_call = False
        start = rest.find(TOOL_CALLS)
        if start == -1:
            if final:
                cut = len(rest)
            else:  # a marker may be arriving; blanks may turn out to precede a call
                cut = len(rest[: len(rest) - held_tag_prefix(rest, TOOL_CALLS)].rstrip())
            content.append(rest[:cut])
            self._pos += cut
            return False
        before = rest[:start].rstrip()
        content.append(before)
        self._marker_start = self._pos + len(before)
        self._calls_at_marker = self._num_calls
        self._pos += start + len(TOOL_CALLS)
        self._state = _State.CALL
        return True

    def _broken(self, content: list[str]) -> None:
        """What follows the marker is not (or no longer) a call: it is content again."""
        if self._num_calls == self._calls_at_marker:
            # Nothing came of this marker: it goes back into the content, blanks and all.
            marker_end = self._buffer.index(TOOL_CALLS, self._marker_start) + len(TOOL_CALLS)
            content.append(self._buffer[self._marker_start : marker_end])
            self._pos = marker_end
        self._state = _State.CONTENT

    def _end_call(self) -> None:
        self._state = _State.CONTENT
        self._after_call = True


def _read_named_call(text: str, final: bool) -> tuple[_Read, ToolCall | None, int]:
    """A v11+ call ``name[CALL_ID]id[ARGS]{...}`` at the start of ``text``:
    (status, the call when DONE, characters it took)."""
    more = (_Read.BROKEN if final else _Read.MORE), None, 0
    broken = _Read.BROKEN, None, 0
    name = _NAME.match(text).group()  # type: ignore[union-attr]  # the pattern matches ""
    pos = len(name)
    has_call_id = text.startswith(CALL_ID, pos)
    if has_call_id:
        pos += len(CALL_ID)
        pos += len(_NAME.match(text, pos).group())  # type: ignore[union-attr]
    rest = text[pos:]
    if rest.startswith(ARGS):
        pos += len(ARGS)
    elif not rest.startswith("{"):
        maybe = ARGS.startswith(rest) or (not has_call_id and CALL_ID.startswith(rest))
        return more if maybe else broken
    if not name:
        return broken
    arguments = text[pos:].lstrip()
    pos = len(text) - len(arguments)
    if not arguments:
        return more
    if not arguments.startswith("{"):
        return broken
    try:
        value, end = _DECODER.raw_decode(arguments)
    except ValueError:
        return more
    except RecursionError:
        return broken
    if not isinstance(value, dict):
        return broken
    return _Read.DONE, ToolCall(name, arguments_json(value)), pos + end
