"""Tool-call parsers, by the name ``--tool-call-parser`` takes."""

from __future__ import annotations

from pagedlm.entrypoints.openai.tool_parsers.abstract import (
    ParsedDelta,
    ParsedOutput,
    ToolCall,
    ToolCallAccumulator,
    ToolCallDelta,
    ToolParser,
    parse_all,
)
from pagedlm.entrypoints.openai.tool_parsers.forced import (
    NamedToolCallParser,
    RequiredToolCallsParser,
    required_calls_schema,
)
from pagedlm.entrypoints.openai.tool_parsers.hermes import HermesToolParser
from pagedlm.entrypoints.openai.tool_parsers.llama3_json import Llama3JsonToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
}


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
    "HermesToolParser",
    "Llama3JsonToolParser",
    "NamedToolCallParser",
    "ParsedDelta",
    "ParsedOutput",
    "RequiredToolCallsParser",
    "ToolCall",
    "ToolCallAccumulator",
    "ToolCallDelta",
    "ToolParser",
    "get_tool_parser",
    "parse_all",
    "required_calls_schema",
]
