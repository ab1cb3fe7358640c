"""Tool-call parsers, by the name ``--tool-call-parser`` takes."""

from __future__ import annotations

from pagedlm.entrypoints.openai.parser_registry import registrar
from pagedlm.entrypoints.openai.tool_parsers.abstract import (
    ParsedDelta,
    ParsedOutput,
    ToolCall,
    ToolCallAccumulator,
    ToolCallDelta,
    ToolParser,
    parse_all,
    parser_factory,
)
from pagedlm.entrypoints.openai.tool_parsers.deepseek_v3 import (
    DeepSeekV3ToolParser,
    DeepSeekV31ToolParser,
)
from pagedlm.entrypoints.openai.tool_parsers.forced import (
    NamedToolCallParser,
    RequiredToolCallsParser,
    required_calls_schema,
)
from pagedlm.entrypoints.openai.tool_parsers.granite import GraniteToolParser
from pagedlm.entrypoints.openai.tool_parsers.hermes import HermesToolParser
from pagedlm.entrypoints.openai.tool_parsers.internlm import InternLM2ToolParser
from pagedlm.entrypoints.openai.tool_parsers.llama3_json import Llama3JsonToolParser
from pagedlm.entrypoints.openai.tool_parsers.mistral import MistralToolParser
from pagedlm.entrypoints.openai.tool_parsers.openai_harmony import OpenAIToolParser
from pagedlm.entrypoints.openai.tool_parsers.pythonic import PythonicToolParser
from pagedlm.entrypoints.openai.tool_parsers.qwen3_coder import Qwen3CoderToolParser

TOOL_PARSER_ALIASES: dict[str, str] = {
    "llama4_json": "llama3_json",
    "llama4_pythonic": "pythonic",
}
"""vLLM's other names for the same formats: alias -> name."""

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "deepseek_v3": DeepSeekV3ToolParser,
    "deepseek_v31": DeepSeekV31ToolParser,
    "granite": GraniteToolParser,
    "hermes": HermesToolParser,
    "internlm": InternLM2ToolParser,
    "llama3_json": Llama3JsonToolParser,
    "mistral": MistralToolParser,
    "openai": OpenAIToolParser,
    "pythonic": PythonicToolParser,
    "qwen3_coder": Qwen3CoderToolParser,
}
TOOL_PARSERS |= {alias: TOOL_PARSERS[name] for alias, name in TOOL_PARSER_ALIASES.items()}


register_tool_parser = registrar(TOOL_PARSERS, ToolParser, "tool")
"""``@register_tool_parser("name", ...)``: make a ``ToolParser`` subclass ``--tool-call-parser``
choices (a plugin's, ``--tool-parser-plugin``); a name another parser holds is an error."""


def get_tool_parser(name: str) -> type[ToolParser]:
    """The parser class registered as ``name``; unknown names -> ``ValueError``."""
    try:
        return TOOL_PARSERS[name]
    except KeyError:
        raise ValueError(
            f"Unknown tool-call parser {name!r}; choose one of {sorted(TOOL_PARSERS)}."
        ) from None


__all__ = [
    "TOOL_PARSERS",
    "TOOL_PARSER_ALIASES",
    "DeepSeekV3ToolParser",
    "DeepSeekV31ToolParser",
    "GraniteToolParser",
    "HermesToolParser",
    "InternLM2ToolParser",
    "Llama3JsonToolParser",
    "MistralToolParser",
    "NamedToolCallParser",
    "OpenAIToolParser",
    "ParsedDelta",
    "ParsedOutput",
    "PythonicToolParser",
    "Qwen3CoderToolParser",
    "RequiredToolCallsParser",
    "ToolCall",
    "ToolCallAccumulator",
    "ToolCallDelta",
    "ToolParser",
    "get_tool_parser",
    "parse_all",
    "parser_factory",
    "register_tool_parser",
    "required_calls_schema",
]
