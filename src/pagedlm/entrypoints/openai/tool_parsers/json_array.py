"""Reading a JSON array of call objects item by item, as the text streams in.

Shared by the formats whose calls are ``[{"name": ..., "arguments": {...}}, ...]`` after a
marker (Mistral before tokenizer v11, Granite). Each item is decided as soon as it is
complete, so the calls that come out do not depend on how the text was split.
"""

from __future__ import annotations

import enum
import json
from typing import NamedTuple

from pagedlm.entrypoints.openai.tool_parsers.abstract import ToolCall, call_from_json

_DECODER = json.JSONDecoder()


class ArrayStatus(enum.Enum):
    MORE = 0
    """The items so far are read; the next one is not complete yet."""
    CLOSED = 1
    """The array ended (``]``, or the text ended after a whole item)."""
    BROKEN = 2
    """The next item is not a call object: ``consumed`` stops before it."""


class ArrayItems(NamedTuple):
    calls: list[ToolCall]
    consumed: int
    status: ArrayStatus


def read_call_items(text: str, final: bool) -> ArrayItems:
    """The calls at the start of ``text``, the rest of an array whose ``[`` was already read.

    ``consumed`` counts the characters of ``text`` that the calls (and, when CLOSED, the
    closing bracket) took; a caller keeps the rest for the next read, or as content.
    """
    calls: list[ToolCall] = []
    consumed = 0
    while True:
        rest = text[consumed:]
        item = rest.lstrip().removeprefix(",").lstrip()  # the comma before an item
        offset = len(rest) - len(item)
        if not item:
            return ArrayItems(calls, consumed, ArrayStatus.CLOSED if final else ArrayStatus.MORE)
        if item.startswith("]"):
            return ArrayItems(calls, consumed + offset + 1, ArrayStatus.CLOSED)
        try:
            value, end = _DECODER.raw_decode(item)
        except ValueError:
            incomplete = not final and item.startswith("{")
            return ArrayItems(
                calls, consumed, ArrayStatus.MORE if incomplete else ArrayStatus.BROKEN
            )
        except RecursionError:
            return ArrayItems(calls, consumed, ArrayStatus.BROKEN)
        call = call_from_json(value)
        if call is None:
            return ArrayItems(calls, consumed, ArrayStatus.BROKEN)
        calls.append(call)
        consumed += offset + end
