"""Reasoning parsers, by the name ``--reasoning-parser`` takes."""

from __future__ import annotations

from pagedlm.entrypoints.openai.reasoning_parsers.abstract import (
    ReasoningDelta,
    ReasoningParser,
    split_reasoning,
)
from pagedlm.entrypoints.openai.reasoning_parsers.think import (
    DeepSeekR1ReasoningParser,
    Qwen3ReasoningParser,
)

REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    "deepseek_r1": DeepSeekR1ReasoningParser,
    "qwen3": Qwen3ReasoningParser,
}


def get_reasoning_parser(name: str) -> type[ReasoningParser]:
    """The parser class registered as ``name``; unknown names -> ``ValueError``."""
    try:
        return REASONING_PARSERS[name]
    except KeyError:
        raise ValueError(
            f"Unknown reasoning parser {name!r}; choose one of {sorted(REASONING_PARSERS)}."
        ) from None


__all__ = [
    "REASONING_PARSERS",
    "DeepSeekR1ReasoningParser",
    "Qwen3ReasoningParser",
    "ReasoningDelta",
    "ReasoningParser",
    "get_reasoning_parser",
    "split_reasoning",
]
