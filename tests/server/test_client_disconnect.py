"""Clients that go away mid-stream, in process over a real ``AsyncLLM``: the app is driven
through raw ASGI calls the way uvicorn drives it (ASGI spec 2.3: starlette watches for
``http.disconnect`` and cancels the response), so a disconnect can land at any point of
the stream. Each time the request must be aborted, its KV blocks freed and its id
released, and the engine must keep serving others."""

from __future__ import annotations

import asyncio
import gc
import json
import time

import httpx
import pytest

from server.server_utils import asgi_post_scope, in_process_app, statuses_of_a_dropped_upload

LONG = {"max_tokens": 400, "ignore_eos": True, "stream": True}
MESSAGES = [{"role": "user", "content": "Hi"}]
STREAMS = {
    "/v1/completions": {"model": "tiny", "prompt": "Hello", **LONG},
    "/v1/chat/completions": {"model": "tiny", "messages": MESSAGES, **LONG},
    "/v1/messages": {"model": "tiny", "messages": MESSAGES, **LONG},
    "/v1/responses": {"model": "tiny", "input": "Hi", "max_output_tokens": 400, "stream": True},
}


@pytest.fixture(scope="module")
def served(chat_checkpoint):
    """(engine, app); every test runs in its own event loop, so the tests share this only
    through ``asyncio.run`` calls that each leave the engine idle."""
    engine, app = in_process_app(chat_checkpoint, num_kv_blocks=64, max_model_len=512)
    yield engine, app
    engine.shutdown()


async def drop_after(app, path: str, body: dict, num_chunks: int, pending_write: bool) -> int:
    """POST ``body`` and disconnect once ``num_chunks`` body chunks arrived; with
    ``pending_write`` the disconnect lands while that chunk's write is still pending (a
    slow client's full socket buffer: uvicorn's ``send`` waits to drain). The status."""
    raw = json.dumps(body).encode()
    scope = asgi_post_scope(path, [(b"host", b"t")])
    gone = asyncio.Event()
    state = {"body_sent": False, "status": 0, "chunks": 0}

    async def receive() -> dict:
        if not state["body_sent"]:
            state["body_sent"] = True
            return {"type": "http.request", "body": raw, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        if gone.is_set():
            return  # uvicorn drops writes to a closed connection
        if message["type"] == "http.response.start":
            state["status"] = message["status"]
        elif message.get("body"):
            state["chunks"] += 1
            if state["chunks"] >= num_chunks:
                gone.set()
                if pending_write:
                    await asyncio.sleep(0.05)  # the drain that ends with the connection

    await asyncio.wait_for(app(scope, receive, send), 30)
    return state["status"]


async def assert_idle(engine, timeout_s: float = 30.0) -> None:
    """No request left in the scheduler or the front end, every KV block free."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = await engine.get_scheduler_stats()
        state = (stats.num_running_reqs, stats.num_waiting_reqs, stats.kv_cache_usage)
        leftover = list(engine._streams), engine.output_processor.get_num_unfinished_requests()
        if state == (0, 0, 0.0) and leftover == ([], 0):
            return
        assert time.monotonic() < deadline, (state, leftover)
        await asyncio.sleep(0.05)


@pytest.mark.parametrize("path", list(STREAMS))
def test_a_disconnect_during_a_pending_write_aborts_the_request(served, path) -> None:
    """The disconnect cancels the response inside ``send``, outside the body iterator,
    which stayed suspended at a yield: the request generated to max_tokens (holding its KV
    blocks) and its id stayed taken until the garbage collector came across it."""
    engine, app = served

    async def run() -> None:
        for num_chunks in (1, 3):
            for pending_write in (False, True):
                status = await drop_after(app, path, STREAMS[path], num_chunks, pending_write)
                assert status == 200
                await assert_idle(engine)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            limit = "max_output_tokens" if path == "/v1/responses" else "max_tokens"
            body = {**STREAMS[path], "stream": False, limit: 8}  # another request is served
            after = await client.post(path, json=body)
        assert after.status_code == 200, after.text
        await assert_idle(engine)

    gc.disable()  # the leaked stream must not depend on when the collector runs
    try:
        asyncio.run(run())
    finally:
        gc.enable()
    assert not engine.errored


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages", "/invocations"])
def test_a_disconnect_during_the_upload_is_no_server_error(served, path, caplog) -> None:
    """A client that goes away before its body has arrived was an "Unhandled error" (a
    traceback in the log per dropped upload) answered 500; nobody reads the answer, and
    the server's fault it is not: 499, quietly, as for a disconnect during generation."""
    engine, app = served
    with caplog.at_level("ERROR"):
        statuses = statuses_of_a_dropped_upload(app, path, b'{"model": "tiny", "mess')
    assert statuses == [499]
    assert not [r for r in caplog.records if r.levelname == "ERROR"], caplog.text
    assert not engine.errored
