"""IBM Granite 3.2+ reasoning: ``Here is my thought process: ... Here is my response: ...``.

Granite marks its thought with plain sentences, not special tokens; ``Here's`` is accepted
for ``Here is`` in both (quantized checkpoints write it). Only an output that opens with
the thought sentence has reasoning; a thought without the response sentence is all
reasoning (cut off), like the ``<think>`` parsers.
"""

from __future__ import annotations

from pagedlm.entrypoints.openai.reasoning_parsers.think import ThinkReasoningParser


class GraniteReasoningParser(ThinkReasoningParser):
    start_tags = ("Here is my thought process:", "Here's my thought process:")
    end_tags = ("Here is my response:", "Here's my response:")
    starts_in_reasoning = False
