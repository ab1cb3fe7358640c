"""``/v1/responses`` through the unmodified ``openai`` SDK, in process over ``FakeEngine``
(random tokens, so text is checked for agreement between views, prompts by their exact
token counts). Tools and text formats, which need a real grammar, are in
``test_responses_tools.py``."""

from __future__ import annotations

import sys

import openai
import pytest
from responses_app import in_process_app, sdk_client

from pagedlm.entrypoints.openai.responses_store import ResponseStore, StoredResponse

NUM_TOKENS = 3
TEXT_EVENTS = [
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.content_part.added",
    "response.output_text.delta",
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
]


@pytest.fixture(scope="module")
def http(chat_checkpoint):
    with in_process_app(chat_checkpoint, num_tokens=NUM_TOKENS) as http:
        yield http


@pytest.fixture(scope="module")
def client(http):
    return sdk_client(http)


@pytest.fixture(scope="module")
def prompt_len(http):
    app = http.app
    while not hasattr(app, "state"):  # through the middleware, down to FastAPI
        app = app.app
    tokenizer = app.state.ctx.tokenizer

    def count(messages: list[dict]) -> int:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return len(ids if isinstance(ids, list) else ids["input_ids"])

    return count


def test_plain_text_input_with_instructions(client, prompt_len):
    response = client.responses.create(model="tiny", input="Hello", instructions="Be brief.")
    assert response.id.startswith("resp_") and response.object == "response"
    assert response.status == "completed" and response.model == "tiny"
    (item,) = response.output
    assert item.type == "message" and item.role == "assistant" and item.status == "completed"
    assert response.output_text == item.content[0].text
    expected = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    assert response.usage.input_tokens == prompt_len(expected)
    assert response.usage.output_tokens == NUM_TOKENS
    assert response.usage.total_tokens == prompt_len(expected) + NUM_TOKENS


def test_message_items_with_text_parts(client, prompt_len):
    items = [
        {"role": "developer", "content": "Answer in French."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "Salut"}]},
        {"role": "user", "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]},
    ]  # fmt: skip
    response = client.responses.create(model="tiny", input=items)
    expected = [
        {"role": "developer", "content": "Answer in French."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Salut"},
        {"role": "user", "content": "a\nb"},
    ]
    assert response.usage.input_tokens == prompt_len(expected)


def test_stream_sends_the_events_in_order_with_sequence_numbers(client):
    events = list(client.responses.create(model="tiny", input="Hello", stream=True))
    kinds = [e.type for e in events]
    deltas = kinds.count("response.output_text.delta")
    assert deltas >= 1
    expected = TEXT_EVENTS[:4] + ["response.output_text.delta"] * deltas + TEXT_EVENTS[5:]
    assert kinds == [*expected, "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    final = events[-1].response
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    done = next(e for e in events if e.type == "response.output_text.done")
    assert text == done.text == final.output_text
    assert events[2].item.id == done.item_id == final.output[0].id
    assert final.usage.output_tokens == NUM_TOKENS
    assert client.responses.retrieve(final.id).output_text == text  # stored once completed


def test_previous_response_id_continues_the_conversation(client, prompt_len):
    first = client.responses.create(model="tiny", input="One", instructions="Count.")
    second = client.responses.create(model="tiny", input="Two", previous_response_id=first.id)
    assert second.previous_response_id == first.id
    # the earlier turn and its answer come first; its instructions do not carry over
    expected = [
        {"role": "user", "content": "One"},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "Two"},
    ]
    assert second.usage.input_tokens == prompt_len(expected)
    third = client.responses.create(model="tiny", input="Three", previous_response_id=second.id)
    expected += [
        {"role": "assistant", "content": second.output_text},
        {"role": "user", "content": "Three"},
    ]
    assert third.usage.input_tokens == prompt_len(expected)


def test_retrieve_and_delete(client):
    created = client.responses.create(model="tiny", input="Hello")
    fetched = client.responses.retrieve(created.id)
    assert fetched.model_dump() == created.model_dump()
    client.responses.delete(created.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(created.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(created.id)
    with pytest.raises(openai.NotFoundError, match="No stored response"):
        client.responses.create(model="tiny", input="x", previous_response_id=created.id)


def test_stored_responses_belong_to_their_api_key(http, client):
    other = sdk_client(http, api_key="key-b")
    created = client.responses.create(model="tiny", input="secret")
    for call in (
        lambda: other.responses.retrieve(created.id),
        lambda: other.responses.delete(created.id),
        lambda: other.responses.create(model="tiny", input="x", previous_response_id=created.id),
    ):
        with pytest.raises(openai.NotFoundError):
            call()
    assert client.responses.retrieve(created.id).id == created.id  # untouched by key-b


def test_cancel_refuses_a_synchronous_response(http, client):
    """``POST /v1/responses/{id}/cancel`` was a 404 for every id (no route). Only a
    background response can be cancelled, and this server runs none: a stored response
    is a 400 saying so, as vLLM answers for one that is not a background one; an unknown
    id, or another API key's response, is a 404 in the error shape."""
    created = client.responses.create(model="tiny", input="Hello")
    with pytest.raises(openai.BadRequestError, match="Cannot cancel a synchronous response"):
        client.responses.cancel(created.id)
    other = sdk_client(http, api_key="key-b")
    for caller, response_id in ((client, "resp_unknown"), (other, created.id)):
        with pytest.raises(openai.NotFoundError, match="No stored response"):
            caller.responses.cancel(response_id)
    reply = http.post("/v1/responses/resp_unknown/cancel")
    assert reply.status_code == 404
    assert set(reply.json()["error"]) == {"message", "type", "param", "code"}
    assert client.responses.retrieve(created.id).status == "completed"  # left as it was


def test_input_items_lists_the_request_input(http, client):
    """``GET /v1/responses/{id}/input_items`` was a 404 (no route): it lists the
    response's input items in OpenAI's list object, each with an id (the client's, else
    a new one), messages with their role and content parts; ``limit``, ``order`` (desc by
    default) and ``after`` page through them."""
    items = [
        {"role": "developer", "content": "Be brief."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
        {"role": "assistant", "content": "Hello", "id": "msg_mine"},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "7"},
    ]
    created = client.responses.create(model="tiny", input=items)
    listed = client.responses.input_items.list(created.id, order="asc")
    assert listed.object == "list" and not listed.has_more
    data = [item.model_dump(exclude_none=True) for item in listed.data]
    assert len({item["id"] for item in data}) == 5 and data[2]["id"] == "msg_mine"
    assert [(item["type"], item.get("role")) for item in data] == [
        ("message", "developer"), ("message", "user"), ("message", "assistant"),
        ("function_call", None), ("function_call_output", None),
    ]  # fmt: skip
    assert data[0]["content"] == [{"type": "input_text", "text": "Be brief."}]
    assert data[1]["content"] == [{"type": "input_text", "text": "Hi"}]
    assert data[2]["content"] == [{"type": "output_text", "text": "Hello", "annotations": []}]
    assert (data[3]["call_id"], data[3]["name"], data[3]["arguments"]) == ("c1", "f", "{}")
    assert (data[4]["call_id"], data[4]["output"]) == ("c1", "7")
    assert listed.first_id == data[0]["id"] and listed.last_id == data[-1]["id"]

    ids = [item["id"] for item in data]
    url, key = f"/v1/responses/{created.id}/input_items", {"Authorization": "Bearer key-a"}
    page = http.get(url, params={"limit": 2}, headers=key).json()
    assert [item["id"] for item in page["data"]] == ids[::-1][:2] and page["has_more"]
    query = {"limit": 2, "after": page["last_id"], "include[]": "message.output_text.logprobs"}
    rest = http.get(url, params=query, headers=key).json()
    assert [item["id"] for item in rest["data"]] == ids[::-1][2:4] and rest["has_more"]
    paged = client.responses.input_items.list(created.id, limit=2, order="asc")
    assert [item.id for item in paged]  # the SDK pages on with after == ids

    text = client.responses.create(model="tiny", input="Hello")
    (only,) = client.responses.input_items.list(text.id).data
    assert only.role == "user" and only.content[0].text == "Hello"
    for params, param in (
        ({"limit": 0}, "limit"),
        ({"order": "up"}, "order"),
        ({"after": "x"}, "after"),
    ):
        reply = http.get(f"/v1/responses/{text.id}/input_items", params=params, headers=key)
        assert reply.status_code == 400 and reply.json()["error"]["param"] == param
    with pytest.raises(openai.NotFoundError):
        client.responses.input_items.list("resp_unknown")
    with pytest.raises(openai.NotFoundError):
        sdk_client(http, api_key="key-b").responses.input_items.list(text.id)


def test_input_items_of_a_follow_up_list_the_conversation_it_continues(client):
    """A response made with ``previous_response_id`` is read by its model after the earlier
    turns, and OpenAI lists those as its input items: each earlier response's input items
    and output items (the same ids), then its own input. Only its own input was listed."""
    first = client.responses.create(model="tiny", input="One", instructions="Count.")
    second = client.responses.create(model="tiny", input="Two", previous_response_id=first.id)
    third = client.responses.create(model="tiny", input="Three", previous_response_id=second.id)
    listed = client.responses.input_items.list(third.id, order="asc").data
    texts = [(item.role, item.content[0].text) for item in listed]
    assert texts == [
        ("user", "One"), ("assistant", first.output_text),
        ("user", "Two"), ("assistant", second.output_text),
        ("user", "Three"),
    ]  # fmt: skip
    assert [listed[1].id, listed[3].id] == [first.output[0].id, second.output[0].id]
    assert [item.id for item in client.responses.input_items.list(third.id)] == [
        item.id for item in reversed(listed)
    ]  # newest first by default
    own = client.responses.input_items.list(first.id).data  # the instructions are no item
    assert [(item.role, item.content[0].text) for item in own] == [("user", "One")]
    client.responses.delete(first.id)  # the follow-ups keep their copies
    assert len(client.responses.input_items.list(second.id).data) == 3


def test_store_false_keeps_nothing(client):
    created = client.responses.create(model="tiny", input="Hello", store=False)
    assert created.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(created.id)


def test_max_output_tokens_cut_is_incomplete(client):
    response = client.responses.create(model="tiny", input="Hello", max_output_tokens=1)
    assert response.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.output[0].status == "incomplete" and response.usage.output_tokens == 1
    events = list(
        client.responses.create(model="tiny", input="Hi", max_output_tokens=1, stream=True)
    )
    assert events[-1].type == "response.incomplete"


def test_an_aborted_response_is_cancelled(chat_checkpoint):
    """A request the engine aborts (``pause_generation(mode="abort")``) did not complete:
    vLLM reports finish reason "abort" as status "cancelled" (no incomplete_details);
    the item it cut is "incomplete", and a stream still ends with response.completed."""
    from fake_engine import AbortingEngine

    engine = AbortingEngine(chat_checkpoint, num_tokens=2)
    with in_process_app(chat_checkpoint, engine=engine) as http:
        client = sdk_client(http)
        response = client.responses.create(model="tiny", input="Hello")
        events = list(client.responses.create(model="tiny", input="Hello", stream=True))
        stored = client.responses.retrieve(response.id)
    assert response.status == "cancelled" and response.incomplete_details is None
    assert response.completed_at is None
    assert response.output[0].status == "incomplete" and response.usage.output_tokens == 2
    assert events[-1].type == "response.completed"
    assert events[-1].response.status == "cancelled"
    assert stored.status == "cancelled"


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"background": True}, "background"),
        ({"tools": [{"type": "web_search"}]}, "tools.0"),
        ({"include": ["file_search_call.results"]}, "include.0"),
        ({"truncation": "auto"}, "truncation"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]}, "input.0.content.0"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "item_reference"),
        ({"input": [{"role": "tool", "content": "x"}]}, "input.0.role"),
        ({"input": []}, "input is empty"),
        ({"text": {"format": {"type": "xml"}}}, "text.format"),
        ({"tool_choice": {"type": "web_search"}}, "tool_choice"),
        ({"model": "other"}, "does not exist"),
    ],
)  # fmt: skip
def test_unserved_fields_are_a_400_naming_them(client, kwargs, needle):
    kwargs = {"model": "tiny", "input": "Hello", **kwargs}
    error = openai.NotFoundError if kwargs["model"] != "tiny" else openai.BadRequestError
    with pytest.raises(error) as caught:
        client.responses.create(**kwargs)
    assert needle in caught.value.message


def test_text_format_without_jsonschema_names_the_extra(client, monkeypatch):
    monkeypatch.setitem(sys.modules, "jsonschema", None)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    spec = {"type": "json_schema", "name": "a", "schema": schema}
    with pytest.raises(openai.APIStatusError) as caught:
        client.responses.create(model="tiny", input="hi", text={"format": spec})
    assert caught.value.status_code == 501 and "pagedlm[server]" in caught.value.message


def test_request_model_is_in_openapi(http):
    schema = http.get("/openapi.json").json()
    body = schema["paths"]["/v1/responses"]["post"]["requestBody"]
    assert body["content"]["application/json"]["schema"]["$ref"].endswith("/ResponsesRequest")
    assert (
        "previous_response_id" in schema["components"]["schemas"]["ResponsesRequest"]["properties"]
    )
    assert {"get", "delete"} <= set(schema["paths"]["/v1/responses/{response_id}"])


def test_store_is_bounded_least_recently_used_first():
    store = ResponseStore(max_entries=2)
    entry = StoredResponse({}, [], [])
    store.put("a", "r1", entry)
    store.put("a", "r2", entry)
    assert store.get("a", "r1") is entry  # r1 now the most recently used
    store.put("b", "r3", entry)
    assert len(store) == 2 and store.get("a", "r2") is None and store.get("a", "r1") is entry
    assert store.get("a", "r3") is None and store.get("b", "r3") is entry
    with pytest.raises(ValueError, match="max_entries"):
        ResponseStore(max_entries=0)


def test_output_builder_regroups_reasoning_text_and_calls_in_order():
    from pagedlm.entrypoints.openai.responses_output import OutputBuilder

    def chunk(delta: dict, finish: str | None = None) -> dict:
        return {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}

    call = {
        "index": 0,
        "id": "call_1",
        "type": "function",
        "function": {"name": "f", "arguments": '{"a"'},
    }
    builder = OutputBuilder()
    events = [
        *builder.feed(chunk({"role": "assistant", "content": ""})),
        *builder.feed(chunk({"reasoning_content": "think"})),
        *builder.feed(chunk({"content": "Hel"})),
        *builder.feed(chunk({"content": "lo"})),
        *builder.feed(chunk({"tool_calls": [call]})),
        *builder.feed(chunk({"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]})),
        *builder.feed(chunk({}, "tool_calls")),
        *builder.feed({"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}}),
        *builder.finish(),
    ]  # fmt: skip
    assert [e["type"].removeprefix("response.") for e in events] == [
        "output_item.added", "content_part.added", "reasoning_text.delta", "reasoning_text.done",
        "content_part.done", "output_item.done",
        "output_item.added", "content_part.added", "output_text.delta", "output_text.delta",
        "output_text.done", "content_part.done", "output_item.done",
        "output_item.added", "function_call_arguments.delta", "function_call_arguments.delta",
        "function_call_arguments.done", "output_item.done",
    ]  # fmt: skip
    reasoning, message, function_call = builder.items
    assert reasoning["content"] == [{"type": "reasoning_text", "text": "think"}]
    assert message["content"][0]["text"] == "Hello" and message["status"] == "completed"
    assert function_call["arguments"] == '{"a": 1}' and function_call["call_id"] == "call_1"
    assert [e["output_index"] for e in events if e["type"].endswith("item.done")] == [0, 1, 2]
    assert builder.usage["total_tokens"] == 3 and builder.finish_reason == "tool_calls"
    assert builder.assistant_message() == {
        "role": "assistant",
        "content": "Hello",
        "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}],
    }  # fmt: skip


def test_request_maps_onto_the_chat_request():
    from pagedlm.entrypoints.openai.protocol_responses import ResponsesRequest

    tool = {"type": "function", "name": "f", "description": "d", "parameters": {"type": "object"}}
    request = ResponsesRequest.model_validate(
        {
            "input": "hi",
            "instructions": "sys",
            "max_output_tokens": 7,
            "tools": [tool],
            "tool_choice": {"type": "function", "name": "f"},
            "parallel_tool_calls": False,
            "text": {"format": {"type": "json_object"}},
        }
    )
    chat = request.chat_request(request.input_messages())
    assert [(m.role, m.content) for m in chat.messages] == [("system", "sys"), ("user", "hi")]
    assert chat.max_completion_tokens == 7 and chat.stream and chat.include_usage
    assert chat.tools == [
        {"type": "function", "function": {"name": "f", "description": "d", "parameters": {"type": "object"}}}
    ]  # fmt: skip
    assert chat.tool_choice == {"type": "function", "function": {"name": "f"}}
    assert chat.parallel_tool_calls is False and chat.response_format == {"type": "json_object"}
    schema = {"type": "json_schema", "name": "n", "schema": {"type": "object"}, "strict": True}
    request = ResponsesRequest.model_validate({"input": "hi", "text": {"format": schema}})
    assert request.chat_request([{"role": "user", "content": "hi"}]).response_format == {
        "type": "json_schema",
        "json_schema": {"name": "n", "schema": {"type": "object"}},
    }
