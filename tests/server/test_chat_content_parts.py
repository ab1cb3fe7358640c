"""Chat content parts over HTTP, read as vLLM reads them (in process over ``FakeEngine``
on a text-only model): a part without ``"type"`` takes the type its key implies, strings
and vLLM's text kinds are text, and every malformed part, on ``/v1/chat/completions`` and
``/tokenize`` alike, is a 400 naming its place and the fix that leaves the server serving
the next request."""

from __future__ import annotations

import pytest
from fake_engine import FakeEngine, fake_context
from starlette.testclient import TestClient

from pagedlm.chat_content import ContentPartError, implied_type, part_type
from pagedlm.entrypoints.openai.app import build_app

URL = "data:image/png;base64,iVBORw0KGgo="
TEXT_TEMPLATE = (
    "{% for m in messages %}{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for p in m['content'] %}[{{ p['type'] }}:{{ p['text'] }}{{ p['name'] }}]"
    "{% endfor %}"
    "{% endif %};{% endfor %}"
)


@pytest.fixture(scope="module")
def client(chat_checkpoint):
    engine = FakeEngine(chat_checkpoint)
    with TestClient(build_app(fake_context(engine, chat_template=TEXT_TEMPLATE))) as client:
        client.decode = engine.tokenizer.decode
        yield client


def _tokenize(client, content) -> tuple[int, dict]:
    body = {"messages": [{"role": "user", "content": content}], "add_generation_prompt": False}
    response = client.post("/tokenize", json=body)
    return response.status_code, response.json()


def _chat(client, content) -> tuple[int, dict]:
    body = {"model": "tiny", "max_tokens": 1, "messages": [{"role": "user", "content": content}]}
    response = client.post("/v1/chat/completions", json=body)
    return response.status_code, response.json()


@pytest.mark.parametrize(
    ("part", "kind"),
    [
        ({"image_url": URL}, "image_url"),
        ({"image_url": {"url": URL}}, "image_url"),
        ({"video_url": URL, "image_url": URL}, "image_url"),  # vLLM's order of the keys
        (
            {"input_audio": None, "audio_url": URL},
            "audio_url",
        ),  # a null input_audio implies nothing
        ({"input_audio": {"data": ""}}, "input_audio"),
        ({"tool_reference": "f"}, "tool_reference"),
        ({"type": "text", "image_url": URL}, "text"),  # "type" wins
        ({"type": None, "image_url": URL}, "image_url"),  # a null "type" is no type
        ({"text": "hi"}, None),  # text implies no type, as in vLLM
        ({}, None),
        ({"type": 3}, None),
    ],
)
def test_the_type_a_part_implies(part, kind):
    assert implied_type(part) == kind
    if kind is None:
        with pytest.raises(ContentPartError, match='add its "type"') as error:
            part_type(part, "messages.0.content.1")
        assert error.value.where == "messages.0.content.1"


def test_strings_and_vllms_text_kinds_are_text_parts(client):
    """vLLM's plain string parts and its input_text, output_text, refusal and thinking
    parts; each was a 400 (a string part "should be a valid dictionary", the others an
    "unknown content part type")."""
    content = [
        "a",
        {"type": "input_text", "text": "b"},
        {"type": "output_text", "text": "c"},
        {"type": "refusal", "refusal": "d"},
        {"type": "thinking", "thinking": "e"},
        {"type": "text", "text": "f", "uuid": "kept aside"},
    ]
    status, body = _tokenize(client, content)
    assert status == 200, body
    assert client.decode(body["tokens"]) == "[text:a][text:b][text:c][text:d][text:e][text:f];"
    assert _chat(client, content)[0] == 200


@pytest.mark.parametrize(
    ("content", "place", "fix"),
    [
        # A part without "type" whose keys imply none: vLLM's "Missing 'type' field".
        ([{"text": "hi"}], "messages.0.content.0", '{"type": "text", "text": ...}'),
        (["ok", {"foo": 1}], "messages.0.content.1", "none of its keys ('foo')"),
        ([{}], "messages.0.content.0", 'add its "type"'),
        ([{"type": None, "text": "x"}], "messages.0.content.0", 'add its "type"'),
        # A part without "type" that names an image is an image part: this model is text-only.
        ([{"image_url": URL}], "messages.0.content.0", "text-only model"),
        ([{"image_url": {"url": URL}}], "messages.0.content.0", "text-only model"),
        ([{"type": "image_url", "image_url": {"url": URL}}], "messages.0.content.0", "text-only"),
        ([{"video_url": URL}], "messages.0.content.0", "text-only model"),
        # Wrong types for the type, the text, a part, the content.
        ([{"type": 3, "text": "x"}], "messages.0.content.0", '"type" must be a string'),
        ([{"type": ["text"], "text": "x"}], "messages.0.content.0", '"type" must be a string'),
        ([{"type": "input_text", "text": None}], "messages.0.content.0", '"text" to be'),
        ([{"type": "text", "text": ["a"]}], "messages.0.content.0", '"text" to be a string'),
        ([{"type": "input_text", "text": 3}], "messages.0.content.0", '"text" to be a string'),
        ([{"type": "refusal", "refusal": 3}], "messages.0.content.0", '"refusal" to be a'),
        ([{"type": "tool_reference"}], "messages.0.content.0", '"name" to be a string'),
        (["a", {"tool_reference": {}}], "messages.0.content.1", '"name" to be a string'),
        ([{"type": ""}], "messages.0.content.0", '{"type": "text", "text": ...}'),
        ([{"type": "x" * 10_000}], "messages.0.content.0", '{"type": "text", "text": ...}'),
        (["a", None], "messages.0.content.1", "a content part is a string or an object"),
        ([[{"type": "text", "text": "x"}]], "messages.0.content.0", "got list"),
        ([1.5], "messages.0.content.0", "got float"),
        ([True], "messages.0.content.0", "got bool"),
        ({"type": "text", "text": "x"}, "messages.0.content", "wrap the part in a list"),
        (5, "messages.0.content", "a list of content parts"),
    ],
)
def test_a_bad_part_is_a_400_naming_its_place_and_the_fix(client, content, place, fix):
    for status, body in (_tokenize(client, content), _chat(client, content)):
        assert status == 400, body
        message = body["error"]["message"]
        assert message.startswith(f"{place}: ") and fix in message, message
        assert body["error"]["param"] == place
    assert _chat(client, "still serving")[0] == 200


def test_null_text_parts_are_skipped_and_tool_references_reach_the_template(client):
    """As in vLLM: a "text" or "refusal" part whose text is null (or missing) is skipped,
    and a tool_reference part reaches the template as {"type": "tool_reference", "name":
    ...}; they were 400s ('"text" to be a string', "unknown content part type")."""
    content = [
        {"type": "text", "text": None},
        "a",
        {"type": "refusal", "refusal": None},
        {"type": "text"},
        {"type": "tool_reference", "name": "get_weather"},
        {"tool_reference": "ignored", "name": "search"},  # its type implied, as in vLLM
    ]
    status, body = _tokenize(client, content)
    assert status == 200, body
    expected = "[text:a][tool_reference:get_weather][tool_reference:search];"
    assert client.decode(body["tokens"]) == expected
    assert _chat(client, content)[0] == 200
    status, body = _tokenize(client, [{"type": "text", "text": None}])
    assert status == 200 and client.decode(body["tokens"]) == ";"


@pytest.mark.parametrize(
    "content",
    [[], [{"type": "text", "text": None}], None, [{"type": "tool_reference", "name": "f"}]],
)
def test_continuing_a_last_message_without_text_is_a_400_naming_the_fix(client, content):
    """It was transformers' "continue_final_message is set but we could not find any text
    to continue in the final message!", which names no fix (vLLM answers the same)."""
    body = {
        "model": "tiny",
        "max_tokens": 1,
        "add_generation_prompt": False,
        "continue_final_message": True,
        "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": content}],
    }
    for route in ("/tokenize", "/v1/chat/completions"):
        response = client.post(route, json=body)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == "messages.1.content"
        assert error["message"].startswith("messages.1.content: continue_final_message")
        assert '{"type": "text", "text": "..."}' in error["message"]
        assert "drop continue_final_message" in error["message"]
    continued = {
        **body,
        "messages": [*body["messages"][:1], {"role": "assistant", "content": ["a"]}],
    }
    assert client.post("/tokenize", json=continued).status_code == 200


def test_many_parts_are_read_in_one_pass(client):
    """10,000 parts in one message: answered (a count, or a 400 for the one bad part at
    the end) without a 5xx."""
    parts = ["a"] * 10_000
    status, body = _tokenize(client, parts)
    assert status == 200 and body["count"] > 10_000
    status, body = _tokenize(client, [*parts, {"text": "late"}])
    assert status == 400 and body["error"]["param"] == "messages.0.content.10000"


def test_echo_joins_the_text_of_every_text_part(client):
    """``echo`` repeats the last message's text parts, string parts and vLLM's text kinds
    among them (they were a 400; reading them as text part objects would have been a
    500)."""
    body = {
        "model": "tiny",
        "max_tokens": 1,
        "echo": True,
        "add_generation_prompt": False,
        "continue_final_message": True,
        "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": ["a", {"type": "input_text", "text": "b"}]},
        ],
    }
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"].startswith("a\nb")
