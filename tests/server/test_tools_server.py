"""Tools, tool_choice, response_format, structured_outputs and reasoning through a real
``pagedlm serve`` with the embedded SmolLM2, driven by the unmodified openai SDK (slow).

Where a test needs the model to write a particular text (a hermes tool call, a thought),
a ``choice`` constraint makes it, so the parsers see real streamed tokens.
"""

from __future__ import annotations

import json
import time

import jsonschema
import openai
import pytest
from pydantic import BaseModel
from server_utils import start_server

pytestmark = pytest.mark.slow  # a real model on CPU; test_tools_tiny.py covers the wiring quickly

WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city.",
            "parameters": WEATHER_PARAMETERS,
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "parameters": {
                "type": "object",
                "properties": {"hour": {"type": "integer", "minimum": 0, "maximum": 23}},
                "required": ["hour"],
                "additionalProperties": False,
            },
        },
    },
]
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]
HERMES_CALL = '<tool_call>\n{"name": "get_time", "arguments": {"hour": 9}}\n</tool_call>'


@pytest.fixture(scope="module")
def server(smollm2_path, tmp_path_factory):
    started = time.monotonic()
    server = start_server(
        smollm2_path,
        tmp_path_factory.mktemp("logs") / "tools.log",
        "--max-model-len", "512",
        "--tool-call-parser", "hermes",
        "--enable-auto-tool-choice",
        "--reasoning-parser", "qwen3",
        "--trust-request-chat-template",
        # Streamed and non-streamed replies to one request are compared token for token; the
        # second hits the prefix cache, and only this mode keeps its logits those of the first
        # (otherwise the enum's "celsius" and "fahrenheit", a near-tie, can swap).
        "--batch-invariant",
    )  # fmt: skip
    print(f"pagedlm serve healthy after {time.monotonic() - started:.1f} s")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)


def _chat(client, stream=False, **kwargs):
    kwargs = {"model": "tiny", "messages": ASK_WEATHER, "temperature": 0, **kwargs}
    return client.chat.completions.create(stream=stream, **kwargs)


def _streamed_calls(chunks) -> tuple[list[dict], str | None, str]:
    """Reassemble streamed tool-call deltas the way clients do."""
    calls: dict[int, dict] = {}
    finish, content = None, []
    for chunk in chunks:
        for choice in chunk.choices:
            content.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"id": None, "name": "", "arguments": ""})
                call["id"] = delta.id or call["id"]
                if delta.function.name:
                    call["name"] += delta.function.name
                call["arguments"] += delta.function.arguments or ""
    return [calls[i] for i in sorted(calls)], finish, "".join(content)


def test_response_format_json_schema(client):
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 10}, "rank": {"type": "integer"}},
        "required": ["city", "rank"],
    }
    reply = _chat(
        client,
        messages=[{"role": "user", "content": "Name a big city as JSON."}],
        max_tokens=40,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": schema}},
    )
    jsonschema.validate(json.loads(reply.choices[0].message.content), schema)


class City(BaseModel):
    name: str
    country: str


def test_parse_with_pydantic_model(client):
    completion = client.chat.completions.parse(
        model="tiny",
        messages=[{"role": "user", "content": "Paris is in which country? Answer in JSON."}],
        response_format=City,
        max_tokens=40,
        temperature=0,
    )
    parsed = completion.choices[0].message.parsed
    assert isinstance(parsed, City)


def test_tool_choice_required_returns_valid_calls(client):
    reply = _chat(client, tools=TOOLS, tool_choice="required", max_tokens=60)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.tool_calls
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for call in choice.message.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    stream = _chat(client, stream=True, tools=TOOLS, tool_choice="required", max_tokens=60)
    calls, finish, _ = _streamed_calls(stream)
    assert finish == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (c.function.name, c.function.arguments) for c in choice.message.tool_calls
    ]


def test_named_tool_choice_streams_the_same_call(client):
    named = {"type": "function", "function": {"name": "get_weather"}}
    reply = _chat(client, tools=TOOLS, tool_choice=named, max_tokens=40)
    (call,) = reply.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER_PARAMETERS)
    assert reply.choices[0].message.content is None
    calls, _, _ = _streamed_calls(
        _chat(client, True, tools=TOOLS, tool_choice=named, max_tokens=40)
    )
    assert [(c["name"], c["arguments"]) for c in calls] == [
        ("get_weather", call.function.arguments)
    ]


def test_auto_tool_choice_parses_hermes_calls(client):
    forced = {"structured_outputs": {"choice": [f"Let me look.\n{HERMES_CALL}"]}}
    kwargs = {"tools": TOOLS, "max_tokens": 100, "extra_body": forced}
    reply = _chat(client, **kwargs)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls", (reply.usage, choice.message)
    assert choice.message.content == "Let me look."
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_time"
    assert json.loads(call.function.arguments) == {"hour": 9}
    calls, finish, content = _streamed_calls(_chat(client, True, **kwargs))
    assert finish == "tool_calls" and content == "Let me look."
    assert [(c["name"], c["arguments"]) for c in calls] == [("get_time", call.function.arguments)]


def test_auto_tool_choice_plain_answer_and_none(client):
    reply = _chat(client, tools=TOOLS, max_tokens=8)
    assert reply.choices[0].message.tool_calls in (None, [])
    assert reply.choices[0].message.content
    reply = _chat(client, tools=TOOLS, tool_choice="none", max_tokens=8)
    assert reply.choices[0].finish_reason == "length" and reply.choices[0].message.content


def test_reasoning_content(client):
    forced = {"structured_outputs": {"choice": ["<think>It is France.</think>\nParis."]}}
    reply = _chat(client, max_tokens=30, extra_body=forced)
    message = reply.choices[0].message
    assert message.reasoning_content == "It is France."
    assert message.content == "Paris."
    chunks = list(_chat(client, True, max_tokens=30, extra_body=forced))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == "It is France."
    assert "".join(d.content or "" for d in deltas) == "Paris."


def test_chat_template_receives_tools(client):
    template = (
        "{{ tools | tojson if tools else '' }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    )
    kwargs = {"max_tokens": 1, "extra_body": {"chat_template": template}}
    with_tools = _chat(client, tools=TOOLS, tool_choice="none", **kwargs).usage.prompt_tokens
    with_auto = _chat(client, tools=TOOLS, **kwargs).usage.prompt_tokens
    without = _chat(client, **kwargs).usage.prompt_tokens
    # "none" shows the tools too, as vLLM's does (--exclude-tools-when-tool-choice-none: not)
    assert with_auto > without and with_tools == with_auto


def test_completions_structured_outputs(client):
    reply = client.completions.create(
        model="tiny",
        prompt="The year is",
        max_tokens=8,
        temperature=0,
        extra_body={"structured_outputs": {"regex": " [12][0-9]{3}"}},
    )
    text = reply.choices[0].text
    assert len(text) == 5 and text[1:].isdigit(), text


@pytest.mark.parametrize(
    "kwargs, param",
    [
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}]}, "tools.0.function.parameters"),
        ({"tools": [{"type": "function", "function": {"parameters": {}}}]}, "tools.0"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "missing"}}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}}, "response_format.json_schema.schema"),
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"extra_body": {"structured_outputs": {"json": {}, "regex": "a"}}}, "structured_outputs"),
        ({"extra_body": {"structured_outputs": {"regexp": "a"}}}, "structured_outputs"),
        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ],
)  # fmt: skip
def test_bad_requests_are_400(client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as error:
        _chat(client, max_tokens=4, **kwargs)
    assert error.value.body["param"] == param, error.value.body
