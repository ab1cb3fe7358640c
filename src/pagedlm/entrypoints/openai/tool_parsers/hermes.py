"""Hermes-style calls (Hermes 2/3, Qwen 2.5/3, SmolLM): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.

Text outside the tags is content. A block whose body is not a JSON call object stays in
the content verbatim. Whitespace next to a call is dropped (models put newlines between
calls). A block left open at the end still counts if its body is a whole call (models often
stop at EOS before the closing tag). Some checkpoints make the tags special tokens, so the
text is read with them kept (as vLLM's parser does).
"""

from __future__ import annotations

import json

from pagedlm.entrypoints.openai.tool_parsers.abstract import ToolCall, call_from_json
from pagedlm.entrypoints.openai.tool_parsers.tagged import TaggedBlockToolParser

START = "<tool_call>"
END = "</tool_call>"


class HermesToolParser(TaggedBlockToolParser):
    needs_special_tokens = True
    blocks = ((START, END),)

    def _decode(self, start: str, body: str, closed: bool) -> list[ToolCall] | None:
        call = call_from_json(json.loads(body))
        return None if call is None else [call]
