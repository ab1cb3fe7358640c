"""ByteDance Seed-OSS reasoning: ``<seed:think>...</seed:think>`` then the answer.

Like ``deepseek_r1``, the output may start inside the thought without writing
``<seed:think>``; budget reflections (``<seed:cot_budget_reflect>``) stay in the reasoning.
"""

from __future__ import annotations

from pagedlm.entrypoints.openai.reasoning_parsers.think import ThinkReasoningParser


class SeedOssReasoningParser(ThinkReasoningParser):
    start_tags = ("<seed:think>",)
    end_tags = ("</seed:think>",)
    starts_in_reasoning = True
