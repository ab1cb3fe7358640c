"""``prompt_embeds`` on ``/v1/completions`` (vLLM's): base64 of ``torch.save``'s bytes, a
string or a list; their choices come before the ``prompt``'s. The real engine (its core in
a child process, so the rows cross the wire) generates from them what it does from the
ids, and cuts them on the request's ``truncation_side``; malformed data, a disabled engine
and beam search are 400s naming the problem."""

from __future__ import annotations

import asyncio
import base64
import io
import re
import zipfile
from dataclasses import replace

import httpx
import torch
from fake_engine import FakeEngine
from responses_app import in_process_app as fake_app
from safetensors.torch import load_file

from server.server_utils import in_process_app

IDS = [5, 17, 99, 3, 200, 7, 8, 9, 10]


def b64(tensor: torch.Tensor) -> str:
    buffer = io.BytesIO()
    torch.save(tensor, buffer)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def rows(checkpoint, ids: list[int]) -> torch.Tensor:
    table = load_file(str(checkpoint / "model.safetensors"))["model.embed_tokens.weight"]
    return table[torch.tensor(ids)].float()


def test_embeds_complete_as_their_ids_do(chat_checkpoint) -> None:
    engine, app = in_process_app(
        chat_checkpoint, enable_prompt_embeds=True, num_kv_blocks=64, max_model_len=128
    )
    body = {"model": "tiny", "max_tokens": 6, "temperature": 0, "return_token_ids": True}

    async def run() -> None:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            want = await client.post("/v1/completions", json={**body, "prompt": IDS})
            assert want.status_code == 200, want.text
            got = await client.post(
                "/v1/completions",
                json={
                    **body,
                    "prompt": IDS[:4],
                    "prompt_embeds": [b64(rows(chat_checkpoint, IDS))],
                },
            )
            assert got.status_code == 200, got.text
            choices = got.json()["choices"]
            assert [c["index"] for c in choices] == [0, 1]
            assert choices[0]["token_ids"] == want.json()["choices"][0]["token_ids"]
            assert choices[0]["prompt_token_ids"] == []
            assert got.json()["usage"]["prompt_tokens"] == len(IDS) + 4
            await _truncation_sides(client, body, chat_checkpoint)

    try:
        asyncio.run(run())
    finally:
        engine.shutdown()


async def _truncation_sides(client: httpx.AsyncClient, body: dict, checkpoint) -> None:
    """vLLM's ``truncation_side`` with ``truncate_prompt_tokens``: the rows of an
    embeddings prompt are cut on that side as token ids are, on completions and chat."""
    embedded = b64(rows(checkpoint, IDS))
    for side, kept in (("left", IDS[-5:]), ("right", IDS[:5])):
        want = await client.post("/v1/completions", json={**body, "prompt": kept})
        cut = {"truncate_prompt_tokens": 5, "truncation_side": side}
        for prompt in ({"prompt_embeds": embedded}, {"prompt": IDS}):
            got = await client.post("/v1/completions", json={**body, **prompt, **cut})
            assert got.status_code == 200, got.text
            assert got.json()["choices"][0]["token_ids"] == want.json()["choices"][0]["token_ids"]
            assert got.json()["usage"]["prompt_tokens"] == 5
    chat = {**body, "messages": [{"role": "user", "content": "hello there"}]}
    whole = (await client.post("/v1/chat/completions", json=chat)).json()
    first = whole["prompt_token_ids"][:5]
    want = await client.post("/v1/completions", json={**body, "prompt": first})
    cut = {"truncate_prompt_tokens": 5, "truncation_side": "right"}
    got = (await client.post("/v1/chat/completions", json={**chat, **cut})).json()
    assert got["prompt_token_ids"] == first
    assert got["choices"][0]["token_ids"] == want.json()["choices"][0]["token_ids"]
    bad = await client.post(
        "/v1/completions", json={**body, "prompt": IDS, "truncation_side": "up"}
    )
    assert bad.status_code == 400 and "truncation_side" in bad.text


def _enabled_fake(checkpoint) -> FakeEngine:
    engine = FakeEngine(checkpoint)
    processor = engine.input_processor
    # float16, so a value finite in float32 can overflow where the model reads it
    processor.model_config = replace(
        processor.model_config, enable_prompt_embeds=True, dtype=torch.float16
    )
    return engine


def test_bad_prompt_embeds_are_400s(chat_checkpoint) -> None:
    hidden = rows(chat_checkpoint, [1]).shape[1]
    stored = io.BytesIO()
    with zipfile.ZipFile(stored, "w", zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("data.pkl", b"\0" * 1000)
    cases = [
        ("not base64!", "not valid base64"),
        (base64.b64encode(b"plain bytes").decode(), "could not be loaded"),
        (base64.b64encode(stored.getvalue()).decode(), "compressed archive"),
        (b64(torch.zeros(3, hidden + 1)), "hidden size"),
        (b64(torch.zeros(3, hidden, dtype=torch.int32)), "floating point"),
        # 2 kB on the wire claiming 4 M elements (stride 0): refused before materialized
        (b64(torch.zeros(1).expand(1024, hidden)), "strides repeat or skip its storage"),
        (b64(torch.empty(3, hidden, device="meta")), "meta tensor"),
        (b64(torch.full((3, hidden), 1e6)), "NaN or infinite"),  # float16 model: inf
    ]
    base = {"model": "tiny", "max_tokens": 2}
    with fake_app(chat_checkpoint, engine=_enabled_fake(chat_checkpoint)) as http:
        ok = http.post(
            "/v1/completions", json={**base, "prompt_embeds": b64(torch.zeros(3, hidden))}
        )
        assert ok.status_code == 200, ok.text
        assert ok.json()["usage"]["prompt_tokens"] == 3
        for data, message in cases:
            response = http.post("/v1/completions", json={**base, "prompt_embeds": data})
            assert response.status_code == 400, response.text
            assert re.search(message, response.json()["error"]["message"]), message
        beam = http.post(
            "/v1/completions",
            json={**base, "prompt_embeds": b64(torch.zeros(3, hidden)), "use_beam_search": True},
        )
        assert beam.status_code == 400 and "use_beam_search" in beam.text
        empty = http.post("/v1/completions", json=base)
        assert empty.status_code == 400 and "prompt" in empty.text
    with fake_app(chat_checkpoint) as http:
        off = http.post(
            "/v1/completions", json={**base, "prompt_embeds": b64(torch.zeros(3, hidden))}
        )
        assert off.status_code == 400 and "enable-prompt-embeds" in off.text


def test_prompt_embeds_count_against_max_completion_prompts() -> None:
    from types import SimpleNamespace

    import pytest

    from pagedlm.entrypoints.openai.errors import APIError
    from pagedlm.entrypoints.openai.limits import RequestLimits

    limits = RequestLimits(max_completion_prompts=2)
    limits.check(SimpleNamespace(prompt_embeds=["a", "b"]))
    with pytest.raises(APIError, match=r"prompt_embeds has 3 entries.*--max-completion-prompts"):
        limits.check(SimpleNamespace(prompt_embeds=["a", "b", "c"]))
