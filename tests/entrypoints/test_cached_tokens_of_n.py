"""``num_cached_tokens`` of a request with ``n`` samples, offline (``LLM.generate``) and as
``usage.prompt_tokens_details.cached_tokens`` over HTTP, whole and streamed.

The samples are child requests admitted together: the first computes the prompt's
blocks, the others find them in the prefix cache. The request reports the largest count,
which is what vLLM's final output carries when the children finish together (the last
child's count), and each sample its own. A streamed response reports the first sample's,
as vLLM's does: its stream takes the count of its first output, the first child's.
"""

from __future__ import annotations

import asyncio
import json

import httpx

from pagedlm import LLM, SamplingParams
from server.server_utils import in_process_app

BLOCK = 16


def _full_blocks(num_prompt_tokens: int) -> int:
    """The prompt tokens in full blocks, the last prompt token always computed."""
    return (num_prompt_tokens - 1) // BLOCK * BLOCK


def test_llm_generate_reports_the_shared_prompt_blocks(tiny_checkpoint):
    llm = LLM(str(tiny_checkpoint("llama")), skip_tokenizer_init=True, block_size=BLOCK)
    params = SamplingParams(n=3, max_tokens=2, ignore_eos=True, seed=0)
    prompt = {"prompt_token_ids": list(range(3, 43))}  # 40 tokens: two full blocks
    (output,) = llm.generate(prompt, params, use_tqdm=False)
    assert len(output.outputs) == 3
    assert output.num_cached_tokens == _full_blocks(40) == 32
    assert [sample.num_cached_tokens for sample in output.outputs] == [0, 32, 32]


def _details_app(chat_checkpoint):
    """An in-process server that reports cached tokens, on small blocks."""
    return in_process_app(
        chat_checkpoint,
        num_kv_blocks=64,
        max_model_len=128,
        block_size=BLOCK,
        enable_prompt_tokens_details=True,
    )


def test_usage_reports_the_shared_prompt_blocks_whole_and_streamed(chat_checkpoint):
    engine, app = _details_app(chat_checkpoint)
    common = {"model": "tiny", "n": 2, "max_tokens": 2, "ignore_eos": True, "seed": 0}
    stream_options = {"stream": True, "stream_options": {"include_usage": True}}

    async def usage(http, path: str, body: dict) -> dict:
        if not body.get("stream"):
            response = await http.post(path, json=body)
            assert response.status_code == 200, response.text
            return response.json()["usage"]
        async with http.stream("POST", path, json=body) as response:
            lines = [line async for line in response.aiter_lines() if line.startswith("data: {")]
        return json.loads(lines[-1].removeprefix("data: "))["usage"]

    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
            answers = []
            for i, extra in enumerate(({}, stream_options)):  # a new prompt each time
                prompt = list(range(3 + i, 43 + i))
                path = "/v1/completions"
                answers.append(await usage(http, path, {**common, "prompt": prompt, **extra}))
                text = f"prompt number {i}: " + "long enough for two blocks " * 2
                messages = [{"role": "user", "content": text}]
                path = "/v1/chat/completions"
                answers.append(await usage(http, path, {**common, "messages": messages, **extra}))
            return answers

    try:
        answers = asyncio.run(main())
    finally:
        engine.shutdown()
    for usage_of in answers[:2]:  # whole: the last (here every later) sample's count
        cached = usage_of["prompt_tokens_details"]["cached_tokens"]
        assert cached == _full_blocks(usage_of["prompt_tokens"]) >= 2 * BLOCK, usage_of
    for usage_of in answers[2:]:  # streamed: the first sample's, what earlier requests left
        cached = usage_of["prompt_tokens_details"]["cached_tokens"]
        assert cached < _full_blocks(usage_of["prompt_tokens"]), usage_of
    assert answers[2]["prompt_tokens_details"]["cached_tokens"] == 0  # a new prompt


def test_a_stream_reports_what_the_first_sample_found(chat_checkpoint):
    """The first sample finds the blocks an earlier request left (one here), the second
    also those the first computed (two): the whole response reports two blocks, the
    stream one, on completions and chat."""
    engine, app = _details_app(chat_checkpoint)
    common = {"model": "tiny", "n": 2, "max_tokens": 2, "ignore_eos": True, "seed": 0}
    stream = {"stream": True, "stream_options": {"include_usage": True}}
    one = {"model": "tiny", "max_tokens": 1}

    async def cached(http, path: str, body: dict) -> int:
        if not body.get("stream"):
            response = await http.post(path, json=body)
            assert response.status_code == 200, response.text
            return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        async with http.stream("POST", path, json=body) as response:
            lines = [line async for line in response.aiter_lines() if line.startswith("data: {")]
        usage = json.loads(lines[-1].removeprefix("data: "))["usage"]
        return usage["prompt_tokens_details"]["cached_tokens"]

    async def main() -> list[int]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
            got = []
            path = "/v1/completions"
            for i, extra in enumerate(({}, stream)):
                head = list(range(100 * (i + 1), 100 * (i + 1) + BLOCK))
                await http.post(path, json={**one, "prompt": head})  # leaves the first block
                prompt = head + list(range(3, 3 + 40 - BLOCK))  # 40 tokens
                got.append(await cached(http, path, {**common, "prompt": prompt, **extra}))
            path = "/v1/chat/completions"
            for i, extra in enumerate(({}, stream)):
                head = f"conversation {i} opens, "
                await http.post(path, json={**one, "messages": [{"role": "user", "content": head}]})
                messages = [{"role": "user", "content": head + "then goes on for a while more"}]
                got.append(await cached(http, path, {**common, "messages": messages, **extra}))
            return got

    try:
        whole_completion, streamed_completion, whole_chat, streamed_chat = asyncio.run(main())
    finally:
        engine.shutdown()
    assert (whole_completion, streamed_completion) == (2 * BLOCK, BLOCK)
    assert whole_chat > streamed_chat >= BLOCK, (whole_chat, streamed_chat)
