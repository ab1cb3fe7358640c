"""A constraint the grammar backend cannot compile is a 400 naming the body field the
client sent (message and ``param``), on chat, completions and Responses, streamed or not:
``response_format``, ``text.format``, ``structured_outputs``, the deprecated ``guided_*``
fields, and a forced tool call's ``parameters``. Over ``FakeEngine``, whose input
processor checks grammars as the real engine's does."""

from __future__ import annotations

import pytest
from fake_engine import FakeEngine, fake_context
from starlette.testclient import TestClient

from pagedlm.entrypoints.openai.app import build_app

# Valid for jsonschema, refused by xgrammar (and outlines): minimum above maximum.
BAD_SCHEMA = {
    "type": "object",
    "properties": {"n": {"type": "integer", "minimum": 5, "maximum": 1}},
}
GOOD_SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}}
MESSAGES = [{"role": "user", "content": "hi"}]
CHAT = {"model": "tiny", "messages": MESSAGES, "max_tokens": 2}
COMPLETION = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
RESPONSES = {"model": "tiny", "input": "hi", "max_output_tokens": 2}


def _tool(parameters: dict) -> dict:
    return {"type": "function", "function": {"name": "f", "parameters": parameters}}


NAMED = {"type": "function", "function": {"name": "f"}}
CASES = [
    ("/v1/chat/completions", CHAT, {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": BAD_SCHEMA}}}, "response_format.json_schema.schema"),
    ("/v1/chat/completions", CHAT, {"structured_outputs": {"json": BAD_SCHEMA}}, "structured_outputs.json"),
    ("/v1/chat/completions", CHAT, {"guided_json": BAD_SCHEMA}, "guided_json"),
    ("/v1/chat/completions", CHAT, {"tools": [_tool(GOOD_SCHEMA), _tool(BAD_SCHEMA) | {"function": {"name": "g", "parameters": BAD_SCHEMA}}], "tool_choice": "required"}, "tools.1.function.parameters"),
    ("/v1/chat/completions", CHAT, {"tools": [_tool(BAD_SCHEMA)], "tool_choice": NAMED}, "tools.0.function.parameters"),
    ("/v1/completions", COMPLETION, {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": BAD_SCHEMA}}}, "response_format.json_schema.schema"),
    ("/v1/completions", COMPLETION, {"guided_regex": "a(b"}, "guided_regex"),
    ("/v1/completions", COMPLETION, {"structured_outputs": {"grammar": "root ::= undefined_rule"}}, "structured_outputs.grammar"),
    ("/v1/completions", COMPLETION, {"guided_grammar": "root ::= undefined_rule"}, "guided_grammar"),
    ("/v1/responses", RESPONSES, {"text": {"format": {"type": "json_schema", "name": "x", "schema": BAD_SCHEMA}}}, "text.format.schema"),
    ("/v1/responses", RESPONSES, {"tools": [{"type": "function", "name": "f", "parameters": BAD_SCHEMA}], "tool_choice": "required"}, "tools.0.parameters"),
]  # fmt: skip


@pytest.fixture(scope="module")
def client(chat_checkpoint):
    with TestClient(build_app(fake_context(FakeEngine(chat_checkpoint)))) as http:
        yield http


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(("path", "base", "extra", "field"), CASES)
def test_an_uncompilable_constraint_names_the_field_sent(client, path, base, extra, field, stream):
    response = client.post(path, json={**base, **extra, "stream": stream})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == field
    assert error["message"].startswith(f"Invalid {field}: "), error["message"]
    assert "structured_outputs." not in error["message"] or field.startswith("structured_outputs")


def test_a_too_long_schema_names_the_field_and_the_flag(chat_checkpoint):
    ctx = fake_context(FakeEngine(chat_checkpoint), structured_outputs_max_spec_chars=20)
    body = {**CHAT, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": GOOD_SCHEMA}}}  # fmt: skip
    with TestClient(build_app(ctx)) as http:
        error = http.post("/v1/chat/completions", json=body).json()["error"]
        served = http.post("/v1/chat/completions", json=CHAT)
    assert error["param"] == "response_format.json_schema.schema"
    assert "--structured-outputs-max-spec-chars" in error["message"]
    assert served.status_code == 200


def test_a_compilable_constraint_is_served(client):
    body = {**CHAT, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": GOOD_SCHEMA}}}  # fmt: skip
    assert client.post("/v1/chat/completions", json=body).status_code == 200
    tools = {"tools": [_tool(GOOD_SCHEMA)], "tool_choice": "required"}
    assert client.post("/v1/chat/completions", json={**CHAT, **tools}).status_code == 200


MESSAGES_BODY = {"model": "tiny", "messages": MESSAGES, "max_tokens": 2}
ANTHROPIC_CASES = [
    ({"tools": [{"name": "f", "input_schema": GOOD_SCHEMA}, {"name": "g", "input_schema": BAD_SCHEMA}], "tool_choice": {"type": "any"}}, "tools.1.input_schema"),
    ({"tools": [{"name": "f", "input_schema": BAD_SCHEMA}], "tool_choice": {"type": "tool", "name": "f"}}, "tools.0.input_schema"),
    ({"tools": [{"name": "f", "input_schema": {"type": "nope"}}], "tool_choice": {"type": "any"}}, "tools.0.input_schema"),
    ({"tools": [{"name": "", "input_schema": GOOD_SCHEMA}]}, "tools.0.name"),
]  # fmt: skip


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/messages/count_tokens"])
@pytest.mark.parametrize(("extra", "field"), ANTHROPIC_CASES)
def test_an_anthropic_tool_schema_error_names_input_schema(client, path, extra, field):
    """/v1/messages takes a tool's schema as ``input_schema``: its 400 names that field,
    not the OpenAI ``function.parameters`` it is turned into."""
    response = client.post(path, json={**MESSAGES_BODY, **extra})
    assert response.status_code == 400, response.text
    message = response.json()["error"]["message"]
    assert field in message, message
    assert "function.parameters" not in message
