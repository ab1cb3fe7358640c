"""vLLM's ``use_beam_search`` on /v1/completions and /v1/chat/completions over a real
``AsyncLLM``: the ``n`` choices are ``LLM.beam_search``'s beams, best first, whole or
streamed; what beam search cannot combine with is a 400."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from pagedlm import LLM, BeamSearchParams
from server.server_utils import in_process_app

PROMPT = [5, 6, 7, 8, 9]


@pytest.fixture(scope="module")
def answers(chat_checkpoint):
    engine, app = in_process_app(chat_checkpoint, num_kv_blocks=128, max_model_len=64)
    beam = {"model": "tiny", "use_beam_search": True, "n": 3, "max_tokens": 5}

    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
            post = http.post
            completion = await post(
                "/v1/completions",
                json={**beam, "prompt": PROMPT, "logprobs": 1, "return_token_ids": True},
            )
            async with http.stream(
                "POST", "/v1/completions", json={**beam, "prompt": PROMPT, "stream": True}
            ) as response:
                lines = [x async for x in response.aiter_lines() if x.startswith("data: {")]
            chat = await post(
                "/v1/chat/completions",
                json={**beam, "messages": [{"role": "user", "content": "hi"}]},
            )
            bad = [
                await post("/v1/completions", json={**beam, "prompt": PROMPT, **extra})
                for extra in ({"stop": ["x"]}, {"n": 11}, {"logit_bias": {"5": 1}})
            ]
            extreme = [  # length ** length_penalty past a float's range was a 500
                await post("/v1/completions", json={**beam, "prompt": PROMPT, **extra})
                for extra in ({"length_penalty": 1e308}, {"length_penalty": -1e308})
            ]
            bad += extreme
            same_id = {"x-request-id": "twin"}  # the beams' internal ids once collided: a 400
            twins = await asyncio.gather(
                *(
                    post("/v1/completions", json={**beam, "prompt": PROMPT}, headers=same_id)
                    for _ in range(2)
                )
            )
            streamed = [json.loads(x[6:]) for x in lines]
            truncated = await _truncation_requests(post)
            return completion.json(), streamed, chat.json(), bad, twins, truncated

    try:
        yield asyncio.run(main())
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def offline(chat_checkpoint):
    llm = LLM(str(chat_checkpoint), num_kv_blocks=128, max_model_len=64)
    try:
        (result,) = llm.beam_search({"prompt_token_ids": PROMPT}, BeamSearchParams(3, 5))
        return result.sequences
    finally:
        llm.llm_engine.shutdown()


def test_completion_choices_are_the_beams_best_first(answers, offline):
    completion, chunks, *_ = answers
    choices = completion["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2]
    for choice, beam in zip(choices, offline, strict=True):
        generated = beam.tokens[len(PROMPT) :]
        assert choice["token_ids"] == generated
        assert len(choice["logprobs"]["tokens"]) == len(generated)
        assert choice["finish_reason"] == beam.finish_reason
    assert completion["usage"]["completion_tokens"] == sum(
        len(b.tokens) - len(PROMPT) for b in offline
    )
    streamed = {}
    for chunk in chunks:
        for choice in chunk["choices"]:
            streamed[choice["index"]] = streamed.get(choice["index"], "") + choice["text"]
    assert [streamed[i] for i in range(3)] == [c["text"] for c in choices]


def test_chat_choices_are_beams_too_and_bad_combinations_are_400(answers):
    _, _, chat, bad, *_ = answers
    assert len(chat["choices"]) == 3
    assert all(c["message"]["role"] == "assistant" for c in chat["choices"])
    statuses = [r.status_code for r in bad]
    assert statuses == [400, 400, 400, 200, 200], bad[-1].text
    assert all(len(r.json()["choices"]) == 3 for r in bad[3:])
    messages = [r.json()["error"]["message"] for r in bad[:3]]
    assert "does not combine with stop" in messages[0]
    assert "use at most 10" in messages[1]
    assert "does not combine with logit_bias" in messages[2]


def test_two_searches_with_one_client_request_id_both_answer(answers):
    """Each search's beam requests get ids of their own (vLLM adds a random part to them),
    so a client reusing its X-Request-Id does not make either search fail."""
    completion, *_, twins, _ = answers
    assert [r.status_code for r in twins] == [200, 200], [r.text for r in twins]
    texts = [c["text"] for c in completion["choices"]]
    for response in twins:
        assert response.json()["id"] == "cmpl-twin"
        assert [c["text"] for c in response.json()["choices"]] == texts


TRUNCATION_IDS = list(range(5, 25))


async def _truncation_requests(post) -> dict:
    """Searches of ``TRUNCATION_IDS`` cut by ``truncate_prompt_tokens`` (each side), of the
    two cut prompts themselves, of too many tokens to keep, and of a cut chat prompt."""
    ids = TRUNCATION_IDS
    beam = {"model": "tiny", "use_beam_search": True, "n": 2, "max_tokens": 3}
    completion = {**beam, "return_token_ids": True}
    got = {}
    for name, prompt, extra in (
        ("left", ids, {"truncate_prompt_tokens": 6}),
        ("right", ids, {"truncate_prompt_tokens": 6, "truncation_side": "right"}),
        ("last", ids[-6:], {}),
        ("first", ids[:6], {}),
        ("too_long", ids, {"truncate_prompt_tokens": 65}),
    ):
        got[name] = await post("/v1/completions", json={**completion, "prompt": prompt, **extra})
    messages = [{"role": "user", "content": "a few words more than four"}]
    got["chat"] = await post(
        "/v1/chat/completions", json={**beam, "messages": messages, "truncate_prompt_tokens": 4}
    )
    return got


def test_truncate_prompt_tokens_and_truncation_side_cut_the_searched_prompt(answers):
    """vLLM's renderer cuts every prompt before it is searched, so ``truncate_prompt_tokens``
    (and ``truncation_side``) apply to ``use_beam_search`` as to sampling: the beams
    grow from the cut prompt. The search got the whole prompt."""
    *_, got = answers
    ids = TRUNCATION_IDS
    bodies = {name: response.json() for name, response in got.items()}
    for cut, whole, want in (("left", "last", ids[-6:]), ("right", "first", ids[:6])):
        assert got[cut].status_code == 200, got[cut].text
        choices = bodies[cut]["choices"]
        assert [c["prompt_token_ids"] for c in choices] == [want, want]
        assert [c["token_ids"] for c in choices] == [
            c["token_ids"] for c in bodies[whole]["choices"]
        ]
        assert bodies[cut]["usage"]["prompt_tokens"] == 6
    assert got["too_long"].status_code == 400
    assert "truncate_prompt_tokens" in bodies["too_long"]["error"]["message"]
    assert got["chat"].status_code == 200, got["chat"].text
    assert bodies["chat"]["usage"]["prompt_tokens"] == 4
