"""Request fields that constrain the output: ``response_format``, vLLM's
``structured_outputs`` (and its deprecated ``guided_*`` spellings), and ``tools`` with
``tool_choice``: the one place that maps body fields to ``StructuredOutputsParams``.

Everything is checked here, before the request reaches the engine: a bad field is an
``APIError`` (400) naming it. Each constraint is also checked against the server's grammar
backend (``GrammarCheck``), so a schema, regex or grammar the backend cannot compile is a
400 naming the field the client sent (``response_format.json_schema.schema``,
``guided_regex``, ``tools.0.function.parameters``, ``/v1/messages``' ``tools.0.input_schema``),
not the ``structured_outputs.<kind>`` the engine's own check names.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pagedlm.entrypoints.openai.errors import APIError, from_value_error
from pagedlm.entrypoints.openai.extras import missing_package_error
from pagedlm.entrypoints.openai.tool_parsers import (
    NamedToolCallParser,
    RequiredToolCallsParser,
    ToolParser,
    get_tool_parser,
    parser_factory,
    required_calls_schema,
)
from pagedlm.entrypoints.openai.tool_parsers.forced import parameters_schema
from pagedlm.sampling_params import StructuredOutputsParams
from pagedlm.structured_output.params import (
    DEFAULT_MAX_SPEC_CHARS,
    InvalidStructuredOutputs,
    validate_structured_outputs,
)

_STRUCTURED_FIELDS = frozenset(f.name for f in dataclasses.fields(StructuredOutputsParams))
GUIDED_FIELDS = {
    "guided_json": "json",
    "guided_choice": "choice",
    "guided_regex": "regex",
    "guided_grammar": "grammar",
}
"""vLLM's older names for ``structured_outputs`` keys, still accepted."""


def _params(param: str, **fields: Any) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams(**fields)
    except ValueError as error:
        raise APIError(f"{param}: {error}", param=param) from None


@dataclass(frozen=True)
class GrammarCheck:
    """The server's grammar backend and spec limit (``--structured-outputs-backend``,
    ``--structured-outputs-max-spec-chars``), against which each constraint is checked
    as it is built from the body."""

    backend: str = "xgrammar"
    max_spec_chars: int = DEFAULT_MAX_SPEC_CHARS

    def params(self, field: str, **fields: Any) -> StructuredOutputsParams:
        """``StructuredOutputsParams(**fields)``, checked; a 400 names ``field``."""
        params = _params(field, **fields)
        self.check(params, field)
        return params

    def check(self, params: StructuredOutputsParams, field: str) -> None:
        """400 naming ``field`` (in the message and as ``param``) if the backend cannot
        serve ``params``."""
        try:
            validate_structured_outputs(params, self.backend, self.max_spec_chars)
        except InvalidStructuredOutputs as error:
            raise APIError(error.for_field(field), param=field) from None
        except ValueError as error:  # the backend's package is missing: the engine's 400
            raise from_value_error(error) from None


def structured_outputs_from_request(
    response_format: dict[str, Any] | None,
    structured_outputs: dict[str, Any] | None,
    grammar: GrammarCheck,
    guided: dict[str, Any] | None = None,
) -> StructuredOutputsParams | None:
    """The constraint asked for by ``response_format``, ``structured_outputs`` or the
    deprecated ``guided`` fields (their names -> values; one of the three at most)."""
    from_format = (
        None if response_format is None else _from_response_format(response_format, grammar)
    )
    if guided:
        if structured_outputs is not None:
            raise APIError(
                f"Send structured_outputs or the deprecated {sorted(GUIDED_FIELDS)} fields, "
                "not both.",
                param="structured_outputs",
            )
        structured_outputs = {GUIDED_FIELDS[name]: value for name, value in guided.items()}
    if structured_outputs is None:
        return from_format
    if from_format is not None:
        raise APIError(
            "Send either response_format or structured_outputs, not both.",
            param="structured_outputs",
        )
    unknown = sorted(set(structured_outputs) - _STRUCTURED_FIELDS)
    if unknown:
        raise APIError(
            f"structured_outputs has unknown fields {unknown}; use {sorted(_STRUCTURED_FIELDS)}.",
            param="structured_outputs",
        )
    sent_as = {key: name for name, key in GUIDED_FIELDS.items() if name in (guided or {})}
    params = _params(next(iter(sent_as.values()), "structured_outputs"), **structured_outputs)
    grammar.check(params, sent_as.get(params.kind, f"structured_outputs.{params.kind}"))
    return params


def _from_response_format(
    response_format: dict[str, Any], grammar: GrammarCheck
) -> StructuredOutputsParams | None:
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return grammar.params("response_format", json_object=True)
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise APIError(
                'response_format json_schema needs {"json_schema": {"name": ..., "schema": {...}}}.',
                param="response_format",
            )
        field = "response_format.json_schema.schema"
        _check_schema(schema, field)
        return grammar.params(field, json=schema)
    if kind == "structural_tag":  # vLLM's: the whole object is the tag
        return grammar.params("response_format", structural_tag=json.dumps(response_format))
    problem = "needs a type" if kind is None else f"type {kind!r} is not supported"
    raise APIError(
        f"response_format {problem}; use 'text', 'json_object', 'json_schema' or 'structural_tag'.",
        param="response_format",
    )


def _check_schema(schema: Any, param: str) -> None:
    try:
        import jsonschema
    except ImportError as error:
        raise missing_package_error(error, f"Checking {param}") from None

    if not isinstance(schema, dict):
        raise APIError(f"{param} must be a JSON schema object.", param=param)
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as error:
        raise APIError(
            f"{param} is not a valid JSON schema: {error.message}", param=param
        ) from None


@dataclass(frozen=True)
class ToolPlan:
    """How one chat request handles tools.

    ``mode`` is "none", "auto", "required" or "named"; ``template_tools`` go to the chat
    template; ``structured_outputs`` forces the calls (required/named); ``new_parser``
    makes a parser per choice (None: the output is plain content); ``new_call_id`` names
    the calls as the server's ``--tool-call-parser`` family does, forced calls too (its chat
    template may check the ids when the conversation comes back); ``needs_special_tokens``:
    the text must keep special tokens for the parser to see its markers.
    """

    mode: str
    template_tools: list[dict[str, Any]] | None = None
    structured_outputs: StructuredOutputsParams | None = None
    new_parser: Callable[[], ToolParser] | None = None
    new_call_id: Callable[[], str] = ToolParser.new_call_id
    needs_special_tokens: bool = False


OPENAI_SCHEMA_FIELD = "tools.{index}.function.parameters"
"""Where a chat request's tool ``index`` has its parameter schema (``plan_tools``'
``schema_field``; the Anthropic route names its ``input_schema``)."""


def _functions(tools: list[dict[str, Any]], schema_field: str) -> list[dict[str, Any]]:
    functions = []
    for i, tool in enumerate(tools):
        param = f"tools.{i}"
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or tool.get("type", "function") != "function":
            raise APIError(
                f'{param} must be {{"type": "function", "function": {{"name": ..., '
                '"parameters": {...}}}.',
                param=param,
            )
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise APIError(f"{param}.function.name must be a non-empty string.", param=param)
        if function.get("parameters") is not None:
            _check_schema(function["parameters"], schema_field.format(index=i))
        functions.append(function)
    names = [f["name"] for f in functions]
    if len(set(names)) != len(names):
        raise APIError(f"tools have duplicate function names: {names}.", param="tools")
    return functions


def plan_tools(
    tools: list[dict[str, Any]] | None,
    tool_choice: str | dict[str, Any] | None,
    parallel_tool_calls: bool,
    tool_parser: str | None,
    enable_auto_tool_choice: bool,
    exclude_tools_when_none: bool = False,
    *,
    grammar: GrammarCheck,
    schema_field: str = OPENAI_SCHEMA_FIELD,
) -> ToolPlan:
    """Check ``tools``/``tool_choice`` and decide how the output is constrained and parsed.

    ``tool_choice`` left out means "auto" when the server parses tool calls
    (``--enable-auto-tool-choice``), else "none". Under "auto" the server's parser reads the
    text; it is given ``tools`` where it takes them (to type values by their schema). Under
    "none" the template still sees the tools, as in vLLM, unless ``exclude_tools_when_none``
    (``--exclude-tools-when-tool-choice-none``). A forcing choice (required, named)
    constrains the output with the tools' parameter schemas, each checked by ``grammar``;
    a schema's 400 names ``schema_field`` with the tool's index (the field the client sent).
    """
    if not tools:
        if tool_choice not in (None, "none"):
            raise APIError("tool_choice needs tools.", param="tool_choice")
        return ToolPlan("none")
    functions = _functions(tools, schema_field)
    if tool_choice is None:
        tool_choice = "auto" if enable_auto_tool_choice else "none"
    if tool_choice == "none":
        return ToolPlan("none", None if exclude_tools_when_none else tools)
    server_parser = get_tool_parser(tool_parser) if tool_parser else None
    new_call_id = server_parser.new_call_id if server_parser else ToolParser.new_call_id
    if tool_choice == "auto":
        if not (enable_auto_tool_choice and server_parser):
            raise APIError(
                'tool_choice="auto" needs a server started with --enable-auto-tool-choice '
                "and --tool-call-parser; use 'required' or a named function instead.",
                param="tool_choice",
            )
        return ToolPlan(
            "auto",
            tools,
            new_parser=parser_factory(server_parser, tools),
            new_call_id=new_call_id,
            needs_special_tokens=server_parser.needs_special_tokens,
        )
    if tool_choice == "required":
        try:
            schema = required_calls_schema(functions)
        except ValueError as error:
            raise APIError(str(error), param="tools") from None
        if not parallel_tool_calls:
            schema["maxItems"] = 1
        for i, function in enumerate(functions):  # the tool whose schema fails is named
            _forced_call(function, schema_field.format(index=i), grammar)
        structured = grammar.params("tools", json=schema, disable_any_whitespace=True)
        return ToolPlan("required", tools, structured, RequiredToolCallsParser, new_call_id)
    name = _named_choice(tool_choice)
    index = next((i for i, f in enumerate(functions) if f["name"] == name), None)
    if index is None:
        raise APIError(
            f"tool_choice names {name!r}, which is not among the tools "
            f"{[f['name'] for f in functions]}.",
            param="tool_choice",
        )
    structured = _forced_call(functions[index], schema_field.format(index=index), grammar)
    return ToolPlan("named", tools, structured, lambda: NamedToolCallParser(name), new_call_id)


def _forced_call(
    function: dict[str, Any], schema_field: str, grammar: GrammarCheck
) -> StructuredOutputsParams:
    """The constraint of a call's arguments to ``function``, whose schema the client sent
    as ``schema_field``."""
    field = schema_field if function.get("parameters") else "tools"
    return grammar.params(field, json=parameters_schema(function), disable_any_whitespace=True)


def _named_choice(tool_choice: str | dict[str, Any]) -> str:
    function = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise APIError(
            'tool_choice must be "none", "auto", "required" or {"type": "function", '
            '"function": {"name": ...}}.',
            param="tool_choice",
        )
    return name
