"""``/v1/responses`` against OpenAI's documented Responses API (and vLLM's, where users rely
on it), over HTTP to the app with a scripted engine: which request fields are served,
which field a 400 names, what usage reports.

``ScriptedEngine`` writes its script one token per byte, then EOS; the tiny tokenizer has
one token per byte, so a token count is a byte count of the rendered prompt.
"""

from __future__ import annotations

import json

import pytest
from fake_engine import ScriptedEngine, fake_context
from starlette.testclient import TestClient

from pagedlm.entrypoints.openai.app import build_app

EFFORT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if reasoning_effort is defined %}effort={{ reasoning_effort }}\n{% endif %}assistant:"
)


def _client(checkpoint, script: str = "Hi.", engine=None, **server_flags) -> TestClient:
    engine = engine or ScriptedEngine(checkpoint, script)
    return TestClient(build_app(fake_context(engine, **server_flags)))


def _create(client: TestClient, **body) -> dict:
    response = client.post("/v1/responses", json={"model": "tiny", "input": "Hi", **body})
    assert response.status_code == 200, response.text
    return response.json()


def _error(client: TestClient, **body) -> dict:
    response = client.post("/v1/responses", json={"model": "tiny", "input": "Hi", **body})
    assert response.status_code == 400, response.text
    return response.json()["error"]


def test_reasoning_effort_reaches_the_chat_template_and_is_echoed(chat_checkpoint):
    """OpenAI's ``reasoning`` ({"effort", "summary"}) is served as chat's
    ``reasoning_effort`` (handed to the chat template, as vLLM hands it to gpt-oss's
    prompt); the response echoes the config. It was a 400 for any effort."""
    with _client(chat_checkpoint, chat_template=EFFORT_TEMPLATE) as client:
        plain = _create(client)
        assert plain["reasoning"] == {"effort": None, "summary": None}
        reasoning = {"effort": "high", "summary": "auto"}
        high = _create(client, reasoning=reasoning)
        assert high["reasoning"] == reasoning
        assert high["usage"]["input_tokens"] == plain["usage"]["input_tokens"] + len(
            "effort=high\n"
        )
        error = _error(client, reasoning={"effort": "extreme"})
        assert error["param"] == "reasoning.effort"


@pytest.mark.parametrize(
    ("body", "param", "not_named"),
    [
        ({"max_output_tokens": 100_000}, "max_output_tokens", "max_tokens"),
        (
            {"tools": [{"type": "function", "name": "f", "parameters": 5}]},
            "tools.0.parameters",
            "function",
        ),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema", "response_format"),
    ],
)  # fmt: skip
def test_a_400_names_the_responses_field_not_the_chat_field(
    chat_checkpoint, body, param, not_named
):
    """The request is served by the chat path; its errors named chat's fields
    (max_tokens, tools.0.function.parameters, response_format), which a Responses
    request does not have."""
    with _client(chat_checkpoint) as client:
        for stream in (False, True):
            error = _error(client, stream=stream, **body)
            assert error["param"] == param, error
            assert param in error["message"] and not_named not in error["message"], error


class CachingEngine(ScriptedEngine):
    """Reports ``num_cached`` of every prompt's tokens as served by the prefix cache."""

    num_cached = 16

    def _step(self, child_id, processed, step):
        output = super()._step(child_id, processed, step)
        return output._replace(num_cached_tokens=self.num_cached)


def test_usage_reports_cached_input_tokens(chat_checkpoint):
    """With ``--enable-prompt-tokens-details`` chat reports the prompt's cached tokens;
    a response's ``input_tokens_details.cached_tokens`` said 0 whatever the cache did."""
    engine = CachingEngine(chat_checkpoint, "Hi.")
    with _client(chat_checkpoint, engine=engine, enable_prompt_tokens_details=True) as client:
        usage = _create(client)["usage"]
        details = {"cached_tokens": CachingEngine.num_cached, "cache_write_tokens": 0}
        assert usage["input_tokens_details"] == details
        stream = client.post("/v1/responses", json={"model": "tiny", "input": "Hi", "stream": True})
        assert f'"cached_tokens": {CachingEngine.num_cached}' in stream.text.splitlines()[-2]


class LogprobEngine(ScriptedEngine):
    """Writes its script with a logprob row for every token (when the request asks)."""

    def _step(self, child_id, processed, step):
        output = super()._step(child_id, processed, step)
        rows = self._rows(output.new_token_ids, processed.params.logprobs)
        return output._replace(new_logprobs=rows)


def test_include_output_text_logprobs(chat_checkpoint):
    """``include=["message.output_text.logprobs"]`` (with ``top_logprobs``) was a 400: the
    output text's tokens now come with logprobs, in the part and on each delta, as OpenAI
    documents and vLLM serves; the reasoning's tokens and the ``</think>`` tag the
    reasoning parser swallowed are not output text. ``reasoning.encrypted_content`` is
    accepted (reasoning items carry their text in the clear)."""
    engine = LogprobEngine(chat_checkpoint, "<think>ab</think>Hi")
    include = ["message.output_text.logprobs", "reasoning.encrypted_content"]
    with _client(chat_checkpoint, engine=engine, reasoning_parser="qwen3") as client:
        body = _create(client, include=include, top_logprobs=1)
        assert body["top_logprobs"] == 1
        reasoning, message = body["output"]
        assert reasoning["content"] == [{"type": "reasoning_text", "text": "ab"}]
        (part,) = message["content"]
        assert part["text"] == "Hi" and [lp["token"] for lp in part["logprobs"]] == ["H", "i"]
        assert all(lp["top_logprobs"] and lp["logprob"] <= 0 for lp in part["logprobs"])
        plain = _create(client)["output"][1]["content"][0]
        assert plain["text"] == "Hi" and plain["logprobs"] == []

        stream = client.post(
            "/v1/responses",
            json={"model": "tiny", "input": "Hi", "include": include, "stream": True},
        ).text
        events = [json.loads(line[6:]) for line in stream.splitlines() if line[:6] == "data: "]
        deltas = [e for e in events if e["type"] == "response.output_text.delta"]
        for delta in deltas:
            assert "".join(lp["token"] for lp in delta["logprobs"]) == delta["delta"]
        (done,) = [e for e in events if e["type"] == "response.output_text.done"]
        assert done["logprobs"] == [lp for d in deltas for lp in d["logprobs"]]
        final = events[-1]["response"]["output"][1]["content"][0]
        assert final["logprobs"] == done["logprobs"] and len(done["logprobs"]) == 2

        error = _error(client, include=["file_search_call.results"])
        assert error["param"] == "include.0"


class FailingEngine(ScriptedEngine):
    """Fails after writing two tokens of its script (an engine error mid-stream)."""

    def _step(self, child_id, processed, step):
        if step == 2:
            raise RuntimeError("the GPU fell over")
        return super()._step(child_id, processed, step)


def test_a_stream_that_fails_ends_with_response_failed(chat_checkpoint):
    """A stream whose generation fails after it started ends as OpenAI documents: the
    item it cut closes (status "incomplete"), then ``response.failed`` carries the
    response with status "failed" and ``error`` {code, message}, numbered like every
    event. It ended with chat's bare ``data: {"error": ...}`` and ``data: [DONE]``,
    neither a Responses event. The failed response is stored, as OpenAI's are."""
    with _client(chat_checkpoint, engine=FailingEngine(chat_checkpoint, "Hello")) as client:
        stream = client.post("/v1/responses", json={"model": "tiny", "input": "Hi", "stream": True})
        lines = [line for line in stream.text.splitlines() if line]
        assert "data: [DONE]" not in lines
        names = [line[7:] for line in lines if line.startswith("event: ")]
        events = [json.loads(line[6:]) for line in lines if line.startswith("data: ")]
        assert names == [e["type"] for e in events]
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
        assert names[-3:] == [
            "response.content_part.done",
            "response.output_item.done",
            "response.failed",
        ]
        assert events[-2]["item"]["status"] == "incomplete"
        failed = events[-1]["response"]
        assert failed["status"] == "failed" and failed["usage"] is None
        assert failed["error"]["code"] == "server_error" and failed["error"]["message"]
        assert failed["output"] == [events[-2]["item"]]
        stored = client.get(f"/v1/responses/{failed['id']}").json()
        assert stored["status"] == "failed"


@pytest.mark.parametrize(
    ("parser", "script", "reasoning_tokens"),
    [
        ("qwen3", "<think>ab</think>Hi", 2),  # the markers are not reasoning
        ("qwen3", "<think>a<b</think>Hi", 3),  # a held "<" that was no marker is
        ("deepseek_r1", " ab</think>Hi", 3),  # the template opened the thought
        ("qwen3", "Hi", 0),
    ],
)
def test_usage_counts_reasoning_tokens(chat_checkpoint, parser, script, reasoning_tokens):
    """``output_tokens_details.reasoning_tokens`` said 0 whatever the model thought: it
    now counts the output tokens of the reasoning, as vLLM's (the tokens between the
    reasoning markers; one token per byte here), streamed or not; chat's usage reports
    them as ``completion_tokens_details.reasoning_tokens``, as OpenAI's and vLLM's."""
    engine = ScriptedEngine(chat_checkpoint, script)
    with _client(chat_checkpoint, engine=engine, reasoning_parser=parser) as client:
        usage = _create(client)["usage"]
        assert usage["output_tokens_details"] == {"reasoning_tokens": reasoning_tokens}
        assert usage["output_tokens"] == len(script) + 1  # and EOS
        stream = client.post("/v1/responses", json={"model": "tiny", "input": "Hi", "stream": True})
        final = json.loads(stream.text.splitlines()[-2][6:])["response"]
        assert final["usage"] == usage
        chat = client.post(
            "/v1/chat/completions",
            json={"model": "tiny", "messages": [{"role": "user", "content": "Hi"}]},
        ).json()["usage"]
        assert chat["completion_tokens_details"] == {"reasoning_tokens": reasoning_tokens}


def test_a_streamed_reasoning_item_has_its_reasoning_text_part(chat_checkpoint):
    """A reasoning item streams as OpenAI documents it: its ``reasoning_text`` part opens
    with ``response.content_part.added`` and closes with ``response.content_part.done``
    around the ``response.reasoning_text`` deltas and done, as a message's ``output_text``
    part does; the part events were missing. The item events parse as the SDK's."""
    from openai.types.responses import ResponseStreamEvent
    from pydantic import TypeAdapter

    engine = ScriptedEngine(chat_checkpoint, "<think>ab</think>Hi")
    with _client(chat_checkpoint, engine=engine, reasoning_parser="qwen3") as client:
        stream = client.post("/v1/responses", json={"model": "tiny", "input": "Hi", "stream": True})
    events = [json.loads(line[6:]) for line in stream.text.splitlines() if line[:6] == "data: "]
    adapter = TypeAdapter(ResponseStreamEvent)
    for event in events:
        if "response" not in event:  # the item and part events
            adapter.validate_python(event)
    kinds = [e["type"].removeprefix("response.") for e in events]
    reasoning = kinds[kinds.index("output_item.added") : kinds.index("output_item.done") + 1]
    assert reasoning == [
        "output_item.added",
        "content_part.added",
        "reasoning_text.delta",
        "reasoning_text.delta",
        "reasoning_text.done",
        "content_part.done",
        "output_item.done",
    ]
    added, done = [e for e in events if e["type"].startswith("response.content_part")][:2]
    item = events[-1]["response"]["output"][0]
    assert added["part"] == {"type": "reasoning_text", "text": ""}
    assert done["part"] == {"type": "reasoning_text", "text": "ab"} == item["content"][0]
    for event in (added, done):
        assert event["item_id"] == item["id"]
        assert event["output_index"] == event["content_index"] == 0


def test_a_chat_error_names_the_responses_field_not_a_chat_message(chat_checkpoint):
    """The chat request's errors name its messages (``messages.2.tool_calls.0...``),
    which a Responses request does not have, and whose indices are not its input's
    (instructions come first, an earlier response's turns next). A call whose arguments
    the model left unfinished, stored with the response, failed the follow-up naming
    ``messages.2``: it names ``previous_response_id``, where that message came from."""
    tools = [{"type": "function", "name": "f", "parameters": {"type": "object"}}]
    forced = {"type": "function", "name": "f"}
    with _client(chat_checkpoint, script='{"a": 1') as client:
        first = _create(client, tools=tools, tool_choice=forced)
        assert first["output"][0]["arguments"] == '{"a": 1'
        follow_up = {"previous_response_id": first["id"], "instructions": "Be brief."}
        error = _error(client, **follow_up)
        assert error["param"] == "previous_response_id", error
        assert "messages." not in error["message"] and "previous_response_id" in error["message"]


def test_chat_places_map_onto_input_items():
    """Where the mapping is known, a chat place names the input item it came from: the
    instructions' system message shifts the indices, a function_call item merges into
    the assistant turn before it; a place no single item holds loses its index."""
    from pagedlm.entrypoints.openai.protocol_responses import ResponsesRequest

    items = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "Let me look."},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{}"},
        {"type": "reasoning", "summary": []},
        {"type": "function_call_output", "call_id": "c1", "output": "1"},
    ]
    request = ResponsesRequest.model_validate({"input": items, "instructions": "sys"})
    layout = request.chat_layout(num_previous=2)  # chat: sys, 2 earlier turns, then input
    assert [layout.place(i, "") for i in range(7)] == [
        "instructions", "previous_response_id", "previous_response_id",
        "input.0", "input", "input.5", "input",
    ]  # fmt: skip
    assert layout.place(4, ".content") == "input.1.content"
    assert layout.place(4, ".tool_calls.1.function.arguments") == "input.3.arguments"
    assert layout.place(4, ".tool_calls.0.id") == "input.2.call_id"
    assert layout.place(4, ".tool_calls.2.function.name") == "input"
    assert layout.place(5, ".content") == "input.5.output"
    assert layout.place(5, ".tool_call_id") == "input.5.call_id"
    assert layout.located("messages.4.tool_calls.0.function.arguments is bad.") == (
        "input.2.arguments is bad."
    )
    text = ResponsesRequest.model_validate({"input": "hi"}).chat_layout(num_previous=0)
    assert text.place(0, ".content") == "input"


class SaltRecordingEngine(ScriptedEngine):
    """Keeps every prompt the engine is handed."""

    def __init__(self, checkpoint, script: str = "Hi.") -> None:
        super().__init__(checkpoint, script)
        self.prompts: list = []

    def generate(self, prompt, params, request_id, priority=0, lora_request=None):
        self.prompts.append(prompt)
        return super().generate(prompt, params, request_id, priority, lora_request)


def test_cache_salt_reaches_the_engine_prompt(chat_checkpoint):
    """vLLM's Responses request takes ``cache_salt`` (as its chat request does); it was
    dropped as an unknown field. A bad salt is chat's 400 naming ``cache_salt``."""
    engine = SaltRecordingEngine(chat_checkpoint)
    with _client(chat_checkpoint, engine=engine) as client:
        _create(client, cache_salt="tenant-a")
        _create(client)
        assert [p.get("cache_salt") for p in engine.prompts] == ["tenant-a", None]
        for salt in ("", "a/b", "x" * 129, 5):
            assert _error(client, cache_salt=salt)["param"] == "cache_salt"


def test_bodies_validate_as_the_openai_sdks_types(chat_checkpoint):
    """Every body validates (pydantic, not the SDK's lenient construct) as the openai
    SDK's types: the response (created, retrieved, in each stream event), its input
    items. OpenAI's ``usage.input_tokens_details`` has a required ``cache_write_tokens``,
    which was missing; it is 0 (no cache write is billed for automatic prefix caching)."""
    from openai.types.responses import Response, ResponseItemList, ResponseStreamEvent
    from pydantic import TypeAdapter

    events = TypeAdapter(ResponseStreamEvent)
    engine = LogprobEngine(chat_checkpoint, "<think>ab</think>Hi")
    include = ["message.output_text.logprobs"]
    with _client(chat_checkpoint, engine=engine, reasoning_parser="qwen3") as client:
        first = _create(client, include=include, top_logprobs=1, instructions="Be brief.")
        Response.model_validate(first)
        stream = client.post(
            "/v1/responses",
            json={"model": "tiny", "input": "Two", "stream": True, "previous_response_id": first["id"]},
        ).text  # fmt: skip
        streamed = [json.loads(line[6:]) for line in stream.splitlines() if line[:6] == "data: "]
        for event in streamed:
            events.validate_python(event)
        second = streamed[-1]["response"]
        for body in (second, client.get(f"/v1/responses/{second['id']}").json()):
            assert Response.model_validate(body).usage.input_tokens_details.cache_write_tokens == 0
        items = client.get(f"/v1/responses/{second['id']}/input_items?order=asc").json()
        data = ResponseItemList.model_validate(items).data
        assert [item.type for item in data] == ["message", "reasoning", "message", "message"]
