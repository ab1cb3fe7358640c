"""DeepSeek-V3 / R1 calls, between DeepSeek's own special tokens (fullwidth bars, ``▁``)::

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
    ```json
    {"city": "Paris"}
    ```<｜tool▁call▁end｜><｜tool▁call▁begin｜>...<｜tool▁call▁end｜><｜tool▁calls▁end｜>

``deepseek_v31`` (DeepSeek-V3.1) drops the type and the code fence:
``<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜>``.

The whole ``<｜tool▁calls▁begin｜>...<｜tool▁calls▁end｜>`` section is one block: its calls come
out when it closes (or at the end, if the model stopped before closing it); a section with
anything in it that is not a call stays in the content verbatim.
"""

from __future__ import annotations

import json

from pagedlm.entrypoints.openai.tool_parsers.abstract import ToolCall, arguments_json
from pagedlm.entrypoints.openai.tool_parsers.tagged import TaggedBlockToolParser

CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
CALLS_END = "<｜tool▁calls▁end｜>"
CALL_BEGIN = "<｜tool▁call▁begin｜>"
CALL_END = "<｜tool▁call▁end｜>"
SEP = "<｜tool▁sep｜>"


class DeepSeekV3ToolParser(TaggedBlockToolParser):
    blocks = ((CALLS_BEGIN, CALLS_END),)

    def _decode(self, start: str, body: str, closed: bool) -> list[ToolCall] | None:
        calls = []
        pos = 0
        while True:
            pos = len(body) - len(body[pos:].lstrip())
            if pos == len(body):
                return calls
            if not body.startswith(CALL_BEGIN, pos):
                return None
            pos += len(CALL_BEGIN)
            end = body.find(CALL_END, pos)
            next_pos = len(body) if end == -1 else end + len(CALL_END)
            call = self._decode_call(body[pos : len(body) if end == -1 else end])
            if call is None:
                return None
            calls.append(call)
            pos = next_pos

    def _decode_call(self, text: str) -> ToolCall | None:
        """``function<｜tool▁sep｜>name\\n```json\\n{...}\\n```"""
        kind, sep, rest = text.partition(SEP)
        name, _, arguments = rest.partition("\n")
        if not sep or not kind.strip():
            return None
        arguments = arguments.strip()
        if arguments.startswith("```"):
            arguments = arguments.partition("\n")[2].strip()
            if not arguments.endswith("```"):
                return None
            arguments = arguments.removesuffix("```")
        return _call(name, arguments)


class DeepSeekV31ToolParser(DeepSeekV3ToolParser):
    def _decode_call(self, text: str) -> ToolCall | None:
        """``name<｜tool▁sep｜>{...}``"""
        name, sep, arguments = text.partition(SEP)
        return _call(name, arguments) if sep else None


def _call(name: str, arguments: str) -> ToolCall | None:
    name = name.strip()
    if not name or any(c.isspace() for c in name):
        return None
    value = json.loads(arguments)
    if not isinstance(value, dict):
        return None
    return ToolCall(name, arguments_json(value))
