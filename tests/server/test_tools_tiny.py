"""Tools and structured outputs through the shared tiny-model server (default suite).

The model is random, so only grammar-forced outputs are checked for content; the slow
``test_tools_server.py`` does the same with SmolLM2 and the parsers on model text.
"""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

HOUR = {
    "type": "object",
    "properties": {"hour": {"type": "integer", "minimum": 0, "maximum": 23}},
    "required": ["hour"],
    "additionalProperties": False,
}
TOOLS = [{"type": "function", "function": {"name": "get_time", "parameters": HOUR}}]
MESSAGES = [{"role": "user", "content": "What time is it?"}]


@pytest.fixture(scope="module")
def client(tiny_server):
    return openai.OpenAI(base_url=f"{tiny_server.url}/v1", api_key="x", max_retries=0)


def _chat(client, stream=False, **kwargs):
    kwargs = {"model": "tiny", "messages": MESSAGES, "temperature": 0, "max_tokens": 80, **kwargs}
    return client.chat.completions.create(stream=stream, **kwargs)


def test_named_and_required_tool_choice(client):
    named = {"type": "function", "function": {"name": "get_time"}}
    for tool_choice, finish in ((named, "stop"), ("required", "tool_calls")):
        reply = _chat(client, tools=TOOLS, tool_choice=tool_choice)
        choice = reply.choices[0]
        assert choice.finish_reason == finish, choice
        (call,) = choice.message.tool_calls
        assert call.function.name == "get_time"
        jsonschema.validate(json.loads(call.function.arguments), HOUR)
        arguments, names = "", []
        for chunk in _chat(client, True, tools=TOOLS, tool_choice=tool_choice):
            for delta in chunk.choices[0].delta.tool_calls or []:
                names += [delta.function.name] if delta.function.name else []
                arguments += delta.function.arguments or ""
        assert names == ["get_time"] and arguments == call.function.arguments


def test_required_tool_choice_with_refs_to_defs(client):
    # pydantic writes nested models as $refs to "#/$defs/...": they must still resolve
    # once the tools' schemas sit inside the required-calls array (a 400 before).
    hour = {"type": "object", "properties": {"at": {"$ref": "#/$defs/Hour"}}, "required": ["at"]}
    hour["additionalProperties"] = False
    hour["$defs"] = {"Hour": {"enum": [7, 19]}}
    tools = [{"type": "function", "function": {"name": "set_alarm", "parameters": hour}}]
    reply = _chat(client, tools=tools, tool_choice="required")
    (call,) = reply.choices[0].message.tool_calls
    assert json.loads(call.function.arguments)["at"] in (7, 19)
    twice = tools + [{"type": "function", "function": {"name": "nap", "parameters": {**hour}}}]
    twice[1]["function"]["parameters"]["$defs"] = {"Hour": {"enum": [1]}}
    with pytest.raises(openai.BadRequestError, match=r"\$defs.Hour differently"):
        _chat(client, tools=twice, tool_choice="required")


def test_response_format_and_structured_outputs(client):
    # a schema without room for whitespace: a random model would fill it with blanks
    schema = {"enum": ["morning", "evening"]}
    reply = _chat(
        client,
        response_format={"type": "json_schema", "json_schema": {"name": "when", "schema": schema}},
    )
    assert json.loads(reply.choices[0].message.content) in ("morning", "evening")
    reply = client.completions.create(
        model="tiny",
        prompt="Pick:",
        max_tokens=5,
        extra_body={"structured_outputs": {"choice": ["yes", "no"]}},
    )
    assert reply.choices[0].text in ("yes", "no")


def test_auto_needs_a_tool_parser(client):
    with pytest.raises(openai.BadRequestError, match="enable-auto-tool-choice"):
        _chat(client, tools=TOOLS, tool_choice="auto")
    # without --enable-auto-tool-choice, tools default to "none": plain content
    reply = _chat(client, tools=TOOLS, max_tokens=3)
    assert reply.choices[0].message.tool_calls is None


def test_invalid_tool_schema_is_400(client):
    bad = [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}]
    with pytest.raises(openai.BadRequestError, match="not a valid JSON schema"):
        _chat(client, tools=bad, tool_choice="required")


TOOLS_TEMPLATE = (
    "tools={{ tools | map(attribute='function.name') | join(',') if tools else 'none' }}|"
    "{% for m in messages %}{{ m['content'] }}{% endfor %}"
)


@pytest.mark.parametrize("exclude", [False, True])
def test_tool_choice_none_shows_the_tools_to_the_template_unless_excluded(chat_checkpoint, exclude):
    from fake_engine import FakeEngine, fake_context
    from starlette.testclient import TestClient

    from pagedlm.entrypoints.openai.app import build_app

    engine = FakeEngine(chat_checkpoint)
    ctx = fake_context(engine, chat_template=TOOLS_TEMPLATE,
                       exclude_tools_when_tool_choice_none=exclude)  # fmt: skip
    with TestClient(build_app(ctx)) as client:
        for tool_choice in ("none", None):  # left out: "none" without a tool parser
            body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                    "tools": TOOLS, "max_tokens": 1, "return_token_ids": True}  # fmt: skip
            if tool_choice is not None:
                body["tool_choice"] = tool_choice
            answer = client.post("/v1/chat/completions", json=body)
            assert answer.status_code == 200, answer.text
            prompt = engine.tokenizer.decode(answer.json()["prompt_token_ids"])
            names = ",".join(t["function"]["name"] for t in TOOLS)
            assert prompt.startswith("tools=none|" if exclude else f"tools={names}|"), prompt
