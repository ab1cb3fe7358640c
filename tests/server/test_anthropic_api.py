"""The Anthropic Messages endpoints, spoken to with the unmodified ``anthropic`` SDK."""

from __future__ import annotations

import anthropic
import httpx
import pytest


@pytest.fixture(scope="module")
def client(tiny_server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=tiny_server.url, api_key="unused", max_retries=0)


MESSAGES = [{"role": "user", "content": "Hello there"}]
# This SDK version has no sampling arguments; the API fields still exist.
GREEDY = {"temperature": 0}


def test_messages(client):
    message = client.messages.create(
        model="tiny", max_tokens=5, messages=MESSAGES, system="Be brief.", extra_body=GREEDY
    )
    assert message.type == "message" and message.role == "assistant"
    assert message.content[0].type == "text"
    assert message.stop_reason == "max_tokens"
    assert message.usage.output_tokens == 5
    counted = client.messages.count_tokens(model="tiny", messages=MESSAGES, system="Be brief.")
    assert counted.input_tokens == message.usage.input_tokens


def test_messages_stream(client):
    kwargs = dict(model="tiny", max_tokens=6, messages=MESSAGES, extra_body=GREEDY)
    whole = client.messages.create(**kwargs)
    events = list(client.messages.create(**kwargs, stream=True))
    types = [event.type for event in events]
    assert types[:2] == ["message_start", "content_block_start"]
    assert types[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(types[2:-3]) <= {"content_block_delta"}
    text = "".join(e.delta.text for e in events if e.type == "content_block_delta")
    assert text == whole.content[0].text
    assert events[-2].delta.stop_reason == "max_tokens"
    assert events[-2].usage.output_tokens == 6
    with client.messages.stream(**kwargs) as stream:
        assert stream.get_final_text() == whole.content[0].text


def test_stop_sequence(client):
    whole = client.messages.create(
        model="tiny", max_tokens=12, messages=MESSAGES, extra_body=GREEDY
    )
    text = whole.content[0].text
    start = next(i for i in range(1, len(text) - 1) if text[i : i + 2].isascii())
    stop = text[start : start + 2]
    stopped = client.messages.create(
        model="tiny", max_tokens=12, messages=MESSAGES, extra_body=GREEDY, stop_sequences=[stop]
    )
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == stop
    assert stopped.content[0].text == text[: text.find(stop)]


def test_errors(client, tiny_server):
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="claude-x", max_tokens=5, messages=MESSAGES)
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(
            model="tiny", max_tokens=5, messages=MESSAGES, extra_body={"temperature": 3}
        )
    response = httpx.post(
        f"{tiny_server.url}/v1/messages", json={"model": "tiny", "messages": MESSAGES}
    )
    assert response.status_code == 400
    body = response.json()
    assert body["type"] == "error"
    assert body["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in body["error"]["message"]


HOUR = {
    "type": "object",
    "properties": {"hour": {"type": "integer", "minimum": 0, "maximum": 23}},
    "required": ["hour"],
    "additionalProperties": False,
}
TOOLS = [{"name": "get_time", "description": "The hour now.", "input_schema": HOUR}]


def test_forced_tool_use(client):
    """A named tool and "any" force a grammar-valid call (the random model cannot be asked
    to choose); streamed and whole replies agree."""
    import jsonschema

    for tool_choice in ({"type": "tool", "name": "get_time"}, {"type": "any"}):
        kwargs = dict(
            model="tiny",
            max_tokens=60,
            messages=[{"role": "user", "content": "What time is it?"}],
            tools=TOOLS,
            tool_choice=tool_choice,
            extra_body=GREEDY,
        )
        whole = client.messages.create(**kwargs)
        assert whole.stop_reason == "tool_use", whole
        (call,) = [block for block in whole.content if block.type == "tool_use"]
        assert call.name == "get_time" and call.id.startswith("toolu_")
        jsonschema.validate(call.input, HOUR)
        with client.messages.stream(**kwargs) as stream:
            streamed = stream.get_final_message()
        (streamed_call,) = [block for block in streamed.content if block.type == "tool_use"]
        assert streamed_call.input == call.input and streamed.stop_reason == "tool_use"


def test_tool_results_go_back_into_the_conversation(client):
    messages = [
        {"role": "user", "content": "What time is it?"},
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "Let me check."},
                {"type": "tool_use", "id": "toolu_1", "name": "get_time", "input": {"hour": 9}},
            ],
        },
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "9 am"}],
        },
    ]
    without_result = client.messages.count_tokens(model="tiny", messages=messages[:1])
    counted = client.messages.count_tokens(model="tiny", messages=messages, tools=TOOLS)
    assert counted.input_tokens > without_result.input_tokens
    reply = client.messages.create(
        model="tiny",
        max_tokens=3,
        messages=messages,
        tools=TOOLS,
        tool_choice={"type": "none"},
        extra_body=GREEDY,
    )
    assert [block.type for block in reply.content] == ["text"]
    assert reply.stop_reason == "max_tokens"


def test_bad_tools_are_400(client):
    question = [{"role": "user", "content": "Hi"}]
    cases = [
        ({"tools": [{"name": "f"}]}, "input_schema"),
        ({"tools": TOOLS, "tool_choice": {"type": "auto"}}, "enable-auto-tool-choice"),
        ({"tools": TOOLS, "tool_choice": {"type": "sometimes"}}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": {"type": "tool", "name": "other"}}, "not among"),
    ]
    for extra, needle in cases:
        with pytest.raises(anthropic.BadRequestError, match=needle):
            client.messages.create(model="tiny", max_tokens=3, messages=question, **extra)
    bad_block = [{"role": "user", "content": [{"type": "tool_use", "id": "x", "name": "f"}]}]
    with pytest.raises(anthropic.BadRequestError, match="tool_use"):
        client.messages.create(model="tiny", max_tokens=3, messages=bad_block)


def test_an_aborted_message_has_no_stop_reason(chat_checkpoint):
    """A request the engine aborts (``pause_generation(mode="abort")``) is no end of turn:
    vLLM's Messages API maps only stop, length and tool calls, so "abort" gives a null
    ``stop_reason``, whole or streamed."""
    from fake_engine import AbortingEngine, fake_context
    from starlette.testclient import TestClient

    from pagedlm.entrypoints.openai.app import build_app

    ctx = fake_context(AbortingEngine(chat_checkpoint, num_tokens=2))
    body = {"model": "tiny", "max_tokens": 8, "messages": MESSAGES}
    with TestClient(build_app(ctx)) as http:
        whole = http.post("/v1/messages", json=body).json()
        streamed = http.post("/v1/messages", json={**body, "stream": True}).text
    assert whole["stop_reason"] is None and whole["stop_sequence"] is None, whole
    assert whole["usage"]["output_tokens"] == 2
    deltas = [
        line.removeprefix("data: ")
        for line in streamed.splitlines()
        if line.startswith("data: ") and '"message_delta"' in line
    ]
    assert len(deltas) == 1
    assert '"stop_reason": null' in deltas[0], deltas
