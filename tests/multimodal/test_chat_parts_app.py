"""Chat image parts over HTTP on a vision model (in process over ``FakeEngine`` on the tiny
LLaVA): ``/tokenize`` answers the ids a chat request with the same messages sends (each
image's placeholder expanded by the processor), parts without ``"type"`` are read as vLLM
reads them, and every bad image part is a 400 naming its place while the next request
is served."""

from __future__ import annotations

import base64
import io

import pytest
from starlette.testclient import TestClient
from tiny_llava import IMAGE_TOKENS, random_image

from pagedlm.entrypoints.openai.app import build_app
from server.fake_engine import FakeEngine, fake_context

QUESTION = {"type": "text", "text": "describe the picture."}


def _data_url(image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


URL = _data_url(random_image(20, 20, 1))
IMAGE = {"type": "image_url", "image_url": {"url": URL}}


@pytest.fixture(scope="module")
def engine(tiny_llava):
    return FakeEngine(tiny_llava[0])


@pytest.fixture(scope="module")
def client(engine):
    with TestClient(build_app(fake_context(engine))) as client:
        yield client


def _messages(*content) -> list[dict]:
    return [{"role": "user", "content": list(content)}]


def _tokenize(client, messages, **fields) -> tuple[int, dict]:
    response = client.post("/tokenize", json={"model": "tiny", "messages": messages, **fields})
    return response.status_code, response.json()


def _prompt_tokens(client, messages, **fields) -> list[int]:
    body = {"model": "tiny", "messages": messages, "max_tokens": 1, "return_token_ids": True}
    response = client.post("/v1/chat/completions", json={**body, **fields})
    assert response.status_code == 200, response.text
    answer = response.json()
    assert answer["usage"]["prompt_tokens"] == len(answer["prompt_token_ids"])
    return answer["prompt_token_ids"]


def test_tokenize_expands_images_as_the_chat_prompt_does(client, engine):
    """/tokenize on a vision model answered that the model is text-only; it now gives the
    chat request's prompt ids, each image its run of placeholder tokens."""
    image_id = engine.tokenizer.convert_tokens_to_ids("<image>")
    two = _messages(IMAGE, QUESTION, {"type": "image_url", "image_url": {"url": URL}})
    for messages in (_messages(IMAGE, QUESTION), two):
        status, body = _tokenize(client, messages)
        assert status == 200, body
        assert body["tokens"] == _prompt_tokens(client, messages)
        assert body["count"] == len(body["tokens"])
        num_images = sum(part.get("type") == "image_url" for part in messages[0]["content"])
        assert body["tokens"].count(image_id) == IMAGE_TOKENS * num_images


def test_tokenize_takes_the_chat_fields_of_an_image_request(client):
    messages = [*_messages(IMAGE, QUESTION), {"role": "assistant", "content": "a cat"}]
    fields = {"add_generation_prompt": False, "continue_final_message": True}
    status, body = _tokenize(client, messages, **fields)
    assert status == 200 and body["tokens"] == _prompt_tokens(client, messages, **fields)
    status, body = _tokenize(client, _messages(IMAGE), mm_processor_kwargs={"nonsense": 1})
    assert status == 400 and body["error"]["param"] == "mm_processor_kwargs"
    status, body = _tokenize(client, _messages(IMAGE), chat_template="{{ messages }}")
    assert status == 400 and body["error"]["param"] == "chat_template"


@pytest.mark.parametrize(
    "part",
    [
        {"image_url": URL},
        {"image_url": {"url": URL}},
        {"image_url": {"url": URL}, "video_url": URL, "text": "ignored, as in vLLM"},
        {"type": "input_image", "image_url": URL},
    ],
)
def test_image_parts_without_a_type(client, part):
    """vLLM's part without "type" is read by its key: {"image_url": ...} is an image (it
    was a 400 "type: Field required")."""
    expected = _prompt_tokens(client, _messages(IMAGE, QUESTION))
    for route_tokens in (
        _tokenize(client, _messages(part, QUESTION))[1].get("tokens"),
        _prompt_tokens(client, _messages(part, QUESTION)),
    ):
        assert route_tokens == expected


@pytest.mark.parametrize(
    ("part", "fix"),
    [
        ({"text": "hi"}, '{"type": "text", "text": ...}'),
        ({"type": "input_text", "text": None}, '"text" to be a string'),  # vLLM skips none
        ({"type": "refusal", "refusal": 3}, '"refusal" to be a string'),
        ({"video_url": URL}, "send the image as"),
        ({"image_embeds": "abc"}, "send the image as"),
        ({"image_pil": URL}, "send the image as"),
        ({"type": "image_url", "image_url": None}, '"image_url": {"url": str}'),
        ({"type": "image_url", "image_url": {"url": [URL]}}, '"image_url": {"url": str}'),
        ({"type": "image_url", "image_url": {"url": ""}}, "use a data: URL"),
        ({"type": "image_url", "image_url": {"url": "data:image/png;base64,"}}, "base64"),
        ({"type": "image_url", "image_url": {"url": "data:image/png;base64,!!"}}, "base64"),
        ({"type": "image_url", "image_url": {"url": "data:image/png;base64,R0lG"}}, "PNG"),
        ({"type": "image_url", "image_url": {"url": "file:///etc/hostname"}}, "media-path"),
        ({"type": "image_url", "image_url": {"url": "http://[::1"}}, "send a well-formed URL"),
        ({"type": "image_url", "image_url": {"url": "http://[::1]:x/"}}, "a well-formed URL"),
        ({"type": "tool_reference"}, '"name" to be a string'),
        ({"type": "x" * 100_000}, "unknown content part type 'xxx"),
    ],
)
def test_a_bad_part_beside_an_image_is_a_400_naming_it(client, part, fix):
    messages = _messages(IMAGE, part)
    for route in ("/tokenize", "/v1/chat/completions"):
        body = {"model": "tiny", "messages": messages, "max_tokens": 1}
        response = client.post(route, json=body)
        assert response.status_code == 400, response.text
        message = response.json()["error"]["message"]
        assert message.startswith("messages.0.content.1: ") and fix in message, message
        assert len(message) < 1000  # a client's long string is not echoed whole
    assert _tokenize(client, _messages(IMAGE, QUESTION))[0] == 200


def test_null_text_parts_are_skipped_and_tool_references_kept_beside_an_image(client):
    """vLLM skips a "text" or "refusal" part whose text is null and hands a tool_reference
    part to the template; both were a 400 beside an image (the tool reference as an
    unknown part). The processor's template here prints text parts only."""
    expected = _prompt_tokens(client, _messages(IMAGE, QUESTION))
    skipped = [{"type": "text", "text": None}, {"type": "refusal"}, QUESTION]
    reference = [{"type": "tool_reference", "name": "get_weather"}, QUESTION]
    for parts in (skipped, reference):
        assert _prompt_tokens(client, _messages(IMAGE, *parts)) == expected
        status, body = _tokenize(client, _messages(IMAGE, *parts))
        assert status == 200 and body["tokens"] == expected


def test_more_images_than_the_limit_are_refused_before_loading(client):
    status, body = _tokenize(client, _messages(*[IMAGE] * 1000))
    assert status == 400 and "--limit-mm-per-prompt" in body["error"]["message"]


@pytest.mark.parametrize(
    ("content", "place"),
    [
        ([IMAGE, QUESTION, IMAGE], "messages.1.content.2"),
        ([IMAGE], "messages.1.content.0"),
        ([{"image_url": URL}, "a", {"image_url": URL}, IMAGE], "messages.1.content.2"),
    ],
)
def test_continuing_a_message_that_ends_with_an_image_names_the_image(client, content, place):
    """continue_final_message cuts the rendered prompt after the last message's last text
    part, so an image after it was lost, and the request refused as "the prompt has 1
    image placeholder(s) but 2 image(s) were given; write one placeholder per image" (or
    transformers' "could not find any text to continue"), a fix no chat client can do."""
    messages = [*_messages(QUESTION), {"role": "assistant", "content": content}]
    fields = {"add_generation_prompt": False, "continue_final_message": True}
    for route in ("/tokenize", "/v1/chat/completions"):
        body = {"model": "tiny", "messages": messages, "max_tokens": 1, **fields}
        response = client.post(route, json=body)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == place
        assert error["message"].startswith(f"{place}: continue_final_message")
        assert "end the message with a text part" in error["message"]
    ends_with_text = [*messages[:-1], {"role": "assistant", "content": [IMAGE, QUESTION]}]
    status, body = _tokenize(client, ends_with_text, **fields)
    assert status == 200 and body["tokens"] == _prompt_tokens(client, ends_with_text, **fields)


def test_continuing_a_last_message_without_text_is_a_400_naming_the_fix(client):
    """An empty last message (after a message with an image) got transformers' "could not
    find any text to continue", naming no fix."""
    fields = {"add_generation_prompt": False, "continue_final_message": True}
    for content in ([], [{"type": "text", "text": None}]):
        messages = [*_messages(IMAGE, QUESTION), {"role": "assistant", "content": content}]
        status, body = _tokenize(client, messages, **fields)
        assert status == 400 and body["error"]["param"] == "messages.1.content"
        assert "end it with a text part" in body["error"]["message"]
