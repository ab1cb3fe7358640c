"""Qwen2.5-VL behind a real ``pagedlm serve`` (tiny checkpoint): OpenAI ``image_url`` parts
and an Anthropic ``image`` block, two images of different sizes, answered as transformers
answers (the image parts take the same model-agnostic path as LLaVA's). About 25 s on
the 2-core machine (a server boot): slow, ``-m slow`` runs it."""

from __future__ import annotations

import anthropic
import openai
import pytest
from test_multimodal_server import _data_url, _png

from multimodal.tiny_common import hf_greedy, random_image
from multimodal.tiny_qwen2_5_vl import IMAGE, processor, save_tiny_qwen2_5_vl
from server.server_utils import start_server, wait_healthy

NEW_TOKENS = 5
QUESTION = "describe the picture."
IMAGES = [random_image(90, 130, 1), random_image(200, 60, 2)]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def booted(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_qwen2_5_vl_server")
    model = save_tiny_qwen2_5_vl(path)
    log = tmp_path_factory.mktemp("logs") / "server.log"
    server = start_server(path, log, "--dtype", "float32", "--max-model-len", "256", wait=False)
    try:
        expected = {}
        for count in (1, 2):
            prompt = (
                f"<|im_start|>user\n{IMAGE * count}{QUESTION}<|im_end|>\n<|im_start|>assistant\n"
            )
            ids = hf_greedy(
                model, path, prompt, IMAGES[:count], NEW_TOKENS, processor=processor(path)
            )
            expected[count] = processor(path).tokenizer.decode(ids, skip_special_tokens=True)
        wait_healthy(server)
        yield server, expected
    finally:
        server.stop()


def test_openai_and_anthropic_images_match_transformers(booted) -> None:
    server, expected = booted
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    parts = [{"type": "image_url", "image_url": {"url": _data_url(_png(i))}} for i in IMAGES]
    reply = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": [*parts, {"type": "text", "text": QUESTION}]}],
        max_tokens=NEW_TOKENS,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert reply.choices[0].message.content == expected[2]
    source = {"type": "base64", "media_type": "image/png", "data": _data_url(_png(IMAGES[0]))[22:]}
    reply = anthropic.Anthropic(
        base_url=server.url, api_key="unused", max_retries=0
    ).messages.create(
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
    assert reply.content[0].text == expected[1]
