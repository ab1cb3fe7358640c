"""Forced tool choices: a grammar makes the model write the calls, these parsers read them.

- A named function (``tool_choice={"type": "function", "function": {"name": ...}}``): the
  output is the arguments object itself, constrained by the function's parameter schema;
  it streams straight through as that call's argument text.
- ``tool_choice="required"``: the output is a JSON array of ``{"name", "parameters"}``
  objects (at least one), each item constrained to one of the tools; a call is returned
  as soon as its array item is complete.
"""

from __future__ import annotations

import json
from typing import Any

from pagedlm.entrypoints.openai.tool_parsers.abstract import (
    BufferedToolParser,
    ParsedDelta,
    ToolCallDelta,
    ToolParser,
    call_from_json,
)

ANY_OBJECT: dict[str, Any] = {"type": "object"}
_DECODER = json.JSONDecoder()


def parameters_schema(function: dict[str, Any]) -> dict[str, Any]:
    """The function's ``parameters`` schema (any object when it declares none)."""
    parameters = function.get("parameters")
    return parameters if parameters else ANY_OBJECT


DEFINITION_KEYS = ("$defs", "definitions")
"""Where a schema keeps the subschemas its ``$ref``s name ("#/$defs/Name")."""


def required_calls_schema(functions: list[dict[str, Any]]) -> dict[str, Any]:
    """JSON schema of a non-empty array of calls to any of ``functions``.

    Each function's ``$defs`` (and draft-07 ``definitions``) move to the top of the
    schema, where its ``$ref``s ("#/$defs/Name") point once it is nested (vLLM's way);
    ``ValueError`` when two functions define one name differently."""
    definitions: dict[str, dict[str, Any]] = {key: {} for key in DEFINITION_KEYS}
    items = []
    for function in functions:
        parameters = dict(parameters_schema(function))
        for key in DEFINITION_KEYS:
            for name, subschema in (parameters.pop(key, None) or {}).items():
                if definitions[key].setdefault(name, subschema) != subschema:
                    raise ValueError(
                        f"tools define {key}.{name} differently; a required tool call "
                        "needs one schema per name: rename one of them."
                    )
        items.append(
            {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "enum": [function["name"]]},
                    "parameters": parameters,
                },
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
        )
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
    schema.update({key: found for key, found in definitions.items() if found})
    return schema


class NamedToolCallParser(ToolParser):
    """All output is the arguments of one call to ``name``."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self._name = name
        self._started = False

    def feed(self, text: str) -> ParsedDelta:
        if not text:
            return ParsedDelta()
        if not self._started:
            self._started = True
            return ParsedDelta(calls=(self._new_call(self._name, text),))
        return ParsedDelta(calls=(ToolCallDelta(0, None, text),))

    def finish(self) -> ParsedDelta:
        if not self._started:  # an empty output is still the (empty) call the client forced
            return self.feed("{}")
        return ParsedDelta()


class RequiredToolCallsParser(BufferedToolParser):
    """Reads ``[{"name": ..., "parameters": {...}}, ...]`` item by item; what is left
    unread when the output ends (a truncated item) becomes content."""

    def __init__(self) -> None:
        super().__init__()
        self._opened = False
        self._broken = False

    def _advance(self, final: bool) -> ParsedDelta:
        calls: list[ToolCallDelta] = []
        while not self._broken:
            rest = self._buffer[self._pos :]
            stripped = rest.lstrip()
            if not self._opened:
                if not stripped:
                    break
                if not stripped.startswith("["):
                    self._broken = True
                    break
                self._opened = True
                self._pos += len(rest) - len(stripped) + 1
                continue
            stripped = stripped.lstrip(",").lstrip()
            if not stripped or stripped.startswith("]"):
                break
            try:
                value, end = _DECODER.raw_decode(stripped)
            except ValueError:
                self._broken = final or not stripped.startswith("{")
                break
            call = call_from_json(value)
            if call is None:
                self._broken = True
                break
            calls.append(self._new_call(call.name, call.arguments))
            self._pos += len(rest) - len(stripped) + end
        content = ""
        rest = self._buffer[self._pos :]
        if self._broken or (final and rest.strip() not in ("", "]")):
            content = rest
            self._pos = len(self._buffer)
        elif final:
            self._pos = len(self._buffer)
        return ParsedDelta(content, tuple(calls))
