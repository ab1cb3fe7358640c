"""The Messages API against what Anthropic documents (and vLLM's Anthropic endpoint does),
over HTTP to the app with a scripted engine: how content blocks reach the chat template,
the reply's blocks and their stream events, ids.

``ScriptedEngine`` writes its script one token per byte, then EOS; the tiny tokenizer has
one token per byte, so a token count is a byte count of the rendered ChatML prompt.
"""

from __future__ import annotations

import json

import pytest
from fake_engine import ScriptedEngine, fake_context
from starlette.testclient import TestClient

from pagedlm.entrypoints.openai.app import build_app


def _client(checkpoint, script: str = "Hi.", **server_flags) -> TestClient:
    return TestClient(build_app(fake_context(ScriptedEngine(checkpoint, script), **server_flags)))


def _count(client: TestClient, **body) -> int:
    response = client.post("/v1/messages/count_tokens", json={"model": "tiny", **body})
    assert response.status_code == 200, response.text
    return response.json()["input_tokens"]


def _text_blocks(*texts: str) -> list[dict]:
    return [{"type": "text", "text": text} for text in texts]


def test_text_blocks_reach_the_template_as_parts(chat_checkpoint):
    """Several text blocks are content parts, which a template that prints a string gets
    joined by newlines (as OpenAI chat parts, and as vLLM hands Anthropic blocks on):
    "Hello" and "world" are not "Helloworld". The same holds for system blocks and for a
    tool_result's text blocks."""
    joined = "Hello\nworld"
    with _client(chat_checkpoint) as client:
        user = _count(client, messages=[{"role": "user", "content": joined}])
        blocks = [{"role": "user", "content": _text_blocks("Hello", "world")}]
        assert _count(client, messages=blocks) == user
        question = [{"role": "user", "content": "Hi"}]
        system = _count(client, system=joined, messages=question)
        assert _count(client, system=_text_blocks("Hello", "world"), messages=question) == system
        call = {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {}}

        def result(content):
            return [
                *question,
                {"role": "assistant", "content": [call]},
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": "toolu_1", "content": content}
                    ],
                },
            ]

        assert _count(client, messages=result(_text_blocks("Hello", "world"))) == _count(
            client, messages=result(joined)
        )


HERMES = {"tool_parser": "hermes", "enable_auto_tool_choice": True}
CALL = '<tool_call>{"name": "get_time", "arguments": {"tz": "UTC"}}</tool_call>'
TIME_TOOL = {"name": "get_time", "input_schema": {"type": "object"}}
ASK = {"model": "tiny", "max_tokens": 200, "messages": [{"role": "user", "content": "Time?"}]}


def _events(stream: str) -> list[dict]:
    """The stream's events' data, each checked against its ``event:`` name."""
    events, name = [], None
    for line in stream.splitlines():
        if line.startswith("event: "):
            name = line.removeprefix("event: ")
        elif line.startswith("data: "):
            data = json.loads(line.removeprefix("data: "))
            assert data["type"] == name, (name, data)
            events.append(data)
    return events


def _streamed_content(events: list[dict]) -> list[dict]:
    """The content blocks a client builds from the events (as the SDK accumulates them):
    each block opens at the next index, gets its deltas, and closes before the next."""
    blocks: list[dict] = []
    open_index = None
    for event in events:
        if event["type"] == "content_block_start":
            assert open_index is None and event["index"] == len(blocks), events
            blocks.append(dict(event["content_block"]))
            open_index = event["index"]
        elif event["type"] == "content_block_delta":
            assert event["index"] == open_index, events
            delta, block = event["delta"], blocks[open_index]
            if delta["type"] == "text_delta":
                block["text"] += delta["text"]
            elif delta["type"] == "thinking_delta":
                block["thinking"] += delta["thinking"]
            elif delta["type"] == "signature_delta":
                block["signature"] += delta["signature"]
            elif delta["type"] == "input_json_delta":
                block["partial_json"] = block.get("partial_json", "") + delta["partial_json"]
            else:
                raise AssertionError(delta)
        elif event["type"] == "content_block_stop":
            assert event["index"] == open_index, events
            block = blocks[open_index]
            if block["type"] == "tool_use":
                block["input"] = json.loads(block.pop("partial_json", "{}"))
            open_index = None
    assert open_index is None
    return blocks


def _without_ids(blocks: list[dict]) -> list[dict]:
    """Each request names its tool calls afresh."""
    return [{k: v for k, v in block.items() if k != "id"} for block in blocks]


@pytest.mark.parametrize(
    ("script", "texts"), [(CALL, []), (f"Let me check.{CALL}", ["Let me check."])]
)
def test_a_reply_has_no_empty_text_block(chat_checkpoint, script, texts):
    """A reply that only calls a tool is that tool_use block, at index 0, whole or
    streamed: no empty text block before it (Anthropic never answers one, and refuses one
    sent back; vLLM's Messages API opens a text block only for text)."""
    body = {**ASK, "tools": [TIME_TOOL]}
    with _client(chat_checkpoint, script, **HERMES) as client:
        whole = client.post("/v1/messages", json=body).json()
        events = _events(client.post("/v1/messages", json={**body, "stream": True}).text)
    expected_texts = [{"type": "text", "text": text} for text in texts]
    assert [b for b in whole["content"] if b["type"] == "text"] == expected_texts, whole
    assert [b["type"] for b in whole["content"]] == ["text"] * len(texts) + ["tool_use"]
    assert whole["content"][-1]["input"] == {"tz": "UTC"}
    assert whole["stop_reason"] == "tool_use"
    assert _without_ids(_streamed_content(events)) == _without_ids(whole["content"])


def test_a_message_id_has_anthropics_form(chat_checkpoint):
    """A message's id is "msg_...", as Anthropic's are (vLLM answers its chat id), whole
    and in message_start; a client's X-Request-Id still names it."""
    body = {**ASK, "max_tokens": 5}
    with _client(chat_checkpoint) as client:
        whole = client.post("/v1/messages", json=body).json()
        events = _events(client.post("/v1/messages", json={**body, "stream": True}).text)
        named = client.post("/v1/messages", json=body, headers={"X-Request-Id": "abc"}).json()
    assert whole["id"].startswith("msg_") and "-" not in whole["id"][:5], whole
    assert events[0]["message"]["id"].startswith("msg_"), events[0]
    assert named["id"] == "msg_abc", named


@pytest.mark.parametrize("tools", [False, True])
def test_reasoning_is_a_thinking_block(chat_checkpoint, tools):
    """With --reasoning-parser the model's reasoning is a "thinking" block before the text
    (and the tool calls), whole and streamed (thinking_delta), as vLLM's Messages API
    answers it and Anthropic's extended thinking does; it was left in the text."""
    script = "<think>Ponder.</think>Answer." + (CALL if tools else "")
    body = {**ASK, "tools": [TIME_TOOL]} if tools else ASK
    flags = {"reasoning_parser": "deepseek_r1", **(HERMES if tools else {})}
    with _client(chat_checkpoint, script, **flags) as client:
        whole = client.post("/v1/messages", json=body).json()
        events = _events(client.post("/v1/messages", json={**body, "stream": True}).text)
    thinking, text = whole["content"][:2]
    assert thinking["type"] == "thinking" and thinking["thinking"] == "Ponder.", whole
    assert isinstance(thinking["signature"], str)
    assert text == {"type": "text", "text": "Answer."}
    assert [b["type"] for b in whole["content"][2:]] == (["tool_use"] if tools else [])
    assert _without_ids(_streamed_content(events)) == _without_ids(whole["content"])


def test_a_thought_the_template_opened_is_a_thinking_block(chat_checkpoint):
    """Qwen3.5's template ends the prompt with ``<think>`` and a newline; the model writes
    ``thought</think>answer``, whose thought and tag were the text block."""
    template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
        "{% endfor %}<|im_start|>assistant\n<think>\n"
    )
    flags = {"reasoning_parser": "qwen3", "chat_template": template}
    with _client(chat_checkpoint, "Ponder.\n</think>\n\nAnswer.", **flags) as client:
        whole = client.post("/v1/messages", json=ASK).json()
        events = _events(client.post("/v1/messages", json={**ASK, "stream": True}).text)
    assert [(b["type"], b.get("thinking", b.get("text"))) for b in whole["content"]] == [
        ("thinking", "Ponder.\n"),
        ("text", "Answer."),
    ], whole
    assert _streamed_content(events) == whole["content"]


def test_thinking_blocks_come_back(chat_checkpoint):
    """An assistant turn may carry its thinking and redacted_thinking blocks back (the SDK's
    agent loops send a reply's content as it came, and Anthropic requires it around tool
    use): they are accepted, the thought handed to the template as ``reasoning_content``
    (which this ChatML template does not print; Qwen3's shows the latest), redacted ones
    dropped. They were a 400."""
    thought = {"type": "thinking", "thinking": "Ponder.", "signature": ""}
    redacted = {"type": "redacted_thinking", "data": "opaque"}
    call = {"type": "tool_use", "id": "toolu_1", "name": "get_time", "input": {}}
    result = {"type": "tool_result", "tool_use_id": "toolu_1", "content": "9"}

    def conversation(*blocks):
        return [
            {"role": "user", "content": "Time?"},
            {"role": "assistant", "content": [*blocks, {"type": "text", "text": "It is"}, call]},
            {"role": "user", "content": [result]},
        ]

    body = {**ASK, "tools": [TIME_TOOL], "tool_choice": {"type": "none"}}
    with _client(chat_checkpoint, **HERMES) as client:
        plain = _count(client, messages=conversation(), tools=[TIME_TOOL])
        assert _count(client, messages=conversation(thought, redacted), tools=[TIME_TOOL]) == plain
        reply = client.post("/v1/messages", json={**body, "messages": conversation(thought)})
    assert reply.status_code == 200, reply.text
    user_thought = [{"role": "user", "content": [thought]}]
    with _client(chat_checkpoint) as client:
        refused = client.post("/v1/messages", json={**ASK, "messages": user_thought})
    assert refused.status_code == 400 and "thinking" in refused.json()["error"]["message"]


def test_a_turn_without_blocks_is_400(chat_checkpoint):
    """A turn's content of no blocks is a 400 naming it (Anthropic: "all messages must have
    non-empty content except for the optional final assistant message"; vLLM refuses an
    empty list too), on count_tokens as on messages; a final assistant turn may be empty
    (an empty prefill). It became an empty turn."""
    hello = {"role": "user", "content": "Hello"}
    empty_user = [hello, {"role": "assistant", "content": "Hi"}, {"role": "user", "content": []}]
    empty_assistant = [hello, {"role": "assistant", "content": []}, hello]
    with _client(chat_checkpoint) as client:
        for messages, where in ((empty_user, "messages.2"), (empty_assistant, "messages.1")):
            for path in ("/v1/messages", "/v1/messages/count_tokens"):
                response = client.post(path, json={**ASK, "messages": messages})
                assert response.status_code == 400, response.text
                error = response.json()["error"]
                assert error["type"] == "invalid_request_error", error
                assert error["message"].startswith(where), error
        prefill = [hello, {"role": "assistant", "content": []}]
        assert client.post("/v1/messages", json={**ASK, "messages": prefill}).status_code == 200


def test_message_delta_usage_counts_input_too(chat_checkpoint):
    """message_delta's usage is the message's cumulative usage, input tokens with the
    output ones (Anthropic's MessageDeltaUsage; vLLM sends both), equal to a whole reply's."""
    with _client(chat_checkpoint) as client:
        whole = client.post("/v1/messages", json=ASK).json()
        events = _events(client.post("/v1/messages", json={**ASK, "stream": True}).text)
    (delta,) = [event for event in events if event["type"] == "message_delta"]
    assert delta["usage"] == whole["usage"], (delta, whole)


def test_consecutive_turns_of_one_role_are_one_turn(chat_checkpoint):
    """Anthropic combines consecutive user (or assistant) turns into one; a 400 still
    names the block as the request numbers it."""
    with _client(chat_checkpoint) as client:
        merged = _count(client, messages=[{"role": "user", "content": _text_blocks("Hi", "there")}])
        split = [{"role": "user", "content": "Hi"}, {"role": "user", "content": "there"}]
        assert _count(client, messages=split) == merged
        prefill = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "A"}]
        assert _count(client, messages=[*prefill, {"role": "assistant", "content": "B"}]) == (
            _count(
                client,
                messages=[prefill[0], {"role": "assistant", "content": _text_blocks("A", "B")}],
            )
        )
        bad = [*split, {"role": "user", "content": [{"type": "text", "text": 3}]}]
        response = client.post("/v1/messages/count_tokens", json={"model": "tiny", "messages": bad})
        assert response.status_code == 400
        assert response.json()["error"]["message"].startswith("messages.2.content.0:")
