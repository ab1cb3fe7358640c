"""vLLM's HTTP-level flags: CORS (permissive by default, preflights answered before the
API key), narrowed origins, no docs, the chat response role, and what uvicorn is given."""

from __future__ import annotations

import asyncio

import httpx
from fake_engine import FakeEngine, fake_context

from pagedlm.entrypoints.cli.main import build_parser
from pagedlm.entrypoints.openai.app import build_app
from pagedlm.entrypoints.openai.http_options import HttpOptions, uvicorn_options

PREFLIGHT = {"origin": "https://app.example", "access-control-request-method": "POST"}


def _app(checkpoint, **kwargs):
    role = kwargs.pop("response_role", "assistant")
    return build_app(fake_context(FakeEngine(checkpoint), response_role=role), **kwargs)


def _send(app, method: str, path: str, **kwargs) -> httpx.Response:
    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
            return await http.request(method, path, **kwargs)

    return asyncio.run(main())


def test_cors_is_open_by_default_and_preflights_need_no_key(chat_checkpoint):
    app = _app(chat_checkpoint, api_key="secret")
    preflight = _send(app, "OPTIONS", "/v1/chat/completions", headers=PREFLIGHT)
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-origin"] == "*"
    unauthorized = _send(app, "GET", "/v1/models", headers={"origin": "https://app.example"})
    assert unauthorized.status_code == 401  # the key is still required for the call itself
    assert unauthorized.headers["access-control-allow-origin"] == "*"


def test_narrowed_origins_and_no_docs(chat_checkpoint):
    http = HttpOptions(allowed_origins=("https://ok.example",), docs=False)
    app = _app(chat_checkpoint, http=http)
    refused = _send(app, "OPTIONS", "/v1/models", headers=PREFLIGHT)
    assert "access-control-allow-origin" not in refused.headers
    allowed = _send(
        app, "OPTIONS", "/v1/models", headers={**PREFLIGHT, "origin": "https://ok.example"}
    )
    assert allowed.headers["access-control-allow-origin"] == "https://ok.example"
    for path in ("/openapi.json", "/docs", "/redoc"):
        assert _send(app, "GET", path).status_code == 404
    assert _send(_app(chat_checkpoint), "GET", "/openapi.json").status_code == 200


def test_the_response_role(chat_checkpoint):
    app = _app(chat_checkpoint, response_role="bot")
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    answer = _send(app, "POST", "/v1/chat/completions", json=body).json()
    assert answer["choices"][0]["message"]["role"] == "bot"


def test_the_flags_reach_uvicorn():
    args = build_parser().parse_args(
        ["serve", "--root-path", "/llm", "--ssl-keyfile", "k.pem", "--ssl-certfile", "c.pem",
         "--uvicorn-log-level", "warning", "--disable-uvicorn-access-log",
         "--allowed-origins", '["https://a"]', "--allow-credentials", "--ssl-cert-reqs", "2",
         "--ssl-ciphers", "ECDHE+AESGCM"]
    )  # fmt: skip
    options = uvicorn_options(args)
    assert options == {
        "root_path": "/llm", "ssl_keyfile": "k.pem", "ssl_certfile": "c.pem",
        "ssl_ca_certs": None, "ssl_cert_reqs": 2, "ssl_ciphers": "ECDHE+AESGCM",
        "h11_max_incomplete_event_size": 4 << 20, "log_level": "warning", "access_log": False,
    }  # fmt: skip
    http = HttpOptions.from_args(args)
    assert http.allowed_origins == ("https://a",) and http.allow_credentials and http.docs
    assert uvicorn_options(build_parser().parse_args(["serve"]))["log_level"] == "info"


def test_any_of_several_api_keys_opens_the_api(chat_checkpoint):
    app = _app(chat_checkpoint, api_key=["old-key", "new-key"])
    for key in ("old-key", "new-key"):
        assert _send(app, "GET", "/v1/models", headers={"x-api-key": key}).status_code == 200
    assert _send(app, "GET", "/v1/models", headers={"x-api-key": "other"}).status_code == 401
    args = build_parser().parse_args(["serve", "--api-key", "a", "b"])
    assert args.api_key == ["a", "b"]


class _Tagging:
    """An ASGI middleware class that tags responses."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        async def tagged(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message["headers"], (b"x-order", b"class")]}
            await send(message)

        await self.app(scope, receive, tagged)


async def _stamp(request, call_next):
    response = await call_next(request)
    response.headers["x-stamp"] = request.url.path
    return response


def test_middleware_classes_and_functions_wrap_the_routes(chat_checkpoint):
    app = _app(chat_checkpoint, api_key="k", middleware=[_Tagging, _stamp])
    answer = _send(app, "GET", "/v1/models", headers={"x-api-key": "k"})
    assert answer.headers["x-order"] == "class" and answer.headers["x-stamp"] == "/v1/models"
    refused = _send(app, "GET", "/v1/models")
    assert refused.status_code == 401 and "x-stamp" not in refused.headers  # key first


def test_middleware_paths_are_checked_before_the_model_loads():
    import pytest

    from pagedlm.entrypoints.openai.api_server import load_middleware

    assert load_middleware(["server.fake_engine:FakeEngine"])[0].__name__ == "FakeEngine"
    with pytest.raises(SystemExit, match="cannot import 'no_such_module'"):
        load_middleware(["no_such_module:Thing"])
    with pytest.raises(SystemExit, match="give an ASGI middleware class or an async function"):
        load_middleware(["os.path:sep"])


def test_a_unix_socket_replaces_a_stale_one_and_refuses_a_live_one(tmp_path):
    import os
    import socket

    import pytest

    from pagedlm.entrypoints.openai.api_server import bind_listener

    path = str(tmp_path / "s.sock")
    first = bind_listener("unused", 0, uds=path)
    with pytest.raises(SystemExit, match="already listens"):
        bind_listener("unused", 0, uds=path)
    first.close()  # the file stays behind, nobody listening
    second = bind_listener("unused", 0, uds=path)
    client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    client.connect(path)
    client.close()
    second.close()
    os.unlink(path)
    (tmp_path / "plain").write_text("x")
    with pytest.raises(SystemExit, match="not a socket"):
        bind_listener("unused", 0, uds=str(tmp_path / "plain"))


def test_load_counts_requests_in_flight_only_when_tracked(chat_checkpoint):
    import threading

    from starlette.testclient import TestClient

    body = {"model": "tiny", "prompt": "hi", "max_tokens": 3, "stream": True}
    for tracked in (False, True):
        engine = FakeEngine(chat_checkpoint)
        release = threading.Event()
        generate = engine.generate

        async def held(*args, generate=generate, release=release, **kwargs):
            async for output in generate(*args, **kwargs):
                yield output
                # after the first output the stream stays open until released
                assert await asyncio.to_thread(release.wait, 10)

        engine.generate = held
        app = build_app(fake_context(engine), http=HttpOptions(track_server_load=tracked))
        with TestClient(app) as client:
            assert client.get("/load").json() == {"server_load": 0}
            with client.stream("POST", "/v1/completions", json=body) as stream:
                assert client.get("/load").json() == {"server_load": int(tracked)}
                release.set()
                assert b"[DONE]" in b"".join(stream.iter_bytes())
            assert client.get("/load").json() == {"server_load": 0}
    assert build_parser().parse_args(["serve", "--enable-server-load-tracking"]
                                     ).enable_server_load_tracking  # fmt: skip


def test_log_error_stack_logs_the_traceback_of_an_error_answer(chat_checkpoint, caplog):
    import logging

    bad = {"model": "tiny", "prompt": "hi", "max_tokens": 2, "temperature": 9}
    for flag in (False, True):
        app = build_app(fake_context(FakeEngine(chat_checkpoint), log_error_stack=flag))
        caplog.clear()
        with caplog.at_level(logging.ERROR, logger="pagedlm.server"):
            assert _send(app, "POST", "/v1/completions", json=bad).status_code == 400
        stacks = [r for r in caplog.records if r.exc_info and "Error response" in r.getMessage()]
        assert bool(stacks) == flag


def test_tokenizer_info_is_served_only_when_asked(chat_checkpoint):
    engine = FakeEngine(chat_checkpoint)
    closed = build_app(fake_context(engine))
    assert _send(closed, "GET", "/tokenizer_info").status_code == 404  # vLLM's default
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    app = build_app(fake_context(engine, tokenizer_info_endpoint=True, chat_template=template))
    info = _send(app, "GET", "/tokenizer_info").json()
    assert info["tokenizer_class"] == type(engine.tokenizer).__name__
    assert info["chat_template"] == template  # the one the server renders with
    assert info["eos_token"] == engine.tokenizer.eos_token and info["eos_token_id"] is not None
    assert info["vocab_size"] == len(engine.tokenizer) and info["model_max_length"] > 0
    assert not any(key.endswith("_file") for key in info)  # no paths of the server's disk


def test_ping_is_health_without_a_key(chat_checkpoint):
    app = _app(chat_checkpoint, api_key="secret")
    for method in ("GET", "POST"):
        assert _send(app, method, "/ping").status_code == 200  # SageMaker's probe, keyless
    assert _send(app, "GET", "/v1/models").status_code == 401
