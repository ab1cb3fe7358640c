"""Qwen3-Coder's XML calls::

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

Parameter values are raw text (one newline just inside each tag is dropped) and become JSON
values by the parameter's type in the request's tool schema: strings stay strings, integers,
numbers and booleans are converted, objects and arrays are read as JSON (or Python
literals); a value that does not convert stays a string, and ``null`` is null. The server
builds the parser with the request's tools; a function they do not declare (or a parser made
without them) converts by the value's look: text that reads as a JSON number, boolean, null,
object or array becomes that, anything else a string. A bare ``<function=...>...</function>``
outside ``<tool_call>`` counts as a call too. The tags are read with special tokens kept (some
checkpoints make them special, as vLLM's parser assumes).
"""

from __future__ import annotations

import ast
import json
from typing import Any

from pagedlm.entrypoints.openai.tool_parsers.abstract import ToolCall, arguments_json
from pagedlm.entrypoints.openai.tool_parsers.tagged import TaggedBlockToolParser

TOOL_CALL = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
FUNCTION = "<function="
FUNCTION_END = "</function>"
PARAMETER = "<parameter="
PARAMETER_END = "</parameter>"

_STRING_TYPES = ("string", "str", "text", "varchar", "char", "enum")
_INTEGER_PREFIXES = ("int", "uint", "long", "short", "unsigned")


class Qwen3CoderToolParser(TaggedBlockToolParser):
    blocks = ((TOOL_CALL, TOOL_CALL_END), (FUNCTION, FUNCTION_END))
    needs_special_tokens = True

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        super().__init__()
        self._schemas = _parameter_schemas(tools or [])

    def _decode(self, start: str, body: str, closed: bool) -> list[ToolCall] | None:
        if start == FUNCTION:  # a bare function: the block's end tag closed it
            parsed = _read_function(body, 0, may_stay_open=True)
            if not closed or parsed is None or body[parsed[1] :].strip():
                return None
            return [self._call(*parsed[0])]
        calls = []
        pos = 0
        while True:
            pos = len(body) - len(body[pos:].lstrip())
            if pos == len(body):
                return calls
            if not body.startswith(FUNCTION, pos):
                return None
            # In a <tool_call> left open at the end, only functions that closed count.
            parsed = _read_function(body, pos + len(FUNCTION), closed)
            if parsed is None:
                return None
            (name, raw_arguments), pos = parsed
            calls.append(self._call(name, raw_arguments))

    def _call(self, name: str, raw_arguments: dict[str, str]) -> ToolCall:
        schema = self._schemas.get(name)
        arguments = {
            key: _typed_value(value, None if schema is None else schema.get(key, {}))
            for key, value in raw_arguments.items()
        }
        return ToolCall(name, arguments_json(arguments))


def _read_function(
    text: str, pos: int, may_stay_open: bool
) -> tuple[tuple[str, dict[str, str]], int] | None:
    """``name>`` and its parameters from ``text[pos:]`` (just after ``<function=``):
    ((name, raw values), where reading stopped), or None when it is not a function (or it
    has no ``</function>`` and ``may_stay_open`` is False)."""
    close = text.find(">", pos)
    name = text[pos:close].strip() if close != -1 else ""
    if not name or any(c.isspace() or c in "<>" for c in name):
        return None
    pos = close + 1
    values: dict[str, str] = {}
    while True:
        pos = len(text) - len(text[pos:].lstrip())
        if pos == len(text):  # no </function>: the text is all there is of the block
            return ((name, values), pos) if may_stay_open else None
        if text.startswith(FUNCTION_END, pos):
            return (name, values), pos + len(FUNCTION_END)
        if not text.startswith(PARAMETER, pos):
            return None
        pos += len(PARAMETER)
        close = text.find(">", pos)
        key = text[pos:close].strip() if close != -1 else ""
        if not key or "<" in key:
            return None
        pos = close + 1
        end = text.find(PARAMETER_END, pos)
        if end == -1:  # an unclosed value runs to the next parameter or the function's end
            ends = [i for i in (text.find(PARAMETER, pos), text.find(FUNCTION_END, pos)) if i != -1]
            end = next_pos = min(ends, default=len(text))
        else:
            next_pos = end + len(PARAMETER_END)
        value = text[pos:end]
        value = value.removeprefix("\n").removesuffix("\n")
        values[key] = value
        pos = next_pos


def _parameter_schemas(tools: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Function name -> its parameters' ``properties`` (tools without a schema: {})."""
    schemas: dict[str, dict[str, Any]] = {}
    for tool in tools:
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            continue
        parameters = function.get("parameters")
        properties = parameters.get("properties") if isinstance(parameters, dict) else None
        schemas[function["name"]] = properties if isinstance(properties, dict) else {}
    return schemas


def _typed_value(value: str, schema: dict[str, Any] | None) -> Any:
    """``value`` as the JSON value ``schema`` asks for (None: no schema, judge by its look)."""
    if schema is None:
        return _looks_like_json(value)
    if value.strip().lower() == "null":
        return None
    kind = _schema_type(schema)
    if kind is None or kind in _STRING_TYPES:
        return value
    text = value.strip()
    try:
        if kind.startswith(_INTEGER_PREFIXES):
            return int(text)
        if kind.startswith(("num", "float", "double")):
            number = float(text)
            if number != number or number in (float("inf"), float("-inf")):
                return value
            return int(number) if number.is_integer() and "." not in text else number
        if kind in ("boolean", "bool", "binary"):
            lowered = text.lower()
            return lowered == "true" if lowered in ("true", "false") else value
        if kind in ("object", "array", "arr") or kind.startswith(("dict", "list")):
            return _json_or_literal(text, value)
    except (ValueError, OverflowError):
        return value
    return _json_or_literal(text, value)


def _schema_type(schema: dict[str, Any]) -> str | None:
    kind = schema.get("type") if isinstance(schema, dict) else None
    if isinstance(kind, list):  # ["integer", "null"]: the first that is not null
        kind = next((k for k in kind if k != "null"), None)
    return str(kind).strip().lower() if kind is not None else None


def _json_or_literal(text: str, fallback: str) -> Any:
    for read in (_strict_json, ast.literal_eval):
        try:
            result = read(text)
            json.dumps(result, allow_nan=False)  # only JSON-representable values
            return result
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            continue
    return fallback


def _strict_json(text: str) -> Any:
    def no_constant(name: str) -> Any:
        raise ValueError(f"{name} is not JSON")

    return json.loads(text, parse_constant=no_constant)


def _looks_like_json(value: str) -> Any:
    """A JSON number, boolean, null, object or array as itself; other text as a string."""
    try:
        result = _strict_json(value.strip())
    except (ValueError, RecursionError):
        return value
    return value if isinstance(result, str) else result
