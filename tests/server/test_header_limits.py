"""vLLM's --h11-max-header-count and --h11-max-incomplete-event-size: parsed, handed to
uvicorn, and enforced on the app (a 400 naming the flag) and by a real uvicorn server."""

from __future__ import annotations

import asyncio
import socket
import threading
from contextlib import contextmanager

import httpx
import pytest
from fake_engine import FakeEngine, fake_context

from pagedlm.entrypoints.cli.main import build_parser
from pagedlm.entrypoints.openai.app import build_app
from pagedlm.entrypoints.openai.http_options import HttpOptions, uvicorn_options


def _extra(count: int, value: str = "v") -> dict[str, str]:
    return {f"x-extra-{i}": value for i in range(count)}


def _get(app, headers: dict[str, str]) -> httpx.Response:
    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
            return await http.get("/v1/models", headers=headers)

    return asyncio.run(main())


def test_the_flags_are_parsed_and_reach_uvicorn():
    args = build_parser().parse_args(
        ["serve", "--h11-max-header-count", "64", "--h11-max-incomplete-event-size", "8192"]
    )
    http = HttpOptions.from_args(args)
    assert (http.max_header_count, http.max_header_bytes) == (64, 8192)
    assert uvicorn_options(args)["h11_max_incomplete_event_size"] == 8192
    default = HttpOptions.from_args(build_parser().parse_args(["serve"]))
    assert (default.max_header_count, default.max_header_bytes) == (256, 4 << 20)  # vLLM's
    for flag in ("--h11-max-header-count", "--h11-max-incomplete-event-size"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["serve", flag, "0"])


def test_the_app_refuses_too_many_header_fields(chat_checkpoint):
    app = build_app(
        fake_context(FakeEngine(chat_checkpoint)), http=HttpOptions(max_header_count=12)
    )
    assert _get(app, _extra(4)).status_code == 200  # with httpx's own five: 9
    refused = _get(app, _extra(10))
    assert refused.status_code == 400
    message = refused.json()["error"]["message"]
    assert "15 header fields" in message and "limit of 12" in message
    assert "--h11-max-header-count" in message
    default = build_app(fake_context(FakeEngine(chat_checkpoint)))
    assert _get(default, _extra(251)).status_code == 200  # 256: vLLM's limit
    assert _get(default, _extra(252)).status_code == 400


def test_the_app_refuses_header_fields_of_too_many_bytes(chat_checkpoint):
    http = HttpOptions(max_header_bytes=2000)
    app = build_app(fake_context(FakeEngine(chat_checkpoint)), http=http)
    assert _get(app, _extra(1, "v" * 1000)).status_code == 200
    refused = _get(app, _extra(2, "v" * 1000))
    assert refused.status_code == 400
    assert "--h11-max-incomplete-event-size" in refused.json()["error"]["message"]


async def _hello(scope, receive, send):
    assert scope["type"] in ("http", "lifespan")
    if scope["type"] == "lifespan":
        return
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"hello"})


@contextmanager
def _uvicorn(flags: list[str]):
    import uvicorn

    args = build_parser().parse_args(["serve", *flags, "--uvicorn-log-level", "critical"])
    app = HttpOptions.from_args(args).wrap(_hello)
    config = uvicorn.Config(app, lifespan="off", http="h11", **uvicorn_options(args))
    server = uvicorn.Server(config)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]})
    thread.start()
    try:
        while not server.started:
            thread.join(0.01)
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(10)
        listener.close()


def test_a_uvicorn_server_enforces_both_limits():
    flags = ["--h11-max-header-count", "10", "--h11-max-incomplete-event-size", "4096"]
    with _uvicorn(flags) as url, httpx.Client(base_url=url) as client:
        assert client.get("/", headers=_extra(4)).text == "hello"
        counted = client.get("/", headers=_extra(6))
        assert counted.status_code == 400 and "--h11-max-header-count" in counted.text
        # h11 itself refuses a longer head, before the app (uvicorn's own 400).
        assert client.get("/", headers=_extra(1, "v" * 5000)).status_code == 400
