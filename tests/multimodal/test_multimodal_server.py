"""Images through a real ``pagedlm serve`` (tiny LLaVA), with the real openai/anthropic
clients: answers equal transformers', and every bad image is a 400 naming the problem
while the server stays healthy and other requests are unharmed."""

from __future__ import annotations

import base64
import contextlib
import io
import struct
import threading
import time
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import anthropic
import httpx
import openai
import pytest
from tiny_llava import IMAGE_TOKENS, hf_greedy, hf_processor, random_image

from server.server_utils import start_server, wait_healthy

NEW_TOKENS = 5
QUESTION = "describe the picture."
IMAGES = {
    "two-a": random_image(40, 50, 1),
    "two-b": random_image(64, 32, 2),
    "http": random_image(30, 30, 9),
    "file": random_image(40, 30, 8),
    "anthropic": random_image(48, 36, 3),
}
"""Every image a test expects transformers' answer for (references computed once)."""


def _png(image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def _data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def _bomb_png(width: int = 50_000, height: int = 50_000) -> bytes:
    """A valid PNG header claiming 2.5 G pixels (no pixel data needed to be refused)."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        crc = zlib.crc32(kind + body) & 0xFFFFFFFF
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", crc)

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(b""))
        + chunk(b"IEND", b"")
    )


class _MediaHandler(BaseHTTPRequestHandler):
    png = b""

    def do_GET(self):
        if self.path == "/slow.png":
            time.sleep(5)  # longer than the server's --media-fetch-timeout-s
        body = b"\0" * 300_000 if self.path == "/big.png" else self.png
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        # The server under test may hang up (timeout, size cap).
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            if self.path == "/drip.png":  # each read is quick, the whole takes 4.8 s
                for start in range(0, len(body), len(body) // 8 + 1):
                    self.wfile.write(body[start : start + len(body) // 8 + 1])
                    self.wfile.flush()
                    time.sleep(0.6)
            else:
                self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def media_server():
    _MediaHandler.png = _png(IMAGES["http"])
    server = ThreadingHTTPServer(("127.0.0.1", 0), _MediaHandler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("media")
    (path / "cat.png").write_bytes(_png(IMAGES["file"]))
    return path


def _expected_text(tiny_llava, images) -> str:
    path, model = tiny_llava
    prompt = "USER: " + "<image>\n" * len(images) + QUESTION + " ASSISTANT:"
    ids = hf_greedy(model, path, prompt, images, NEW_TOKENS)
    return hf_processor(path).tokenizer.decode(ids, skip_special_tokens=True)


@pytest.fixture(scope="module")
def booted(tiny_llava, media_dir, tmp_path_factory):
    """(one server for the module, transformers' answer per image set): the answers are
    computed while the server boots, which is most of this module's time."""
    log = tmp_path_factory.mktemp("logs") / "server.log"
    server = start_server(
        tiny_llava[0], log,
        "--dtype", "float32", "--max-model-len", "256", "--limit-mm-per-prompt",
        '{"image": 2}', "--allowed-local-media-path", str(media_dir),
        "--media-fetch-timeout-s", "2", "--media-max-bytes", "200000", wait=False,
    )  # fmt: skip
    try:
        expected = {
            "two": _expected_text(tiny_llava, [IMAGES["two-a"], IMAGES["two-b"]]),
            **{
                name: _expected_text(tiny_llava, [IMAGES[name]])
                for name in ("two-a", "http", "file", "anthropic")
            },
        }
        wait_healthy(server)
        yield server, expected
    finally:
        server.stop()


@pytest.fixture(scope="module")
def server(booted):
    return booted[0]


@pytest.fixture(scope="module")
def expected(booted):
    return booted[1]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def _chat(client, *image_urls: str, text: str = QUESTION):
    parts = [{"type": "image_url", "image_url": {"url": url}} for url in image_urls]
    return client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": [*parts, {"type": "text", "text": text}]}],
        max_tokens=NEW_TOKENS,
        temperature=0,
        extra_body={"ignore_eos": True},
    )


def test_openai_data_urls_match_transformers(client, expected):
    reply = _chat(client, _data_url(_png(IMAGES["two-a"])), _data_url(_png(IMAGES["two-b"])))
    assert reply.choices[0].message.content == expected["two"]
    assert reply.usage.completion_tokens == NEW_TOKENS


def test_http_and_allowed_file_urls(client, expected, media_server, media_dir):
    reply = _chat(client, f"{media_server}/ok.png")
    assert reply.choices[0].message.content == expected["http"]
    reply = _chat(client, f"file://{media_dir / 'cat.png'}")
    assert reply.choices[0].message.content == expected["file"]


def test_anthropic_base64_image_block(server, expected):
    image = IMAGES["anthropic"]
    client = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
    source = {"type": "base64", "media_type": "image/png", "data": _data_url(_png(image))[22:]}
    reply = client.messages.create(
        model="tiny",
        max_tokens=NEW_TOKENS,
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "image", "source": source},
                    {"type": "text", "text": QUESTION},
                ],
            }
        ],
        extra_body={"ignore_eos": True, "temperature": 0},
    )
    assert reply.content[0].text == expected["anthropic"]
    count = httpx.post(
        f"{server.url}/v1/messages/count_tokens",
        json={
            "model": "tiny",
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "image", "source": source},
                        {"type": "text", "text": "hi"},
                    ],
                }
            ],
        },
    )
    assert count.status_code == 200
    assert count.json()["input_tokens"] > IMAGE_TOKENS  # the placeholder expanded


@pytest.mark.parametrize(
    ("url", "message"),
    [
        (_data_url(b"this is not an image"), "could not be decoded"),
        (_data_url(_bomb_png()), "too large to decode"),
        ("file:///etc/hostname", "outside the allowed directory"),
        ("ftp://example.com/cat.png", "unsupported image URL"),
        ("{media}/slow.png", "timed out"),
        ("{media}/drip.png", "timed out"),
        ("{media}/big.png", "larger than the limit"),
    ],
    ids=[
        "undecodable",
        "decompression-bomb",
        "outside-dir",
        "scheme",
        "timeout",
        "slow-drip",
        "too-large",
    ],
)
def test_bad_images_are_400(client, server, media_server, url, message):
    with pytest.raises(openai.BadRequestError) as error:
        _chat(client, url.format(media=media_server))
    assert message in str(error.value)
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_more_images_than_the_limit_is_400(client, server):
    url = _data_url(_png(random_image(20, 20, 4)))
    with pytest.raises(openai.BadRequestError, match="at most 2 are allowed"):
        _chat(client, url, url, url)


def test_a_bad_request_leaves_others_unharmed(client, expected):
    image = IMAGES["two-a"]
    good = [_chat(client, _data_url(_png(image))) for _ in range(2)]
    with pytest.raises(openai.BadRequestError):
        _chat(client, _data_url(b"garbage"))
    assert {r.choices[0].message.content for r in good} == {expected["two-a"]}
    # A text-only chat to the same server.
    reply = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3
    )
    assert reply.choices[0].message.content is not None


@pytest.mark.parametrize(
    ("second_part", "message"),
    [
        ({"type": "image_url", "image_url": {"url": "data:image/png;base64,@@"}}, "not valid base64"),
        ({"type": "text", "text": 3}, '"text" to be a string, got int'),
        ({"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}, "not supported"),
    ],
    ids=["bad-second-image", "text-not-a-string", "audio-beside-an-image"],
)  # fmt: skip
def test_a_bad_part_beside_an_image_is_400_naming_it(server, second_part, message):
    # Before: the param was "messages" (which image?), and a non-string text part or an
    # audio part beside an image was answered 200, the template dropping or printing it.
    image = {"type": "image_url", "image_url": {"url": _data_url(_png(IMAGES["two-a"]))}}
    response = httpx.post(
        f"{server.url}/v1/chat/completions",
        json={"model": "tiny", "max_tokens": 2, "messages": [
            {"role": "user", "content": [image, second_part]},
        ]},
    )  # fmt: skip
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "messages.0.content.1"
    assert error["message"].startswith("messages.0.content.1: ") and message in error["message"]


def test_input_image_part_is_an_image(client, expected):
    # vLLM takes the Responses API's input_image part in chat; it was an unknown part.
    url = _data_url(_png(IMAGES["two-a"]))
    reply = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": [
            {"type": "input_image", "image_url": url}, {"type": "text", "text": QUESTION},
        ]}],
        max_tokens=NEW_TOKENS, temperature=0, extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert reply.choices[0].message.content == expected["two-a"]


def test_anthropic_bad_image_is_named_by_its_request_place(server):
    # The system prompt is the conversation's first message: not counted in the place.
    source = {"type": "base64", "media_type": "image/png", "data": "@@"}
    response = httpx.post(
        f"{server.url}/v1/messages",
        json={"model": "tiny", "max_tokens": 2, "system": "be brief", "messages": [
            {"role": "user", "content": [{"type": "image", "source": source}]},
        ]},
    )  # fmt: skip
    assert response.status_code == 400
    assert response.json()["error"]["message"].startswith("messages.0.content.0: ")


def test_responses_input_image_is_an_image(client):
    """/v1/responses' input_image parts reach the model (they were refused as "a
    text-only model" on a vision model), and input_items lists them."""
    url = _data_url(_png(IMAGES["two-a"]))
    content = [{"type": "input_image", "image_url": url}, {"type": "input_text", "text": QUESTION}]
    reply = client.responses.create(
        model="tiny",
        input=[{"role": "user", "content": content}],
        max_output_tokens=NEW_TOKENS,
        temperature=0,
    )
    chat = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": QUESTION},
        ]}],
        max_tokens=NEW_TOKENS, temperature=0,
    )  # fmt: skip
    assert reply.output_text == chat.choices[0].message.content
    listed = client.responses.input_items.list(reply.id).data[0]
    assert [part.type for part in listed.content] == ["input_image", "input_text"]
