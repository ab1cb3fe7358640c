"""Shutdown past ``--shutdown-timeout``: streams end with an error event (and ``[DONE]``
for OpenAI), plain requests get the JSON error, nothing logs a traceback.

In process over ``FakeEngine`` (slow steps) for the answers' shapes, and once against a
real ``pagedlm serve`` for the SIGTERM wiring.
"""

from __future__ import annotations

import asyncio
import json
import signal
import threading

import httpx
import pytest
from fake_engine import FakeEngine, fake_context
from server_utils import start_server

from pagedlm.entrypoints.openai.app import build_app
from pagedlm.entrypoints.openai.middleware import CancelledRequestMiddleware

LONG = {"max_tokens": 400, "ignore_eos": True}
CHAT = {"messages": [{"role": "user", "content": "hi"}]}
CLAUDE = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 400}


def _events(text: str) -> list[str]:
    return [block for block in text.split("\n\n") if block.strip()]


def test_requests_cut_at_the_deadline_end_in_the_api_error_shapes(chat_checkpoint):
    engine = FakeEngine(chat_checkpoint, num_tokens=10_000, step_s=0.01)
    ctx = fake_context(engine)
    app = build_app(ctx)

    async def run() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            requests = [
                client.post("/v1/completions", json={"prompt": "a", "stream": True, **LONG}),
                client.post("/v1/chat/completions", json={**CHAT, "stream": True, **LONG}),
                client.post("/v1/messages", json={**CLAUDE, "stream": True}),
                client.post("/v1/completions", json={"prompt": "a", **LONG}),
                client.post("/v1/messages", json=CLAUDE),
            ]
            tasks = [asyncio.ensure_future(r) for r in requests]
            await asyncio.sleep(0.5)
            ctx.begin_shutdown(0.1)
            responses = await asyncio.gather(*tasks)
            late = await client.post("/v1/completions", json={"prompt": "a", "max_tokens": 2})
            return [*responses, late]

    *streams, plain, claude_plain, late = asyncio.run(run())
    for response in streams[:2]:
        events = _events(response.text)
        assert events[-1] == "data: [DONE]"
        error = json.loads(events[-2].removeprefix("data: "))["error"]
        assert error["code"] == 503 and "shutting down" in error["message"]
        assert len(events) >= 3  # the stream had started: something came before the error
    claude_events = _events(streams[2].text)
    assert claude_events[-1].startswith("event: error\n")
    assert (
        json.loads(claude_events[-1].split("data: ", 1)[1])["error"]["type"] == "overloaded_error"
    )
    assert plain.status_code == 503 and plain.json()["error"]["code"] == 503
    assert claude_plain.status_code == 503 and claude_plain.json()["type"] == "error"
    assert late.status_code == 503


def test_a_beam_search_still_running_at_the_deadline_is_cut_too(chat_checkpoint):
    """Beam search's requests are the server's like any others: the deadline aborts them
    (the search ran on to its end, past the deadline)."""
    engine = FakeEngine(chat_checkpoint, step_s=0.01)
    ctx = fake_context(engine)
    app = build_app(ctx)
    beam = {"prompt": "a", "use_beam_search": True, "n": 2, **LONG}

    async def run() -> tuple[httpx.Response, float]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            task = asyncio.ensure_future(client.post("/v1/completions", json=beam))
            await asyncio.sleep(0.3)
            ctx.begin_shutdown(0.1)
            deadline = asyncio.get_running_loop().time() + 0.1
            response = await task
            return response, asyncio.get_running_loop().time() - deadline

    response, late_s = asyncio.run(run())
    assert response.status_code == 503, response.text
    assert "shutting down" in response.json()["error"]["message"]
    assert late_s < 2.0  # 400 steps of 10 ms would take 4 s


@pytest.fixture
def short_drain_server(chat_checkpoint, tmp_path):
    server = start_server(
        chat_checkpoint, tmp_path / "drain.log", "--shutdown-timeout", "0.3", "--log-level", "info"
    )
    yield server
    server.stop()


def test_sigterm_past_the_timeout_ends_streams_with_an_error(short_drain_server):
    server = short_drain_server
    results: dict[str, str] = {}
    started = threading.Event()

    def stream() -> None:
        body = {
            "model": "tiny",
            "prompt": "go",
            "stream": True,
            "max_tokens": 500,
            "ignore_eos": True,
        }
        lines = []
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                started.set()
                if line:
                    lines.append(line)
        results["stream"] = lines

    def plain() -> None:
        body = {"model": "tiny", "prompt": "go", "max_tokens": 500, "ignore_eos": True}
        response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
        results["plain"] = (response.status_code, response.json())

    threads = [threading.Thread(target=stream), threading.Thread(target=plain)]
    for thread in threads:
        thread.start()
    assert started.wait(60)
    server.process.send_signal(signal.SIGTERM)
    for thread in threads:
        thread.join(60)
    assert server.process.wait(60) == 0
    lines = results["stream"]
    assert lines[-1] == "data: [DONE]", lines[-3:]
    assert json.loads(lines[-2].removeprefix("data: "))["error"]["code"] == 503
    status, body = results["plain"]
    assert status == 503 and "shutting down" in body["error"]["message"]
    log = server.log_text()
    assert "Traceback" not in log and "Exception in ASGI" not in log, log


@pytest.mark.parametrize(
    ("path", "stream", "expected"),
    [
        ("/v1/completions", False, b'"code": 503'),
        ("/v1/completions", True, b"data: [DONE]\n\n"),
        ("/v1/messages", True, b'event: error\ndata: {"type": "error"'),
    ],
)
def test_a_request_uvicorn_cancels_still_gets_an_answer(path, stream, expected):
    async def stuck_app(scope, receive, send) -> None:
        if stream:
            headers = [(b"content-type", b"text/event-stream")]
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            await send({"type": "http.response.body", "body": b"data: {}\n\n", "more_body": True})
        await asyncio.sleep(3600)

    sent: list[dict] = []

    async def send(message) -> None:
        sent.append(message)

    async def receive() -> dict:
        await asyncio.sleep(3600)
        return {"type": "http.disconnect"}

    async def run() -> None:
        app = CancelledRequestMiddleware(stuck_app)
        task = asyncio.ensure_future(app({"type": "http", "path": path}, receive, send))
        await asyncio.sleep(0.05)
        task.cancel()
        await task  # answered, not re-raised: uvicorn logs no traceback

    asyncio.run(run())
    assert sent[-1]["type"] == "http.response.body" and not sent[-1].get("more_body")
    assert expected in sent[-1]["body"]
    if not stream:
        assert sent[-2]["status"] == 503
