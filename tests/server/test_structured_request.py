"""Request fields -> constraints and parsers, without a server: response_format,
structured_outputs, tools/tool_choice, and the chat output chain (reasoning then tools)."""

from __future__ import annotations

import json

import pytest

from pagedlm.entrypoints.openai.chat_output import ChatOutputParser
from pagedlm.entrypoints.openai.errors import APIError
from pagedlm.entrypoints.openai.reasoning_parsers import DeepSeekR1ReasoningParser
from pagedlm.entrypoints.openai.structured_request import (
    GrammarCheck,
    plan_tools,
    structured_outputs_from_request,
)
from pagedlm.entrypoints.openai.tool_parsers import HermesToolParser, RequiredToolCallsParser

XGRAMMAR = GrammarCheck()
TOOLS = [
    {"type": "function", "function": {"name": "a", "parameters": {"type": "object"}}},
    {"type": "function", "function": {"name": "b"}},
]


def test_response_format_kinds():
    assert structured_outputs_from_request({"type": "text"}, None, XGRAMMAR) is None
    json_object = structured_outputs_from_request({"type": "json_object"}, None, XGRAMMAR)
    assert json_object.json_object is True
    schema = {"type": "object", "properties": {"x": {"type": "integer"}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}
    assert structured_outputs_from_request(fmt, None, XGRAMMAR).json == schema
    regex = structured_outputs_from_request(None, {"regex": "[a-z]+"}, XGRAMMAR)
    assert regex.kind == "regex"
    with pytest.raises(APIError, match="not both"):
        structured_outputs_from_request({"type": "json_object"}, {"regex": "a"}, XGRAMMAR)
    with pytest.raises(APIError, match="json_schema"):
        structured_outputs_from_request({"type": "json_schema"}, None, XGRAMMAR)
    # vLLM's type is required: {} is a 400, not a request without response_format.
    with pytest.raises(APIError, match="response_format needs a type; use 'text'"):
        structured_outputs_from_request({}, None, XGRAMMAR)


def test_a_structural_tag_response_format_is_the_tag_itself():
    """vLLM's: the whole response_format object, as JSON, is the structural tag."""
    tag = {
        "type": "structural_tag",
        "structures": [{"begin": "<f>", "schema": {"type": "object"}, "end": "</f>"}],
        "triggers": ["<f"],
    }
    params = structured_outputs_from_request(tag, None, XGRAMMAR)
    assert params.kind == "structural_tag" and json.loads(params.structural_tag) == tag
    from_field = structured_outputs_from_request(
        None, {"structural_tag": json.dumps(tag)}, XGRAMMAR
    )
    assert from_field.structural_tag == params.structural_tag


def test_tool_plans():
    assert plan_tools(None, None, True, None, False, grammar=XGRAMMAR).mode == "none"
    assert plan_tools(TOOLS, None, True, None, False, grammar=XGRAMMAR).mode == "none"
    auto = plan_tools(TOOLS, None, True, "hermes", True, grammar=XGRAMMAR)
    assert auto.mode == "auto" and auto.new_parser is HermesToolParser
    assert auto.template_tools == TOOLS and auto.structured_outputs is None
    required = plan_tools(TOOLS, "required", False, None, False, grammar=XGRAMMAR)
    assert required.new_parser is RequiredToolCallsParser
    assert required.structured_outputs.json["maxItems"] == 1  # parallel_tool_calls=False
    assert required.structured_outputs.disable_any_whitespace
    choice = {"type": "function", "function": {"name": "b"}}
    named = plan_tools(TOOLS, choice, True, None, False, grammar=XGRAMMAR)
    assert named.mode == "named" and named.structured_outputs.json == {"type": "object"}
    for tools, choice, match in [
        (None, "required", "needs tools"),
        (TOOLS + TOOLS[:1], "required", "duplicate"),
        (TOOLS, "sometimes", "tool_choice must be"),
        ([{"type": "retrieval"}], "required", "tools.0"),
    ]:
        with pytest.raises(APIError, match=match):
            plan_tools(tools, choice, True, "hermes", True, grammar=XGRAMMAR)


def test_chat_output_chain_splits_reasoning_then_calls_at_every_position():
    text = (
        "I should call a.</think>\n\nCalling.\n"
        '<tool_call>{"name": "a", "arguments": {"q": 1}}</tool_call>'
    )
    expected = None
    for cut in range(len(text) + 1):
        parser = ChatOutputParser(DeepSeekR1ReasoningParser(), HermesToolParser())
        parser.feed(text[:cut])
        parser.feed(text[cut:])
        parser.finish()
        message = parser.message()
        for call in message["tool_calls"]:
            call.pop("id")
        if expected is None:
            expected = message
        assert message == expected, cut
    assert expected == {
        "role": "assistant",
        "content": "Calling.",
        "reasoning_content": "I should call a.",
        "tool_calls": [{"type": "function", "function": {"name": "a", "arguments": '{"q": 1}'}}],
    }


def test_chat_output_without_parsers_is_plain_content():
    parser = ChatOutputParser()
    assert parser.feed("Hello") == {"content": "Hello"}
    assert parser.feed("") == {} and parser.finish() == {}
    assert parser.message() == {"role": "assistant", "content": "Hello"}
