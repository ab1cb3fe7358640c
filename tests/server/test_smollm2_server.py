"""The embedded SmolLM2-135M-Instruct behind the server, through both SDKs (slow: a real
model on CPU)."""

from __future__ import annotations

import time

import anthropic
import openai
import pytest
from server_utils import start_server

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server(smollm2_path, tmp_path_factory):
    started = time.monotonic()
    # The same question is asked three times: the later ones hit the prefix cache, and only
    # batch-invariant mode makes their logits those of the first (the GGUF layers' numerics
    # on CPU depend on the step's row count; the first answer token is a near-tie whose
    # winner flips after a hit, "L'Étoile, ..." instead of "The capital ... is Paris.").
    server = start_server(
        smollm2_path, tmp_path_factory.mktemp("logs") / "smollm2.log", "--batch-invariant"
    )
    print(f"pagedlm serve healthy after {time.monotonic() - started:.1f} s")
    yield server
    server.stop()


def test_chat_knows_paris(server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
    reply = client.chat.completions.create(
        model="tiny", messages=QUESTION, max_tokens=16, temperature=0
    )
    assert "Paris" in reply.choices[0].message.content
    streamed = client.chat.completions.create(
        model="tiny", messages=QUESTION, max_tokens=16, temperature=0, stream=True
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in streamed if chunk.choices)
    assert text == reply.choices[0].message.content


def test_messages_knows_paris(server):
    client = anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0)
    message = client.messages.create(
        model="tiny", max_tokens=16, messages=QUESTION, extra_body={"temperature": 0}
    )
    assert "Paris" in message.content[0].text
