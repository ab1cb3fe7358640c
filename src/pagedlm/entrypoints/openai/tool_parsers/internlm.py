"""InternLM2 / InternLM2.5 calls: ``<|action_start|><|plugin|>{"name": ..., "parameters":
{...}}<|action_end|>`` after the answer's text.

``<|action_start|>``, ``<|plugin|>`` and ``<|action_end|>`` are special tokens: the text must
be detokenized with ``skip_special_tokens=False`` for this parser to see them (the server does
so for the requests it parses).
"""

from __future__ import annotations

import json

from pagedlm.entrypoints.openai.tool_parsers.abstract import ToolCall, call_from_json
from pagedlm.entrypoints.openai.tool_parsers.tagged import TaggedBlockToolParser

ACTION_START = "<|action_start|><|plugin|>"
ACTION_END = "<|action_end|>"


class InternLM2ToolParser(TaggedBlockToolParser):
    blocks = ((ACTION_START, ACTION_END),)
    needs_special_tokens = True

    def _decode(self, start: str, body: str, closed: bool) -> list[ToolCall] | None:
        call = call_from_json(json.loads(body))
        return None if call is None else [call]
