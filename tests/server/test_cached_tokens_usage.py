"""Which ``usage`` reports the prefix cache's share of the prompt, and which count, route by
route, as vLLM's serving layer reports it (``--enable-prompt-tokens-details``).

``CachingEngine`` says a prompt's first token id is how many of its tokens the prefix
cache served, so each prompt of a request carries a count of its own.
"""

from __future__ import annotations

import json

import pytest
from fake_engine import FakeEngine, fake_context
from starlette.testclient import TestClient

from pagedlm.entrypoints.openai.app import build_app

CONTINUOUS = {
    "stream": True,
    "stream_options": {"include_usage": True, "continuous_usage_stats": True},
}


class CachingEngine(FakeEngine):
    """Reports a prompt's first token id as its tokens served by the prefix cache (or a
    fixed ``num_cached``)."""

    num_cached: int | None = None

    def _step(self, child_id, processed, step):
        output = super()._step(child_id, processed, step)
        cached = self.num_cached
        return output._replace(
            num_cached_tokens=processed.prompt_token_ids[0] if cached is None else cached
        )


def _client(checkpoint, num_cached: int | None = None, **server_flags) -> TestClient:
    engine = CachingEngine(checkpoint)
    engine.num_cached = num_cached
    return TestClient(build_app(fake_context(engine, **server_flags)))


def _chunks(client: TestClient, path: str, body: dict) -> list[dict]:
    response = client.post(path, json=body)
    assert response.status_code == 200, response.text
    lines = [line for line in response.text.splitlines() if line.startswith("data: {")]
    return [json.loads(line.removeprefix("data: ")) for line in lines]


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"prompt": [0, 5, 6, 7]}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ],
)
def test_details_ride_on_the_final_usage_only_and_say_zero(chat_checkpoint, path, body):
    """vLLM's continuous usage (each chunk's) has no prompt_tokens_details; its final usage
    has them, ``{"cached_tokens": 0}`` when nothing was cached (vLLM omitted a zero count
    before its fix of June 2026; it now reports it)."""
    with _client(chat_checkpoint, num_cached=0, enable_prompt_tokens_details=True) as client:
        body = {"model": "tiny", "max_tokens": 3, **body}
        chunks = _chunks(client, path, {**body, **CONTINUOUS})
        *running, final = chunks
        assert running and all(chunk["choices"] for chunk in running)
        assert all("prompt_tokens_details" not in chunk["usage"] for chunk in running)
        assert final["choices"] == [] and final["usage"]["prompt_tokens_details"] == {
            "cached_tokens": 0
        }
        whole = client.post(path, json=body).json()["usage"]
        assert whole["prompt_tokens_details"] == {"cached_tokens": 0}


@pytest.mark.parametrize("flag", [False, True])
def test_a_response_reports_its_cached_input_tokens_without_the_flag(chat_checkpoint, flag):
    """vLLM's Responses API fills input_tokens_details.cached_tokens from the engine's
    count whatever --enable-prompt-tokens-details says (that flag is chat's and
    completions'); without it a response said 0."""
    with _client(chat_checkpoint, num_cached=16, enable_prompt_tokens_details=flag) as client:
        body = {"model": "tiny", "input": "Hi"}
        usage = client.post("/v1/responses", json=body).json()["usage"]
        assert usage["input_tokens_details"] == {"cached_tokens": 16, "cache_write_tokens": 0}
        stream = client.post("/v1/responses", json={**body, "stream": True}).text
        last = [line for line in stream.splitlines() if line.startswith("data: {")][-1]
        event = json.loads(last.removeprefix("data: "))
        assert event["type"] == "response.completed"
        assert event["response"]["usage"]["input_tokens_details"]["cached_tokens"] == 16
        chat = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}
        chat_usage = client.post("/v1/chat/completions", json=chat).json()["usage"]
        assert ("prompt_tokens_details" in chat_usage) is flag  # chat keeps to the flag


def test_several_prompts_report_one_prompts_count(chat_checkpoint):
    """A /v1/completions request of several prompts reports one prompt's count, as vLLM's:
    a whole response the last prompt's (its last final output), a stream the first output's
    (the first prompt's here, each prompt's first output coming in prompt order). It
    summed them."""
    prompts = [[16, 5, 6], [48, 5, 6], [32, 5, 6]]  # served 16, 48 and 32 tokens
    body = {"model": "tiny", "prompt": prompts, "max_tokens": 3}
    with _client(chat_checkpoint, enable_prompt_tokens_details=True) as client:
        whole = client.post("/v1/completions", json=body).json()["usage"]
        assert whole["prompt_tokens_details"] == {"cached_tokens": 32}
        stream = {"stream": True, "stream_options": {"include_usage": True}}
        streamed = _chunks(client, "/v1/completions", {**body, **stream})[-1]["usage"]
        assert streamed["prompt_tokens_details"] == {"cached_tokens": 16}
        assert whole["prompt_tokens"] == streamed["prompt_tokens"] == 9
