"""vLLM's ``return_token_ids``, ``return_tokens_as_token_ids`` and
``stream_options.continuous_usage_stats`` on /v1/completions and /v1/chat/completions,
whole and streamed, over a real ``AsyncLLM`` on a tiny chat model: the ids are the
engine's (the same as ``LLM.generate`` gives), streamed deltas add up."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from pagedlm import LLM, SamplingParams
from server.server_utils import in_process_app

PROMPT = [5, 6, 7, 8, 9]


@pytest.fixture(scope="module")
def answers(chat_checkpoint):
    engine, app = in_process_app(chat_checkpoint, num_kv_blocks=64, max_model_len=64)
    common = {"model": "tiny", "max_tokens": 6, "temperature": 0, "return_token_ids": True}
    chat = {**common, "messages": [{"role": "user", "content": "hi"}]}
    completion = {**common, "prompt": PROMPT, "logprobs": 2, "return_tokens_as_token_ids": True}

    async def stream(http, path, body):
        async with http.stream("POST", path, json={**body, "stream": True}) as response:
            lines = [line async for line in response.aiter_lines() if line.startswith("data: {")]
        return [json.loads(line.removeprefix("data: ")) for line in lines]

    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
            return {
                "completion": (await http.post("/v1/completions", json=completion)).json(),
                "completion_stream": await stream(http, "/v1/completions", completion),
                "chat": (await http.post("/v1/chat/completions", json=chat)).json(),
                "chat_stream": await stream(http, "/v1/chat/completions", chat),
                "chat_ids": (
                    await http.post(
                        "/v1/chat/completions",
                        json={**chat, "logprobs": True, "top_logprobs": 1,
                              "return_tokens_as_token_ids": True},
                    )
                ).json(),
                "plain": (
                    await http.post("/v1/completions", json={**completion, "return_token_ids": False})
                ).json(),
                "usage_stream": await stream(
                    http, "/v1/chat/completions",
                    {**chat, "stream_options": {"include_usage": True,
                                                "continuous_usage_stats": True}},
                ),
                "usage_completion_stream": await stream(
                    http, "/v1/completions",
                    {**completion, "stream_options": {"include_usage": True,
                                                      "continuous_usage_stats": True}},
                ),
            }  # fmt: skip

    try:
        yield asyncio.run(main())
    finally:
        engine.shutdown()


def _reference(chat_checkpoint) -> list[int]:
    llm = LLM(str(chat_checkpoint), num_kv_blocks=64, max_model_len=64)
    try:
        params = SamplingParams(temperature=0, max_tokens=6)
        return (
            llm.generate({"prompt_token_ids": PROMPT}, params, use_tqdm=False)[0]
            .outputs[0]
            .token_ids
        )
    finally:
        llm.llm_engine.shutdown()


def test_completions_answer_with_the_engines_token_ids(answers, chat_checkpoint):
    choice = answers["completion"]["choices"][0]
    assert choice["prompt_token_ids"] == PROMPT
    assert choice["token_ids"] == _reference(chat_checkpoint)
    assert choice["logprobs"]["tokens"] == [f"token_id:{t}" for t in choice["token_ids"]]
    assert all(
        key.startswith("token_id:") for top in choice["logprobs"]["top_logprobs"] for key in top
    )
    chunks = [c["choices"][0] for c in answers["completion_stream"] if c["choices"]]
    assert chunks[0]["prompt_token_ids"] == PROMPT
    assert all("prompt_token_ids" not in c for c in chunks[1:])
    assert [t for c in chunks for t in c["token_ids"]] == choice["token_ids"]
    plain = answers["plain"]["choices"][0]
    assert "token_ids" not in plain and "prompt_token_ids" not in plain


def test_chat_answers_with_the_prompt_and_choice_token_ids(answers):
    chat = answers["chat"]
    tokens = chat["choices"][0]["token_ids"]
    assert chat["prompt_token_ids"] and len(tokens) == chat["usage"]["completion_tokens"]
    assert len(chat["prompt_token_ids"]) == chat["usage"]["prompt_tokens"]
    chunks = answers["chat_stream"]
    assert chunks[0]["prompt_token_ids"] == chat["prompt_token_ids"]
    assert all("prompt_token_ids" not in c for c in chunks[1:])
    streamed = [t for c in chunks for choice in c["choices"] for t in choice["token_ids"]]
    assert streamed == tokens
    content = answers["chat_ids"]["choices"][0]["logprobs"]["content"]
    assert [item["token"] for item in content] == [f"token_id:{t}" for t in tokens]
    assert all(top["token"].startswith("token_id:") for i in content for top in i["top_logprobs"])


@pytest.mark.parametrize("kind", ["usage_stream", "usage_completion_stream"])
def test_continuous_usage_stats_count_each_chunks_tokens_so_far(answers, kind):
    chunks = answers[kind]
    with_choices = [c for c in chunks if c["choices"]]
    assert all("usage" in c for c in chunks)
    counts = [c["usage"]["completion_tokens"] for c in with_choices]
    streamed = 0
    for chunk, count in zip(with_choices, counts, strict=True):
        streamed += len(chunk["choices"][0]["token_ids"])
        assert count == streamed  # the tokens sent so far, this chunk's included
        usage = chunk["usage"]
        assert usage["total_tokens"] == usage["prompt_tokens"] + count
    final = chunks[-1]
    assert final["choices"] == [] and final["usage"]["completion_tokens"] == counts[-1] == 6


def test_server_flags_report_cached_tokens_and_default_to_token_ids(chat_checkpoint):
    engine, app = in_process_app(
        chat_checkpoint,
        num_kv_blocks=64,
        max_model_len=64,
        block_size=16,
        enable_prompt_tokens_details=True,  # --enable-prompt-tokens-details
        return_tokens_as_token_ids=True,  # --return-tokens-as-token-ids
    )
    body = {"model": "tiny", "prompt": list(range(3, 43)), "max_tokens": 2, "logprobs": 1}

    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
            first = (await http.post("/v1/completions", json=body)).json()
            second = (await http.post("/v1/completions", json=body)).json()
            as_text = (
                await http.post(
                    "/v1/completions", json={**body, "return_tokens_as_token_ids": False}
                )
            ).json()
            return first, second, as_text

    try:
        first, second, as_text = asyncio.run(main())
    finally:
        engine.shutdown()
    assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert second["usage"]["prompt_tokens_details"] == {"cached_tokens": 32}  # 2 full blocks
    assert all(t.startswith("token_id:") for t in first["choices"][0]["logprobs"]["tokens"])
    assert not any(t.startswith("token_id:") for t in as_text["choices"][0]["logprobs"]["tokens"])
