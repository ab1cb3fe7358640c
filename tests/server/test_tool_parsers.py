"""Tool parsers on recorded model-like outputs, malformed ones included, split everywhere."""

from __future__ import annotations

import json

import pytest
from stream_splits import assert_every_split_gives

from pagedlm.entrypoints.openai.tool_parsers import (
    HermesToolParser,
    Llama3JsonToolParser,
    NamedToolCallParser,
    ParsedOutput,
    RequiredToolCallsParser,
    ToolCall,
    ToolCallAccumulator,
    get_tool_parser,
    parse_all,
    required_calls_schema,
)

WEATHER = ToolCall("get_weather", json.dumps({"city": "Paris", "unit": "celsius"}))
TIME = ToolCall("get_time", json.dumps({"tz": "Europe/Paris"}))

HERMES_CASES = [
    # (model text, expected content, expected calls)
    (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>',
        "",
        [WEATHER],
    ),
    (
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
        '"unit": "celsius"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": '
        '{"tz": "Europe/Paris"}}\n</tool_call>',
        "Let me check.",
        [WEATHER, TIME],
    ),
    # closing tag missing: the model stopped at EOS
    ('<tool_call>{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}', "", [TIME]),
    # arguments as a JSON string, key "parameters"
    ('<tool_call>{"name": "get_time", "parameters": "{\\"tz\\": \\"Europe/Paris\\"}"}</tool_call>', "", [TIME]),
    ("The answer is 4 < 5 and <b>bold</b>.", "The answer is 4 < 5 and <b>bold</b>.", []),
    ("Ends with a partial tag <tool_", "Ends with a partial tag <tool_", []),
    # malformed: broken JSON, missing name, unclosed and truncated
    ('<tool_call>{"name": "get_time", "arguments": {"tz": }</tool_call>', '<tool_call>{"name": "get_time", "arguments": {"tz": }</tool_call>', []),
    ('Hi <tool_call>{"arguments": {}}</tool_call> there', 'Hi <tool_call>{"arguments": {}}</tool_call> there', []),
    ('<tool_call>{"name": "get_time", "argu', '<tool_call>{"name": "get_time", "argu', []),
    (
        'x <tool_call>{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}</tool_call>'
        " <tool_call>oops</tool_call> y",
        "x<tool_call>oops</tool_call> y",  # whitespace next to a call is dropped
        [TIME],
    ),
    ("", "", []),
    ("  \n ", "  \n ", []),
    ('Unicode ✓ <tool_call>{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}</tool_call>', "Unicode ✓", [TIME]),
]  # fmt: skip

LLAMA3_CASES = [
    ('{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}', "", [WEATHER]),
    (
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}; '
        '{"name": "get_time", "parameters": {"tz": "Europe/Paris"}}',
        "",
        [WEATHER, TIME],
    ),
    ("The weather in Paris is mild.", "The weather in Paris is mild.", []),
    ("<|python_ta", "<|python_ta", []),
    ('{"name": "get_time", "parameters": {"tz": "Eu', '{"name": "get_time", "parameters": {"tz": "Eu', []),
    ('{"city": "Paris"}', '{"city": "Paris"}', []),
    ('{"name": "get_time", "parameters": {"tz": "Europe/Paris"}} and then text', " and then text", [TIME]),
    ("{not json at all", "{not json at all", []),
    ("", "", []),
]  # fmt: skip


def _accumulated(deltas: list) -> ParsedOutput:
    accumulator = ToolCallAccumulator()
    for delta in deltas:
        accumulator.add(delta)
    return accumulator.result()


def _check_every_split(parser_factory, text: str, content: str, calls: list[ToolCall]) -> None:
    expected = ParsedOutput(content, tuple(calls))
    assert parse_all(parser_factory(), text) == expected
    assert_every_split_gives(parser_factory, text, expected, _accumulated)


@pytest.mark.parametrize("text, content, calls", HERMES_CASES)
def test_hermes(text, content, calls):
    _check_every_split(HermesToolParser, text, content, calls)


@pytest.mark.parametrize("text, content, calls", LLAMA3_CASES)
def test_llama3_json(text, content, calls):
    _check_every_split(Llama3JsonToolParser, text, content, calls)


def test_hermes_streams_content_before_a_call_is_complete():
    parser = HermesToolParser()
    assert parser.feed("Checking the weather ").content == "Checking the weather"
    assert parser.feed("<tool_call>{").content == ""
    delta = parser.feed('"name": "get_time", "arguments": {"tz": "Europe/Paris"}}</tool_call>')
    assert [(c.index, c.name) for c in delta.calls] == [(0, "get_time")]
    assert parser.finish().calls == ()


def test_llama3_plain_text_streams_at_once():
    parser = Llama3JsonToolParser()
    assert parser.feed("Hello").content == "Hello"
    assert parser.feed(" world").content == " world"


def test_named_parser_streams_argument_text():
    parser = NamedToolCallParser("get_time")
    first = parser.feed('{"tz": ')
    assert [(c.index, c.name, c.arguments) for c in first.calls] == [(0, "get_time", '{"tz": ')]
    second = parser.feed('"UTC"}')
    assert [(c.index, c.name, c.arguments) for c in second.calls] == [(0, None, '"UTC"}')]
    assert parse_all(NamedToolCallParser("f"), "") == ParsedOutput("", (ToolCall("f", "{}"),))


REQUIRED_TEXT = (
    '[{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}, '
    '{"name": "get_time", "parameters": {"tz": "Europe/Paris"}}]'
)


def test_required_parser():
    _check_every_split(RequiredToolCallsParser, REQUIRED_TEXT, "", [WEATHER, TIME])
    truncated = REQUIRED_TEXT[:-20]
    rest = truncated[truncated.index(', {"name": "get_time"') :]
    _check_every_split(RequiredToolCallsParser, truncated, rest, [WEATHER])
    _check_every_split(RequiredToolCallsParser, "no calls", "no calls", [])


def test_required_schema_accepts_calls_to_the_tools_only():
    import jsonschema

    functions = [
        {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}},
        {"name": "get_time"},
    ]  # fmt: skip
    schema = required_calls_schema(functions)
    jsonschema.validate(json.loads(REQUIRED_TEXT), schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "delete_all", "parameters": {}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([], schema)


def test_required_schema_keeps_the_tools_refs_resolvable():
    import jsonschema

    city = {"type": "string", "enum": ["Paris", "Oslo"]}
    functions = [
        {"name": "weather", "parameters": {"properties": {"city": {"$ref": "#/$defs/City"}}, "$defs": {"City": city}}},
        {"name": "trip", "parameters": {"properties": {"to": {"$ref": "#/$defs/City"}}, "$defs": {"City": city}}},
        {"name": "old", "parameters": {"properties": {"n": {"$ref": "#/definitions/N"}}, "definitions": {"N": {"type": "integer"}}}},
    ]  # fmt: skip
    schema = required_calls_schema(functions)
    assert schema["$defs"] == {"City": city} and schema["definitions"] == {"N": {"type": "integer"}}
    assert "$defs" in functions[0]["parameters"]  # the request's tools are left as they came
    jsonschema.validate([{"name": "weather", "parameters": {"city": "Oslo"}}], schema)
    jsonschema.validate([{"name": "old", "parameters": {"n": 3}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "trip", "parameters": {"to": "Rome"}}], schema)
    functions[1]["parameters"]["$defs"] = {"City": {"type": "string"}}
    with pytest.raises(ValueError, match=r"define \$defs.City differently"):
        required_calls_schema(functions)


def test_unknown_parser_name_lists_the_known_ones():
    with pytest.raises(ValueError, match="hermes"):
        get_tool_parser("nope")


def test_pathological_input_is_fast():
    text = "<tool_call>" + "{" * 20000 + "<" * 20000
    result = parse_all(HermesToolParser(), text)
    assert result.content == text and result.calls == ()
    assert parse_all(Llama3JsonToolParser(), "{" * 20000).calls == ()
