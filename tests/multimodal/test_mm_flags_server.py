"""``--mm-processor-kwargs`` and ``--allowed-media-domains`` behind a real ``pagedlm serve``
(tiny Qwen2.5-VL), with the real openai client: the flag bounds an image's tokens, a chat
request's ``mm_processor_kwargs`` override it, an unknown key is a 400 naming it, and an
image URL (or its redirect) on a host outside the list is a 400 naming the flag, the
server healthy throughout. A server boot: slow, ``-m slow`` runs it."""

from __future__ import annotations

import httpx
import openai
import pytest
from test_media_domains import media_server
from test_multimodal_server import _data_url, _png

from multimodal.tiny_common import random_image
from multimodal.tiny_qwen2_5_vl import save_tiny_qwen2_5_vl
from server.server_utils import start_server

pytestmark = pytest.mark.slow

PATCHES = 28 * 28  # pixels per merged token
PICTURE = random_image(200, 150, 0)  # 20 merged tokens by default


@pytest.fixture(scope="module")
def media_port():
    with media_server() as port:
        yield port


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_qwen2_5_vl_flags")
    save_tiny_qwen2_5_vl(path)
    log = tmp_path_factory.mktemp("logs") / "server.log"
    server = start_server(
        path, log, "--dtype", "float32", "--max-model-len", "256",
        "--mm-processor-kwargs", f'{{"max_pixels": {4 * PATCHES}}}',
        "--allowed-media-domains", "127.0.0.1",
    )  # fmt: skip
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def _chat(client, url: str, **extra_body):
    return client.chat.completions.create(
        model="tiny",
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": url}},
                    {"type": "text", "text": "describe the picture."},
                ],
            }
        ],
        max_tokens=2,
        temperature=0,
        extra_body=extra_body,
    )


def test_flag_and_request_kwargs_set_the_image_tokens(client):
    url = _data_url(_png(PICTURE))
    bounded = _chat(client, url).usage.prompt_tokens  # the flag: 2 image tokens
    wider = _chat(client, url, mm_processor_kwargs={"max_pixels": 12 * PATCHES})
    assert wider.usage.prompt_tokens - bounded == 12 - 2


def test_unknown_request_key_is_400(client, server):
    for messages_have_image in (True, False):
        with pytest.raises(openai.BadRequestError) as error:
            if messages_have_image:
                _chat(client, _data_url(_png(PICTURE)), mm_processor_kwargs={"max_pixel": 1})
            else:
                client.chat.completions.create(
                    model="tiny",
                    messages=[{"role": "user", "content": "hi"}],
                    max_tokens=2,
                    extra_body={"mm_processor_kwargs": {"max_pixel": 1}},
                )
        assert "mm_processor_kwargs has 'max_pixel'" in str(error.value)
        assert error.value.body["param"] == "mm_processor_kwargs"
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_media_domains(client, server, media_port):
    ok = _chat(client, f"http://127.0.0.1:{media_port}/to/127.0.0.1")
    assert ok.usage.completion_tokens == 2
    for path in ("localhost:{port}/cat.png", "127.0.0.1:{port}/to/localhost"):
        with pytest.raises(openai.BadRequestError, match="--allowed-media-domains"):
            _chat(client, "http://" + path.format(port=media_port))
    assert httpx.get(f"{server.url}/health").status_code == 200
