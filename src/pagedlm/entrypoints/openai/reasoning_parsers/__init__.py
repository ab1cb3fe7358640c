"""Reasoning parsers, by the name ``--reasoning-parser`` takes."""

from __future__ import annotations

from pagedlm.entrypoints.openai.parser_registry import registrar
from pagedlm.entrypoints.openai.reasoning_parsers.abstract import (
    ReasoningDelta,
    ReasoningParser,
    reasoning_parser_factory,
    split_reasoning,
)
from pagedlm.entrypoints.openai.reasoning_parsers.ernie45 import Ernie45ReasoningParser
from pagedlm.entrypoints.openai.reasoning_parsers.glm45 import Glm45ReasoningParser
from pagedlm.entrypoints.openai.reasoning_parsers.granite import GraniteReasoningParser
from pagedlm.entrypoints.openai.reasoning_parsers.mistral import MistralReasoningParser
from pagedlm.entrypoints.openai.reasoning_parsers.openai_harmony import (
    OpenAIGptOssReasoningParser,
)
from pagedlm.entrypoints.openai.reasoning_parsers.seed_oss import SeedOssReasoningParser
from pagedlm.entrypoints.openai.reasoning_parsers.think import (
    DeepSeekR1ReasoningParser,
    Qwen3ReasoningParser,
)

REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    "deepseek_r1": DeepSeekR1ReasoningParser,
    "ernie45": Ernie45ReasoningParser,
    "glm45": Glm45ReasoningParser,
    "granite": GraniteReasoningParser,
    "mistral": MistralReasoningParser,
    "openai_gptoss": OpenAIGptOssReasoningParser,
    "qwen3": Qwen3ReasoningParser,
    "seed_oss": SeedOssReasoningParser,
}


register_reasoning_parser = registrar(REASONING_PARSERS, ReasoningParser, "reasoning")
"""``@register_reasoning_parser("name", ...)``: make a ``ReasoningParser`` subclass
``--reasoning-parser`` choices (a plugin's, ``--reasoning-parser-plugin``); a name another
parser holds is an error."""


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
    "Ernie45ReasoningParser",
    "Glm45ReasoningParser",
    "GraniteReasoningParser",
    "MistralReasoningParser",
    "OpenAIGptOssReasoningParser",
    "Qwen3ReasoningParser",
    "ReasoningDelta",
    "ReasoningParser",
    "SeedOssReasoningParser",
    "get_reasoning_parser",
    "reasoning_parser_factory",
    "register_reasoning_parser",
    "split_reasoning",
]
