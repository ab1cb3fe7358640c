"""The Messages API against what Anthropic documents (and vLLM's Anthropic endpoint does),
over HTTP to the app with a scripted engine: how content blocks reach the chat template,
the reply's blocks and their stream events, ids.

``ScriptedEngine`` writes its script one token per byte, then EOS; the tiny tokenizer has
one token per byte, so a token count is a byte count of the rendered ChatML prompt.
"""

from __future__ import annotations

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
