"""Request ids (vLLM's): a client's ``X-Request-Id`` names its completion (``cmpl-<id>``),
over the body's ``request_id``; ``--enable-request-id-headers`` answers with the header;
an id still in use or not printable ASCII is a 400, and other requests carry on."""

from __future__ import annotations

import asyncio

import httpx

from pagedlm.entrypoints.openai.http_options import HttpOptions
from server.server_utils import in_process_app

BODY = {"model": "tiny", "prompt": "Hello", "max_tokens": 4, "temperature": 0}


def _app(checkpoint, echo: bool):
    """(engine, app); one per test: an engine's output task lives in one event loop."""
    return in_process_app(
        checkpoint, http=HttpOptions(request_id_headers=echo), num_kv_blocks=32,
        max_model_len=128,
    )  # fmt: skip


def _client(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")


def test_the_header_names_the_completion_over_the_body(chat_checkpoint) -> None:
    engine, app = _app(chat_checkpoint, echo=False)

    async def run() -> None:
        async with _client(app) as client:
            plain = await client.post("/v1/completions", json=BODY)
            assert plain.json()["id"].startswith("cmpl-") and "x-request-id" not in plain.headers
            named = await client.post("/v1/completions", json={**BODY, "request_id": "body-1"})
            assert named.json()["id"] == "cmpl-body-1"
            both = await client.post(
                "/v1/completions",
                json={**BODY, "request_id": "body-2"},
                headers={"X-Request-Id": "trace-7"},
            )
            assert both.json()["id"] == "cmpl-trace-7"
            chat = await client.post(
                "/v1/chat/completions",
                json={"model": "tiny", "messages": [{"role": "user", "content": "Hi"}],
                      "max_tokens": 3},
                headers={"X-Request-Id": "trace-8"},
            )  # fmt: skip
            assert chat.json()["id"] == "chatcmpl-trace-8"
            bad = await client.post("/v1/completions", json=BODY, headers={"X-Request-Id": "a\tb"})
            assert bad.status_code == 400 and "X-Request-Id" in bad.json()["error"]["message"]

    try:
        asyncio.run(run())
    finally:
        engine.shutdown()


def test_an_id_in_use_is_refused_alone(chat_checkpoint) -> None:
    engine, app = _app(chat_checkpoint, echo=False)
    long = {**BODY, "max_tokens": 100, "ignore_eos": True}
    headers = {"X-Request-Id": "dup"}

    async def run() -> None:
        async with _client(app) as client:
            first = asyncio.ensure_future(
                client.post("/v1/completions", json=long, headers=headers)
            )
            while not any(k.startswith("cmpl-dup") for k in engine._streams):  # running
                await asyncio.sleep(0.005)
            second = await client.post("/v1/completions", json=BODY, headers=headers)
            assert second.status_code == 400 and "already in use" in second.text
            assert (await first).status_code == 200

    try:
        asyncio.run(run())
    finally:
        engine.shutdown()


def test_the_flag_echoes_the_header(chat_checkpoint) -> None:
    engine, app = _app(chat_checkpoint, echo=True)

    async def run() -> None:
        async with _client(app) as client:
            echoed = await client.post("/v1/completions", json=BODY, headers={"X-Request-Id": "t1"})
            assert echoed.headers["x-request-id"] == "t1"
            fresh = await client.get("/v1/models")
            assert len(fresh.headers["x-request-id"]) == 32

    try:
        asyncio.run(run())
    finally:
        engine.shutdown()
