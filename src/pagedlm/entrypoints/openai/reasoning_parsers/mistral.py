"""Mistral (Magistral) reasoning: ``[THINK]...[/THINK]`` then the answer.

Only an output that opens with ``[THINK]`` has reasoning. ``[THINK]`` and ``[/THINK]`` are
special tokens of the Mistral tokenizers: the text must be detokenized with
``skip_special_tokens=False`` for this parser to see them (the server does so for the requests
it parses).
"""

from __future__ import annotations

from pagedlm.entrypoints.openai.reasoning_parsers.think import ThinkReasoningParser


class MistralReasoningParser(ThinkReasoningParser):
    start_tags = ("[THINK]",)
    end_tags = ("[/THINK]",)
    starts_in_reasoning = False
    needs_special_tokens = True
