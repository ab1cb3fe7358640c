"""Pure ASGI middleware: API-key check, request-body size limit, the client's request id,
the count of requests in flight, and the last word for requests cancelled at shutdown.

They decide on the raw ASGI scope, before routing, so no route (or a route added later)
can forget them. None ever logs the key or the body.
"""

from __future__ import annotations

import asyncio
import contextvars
import hmac
import uuid
from collections.abc import Awaitable, Callable, MutableMapping, Sequence
from typing import Any

from pagedlm.entrypoints.openai.errors import error_bytes, is_anthropic_path, sse_error_event

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

OPEN_PATHS = frozenset(
    {
        "/health",
        "/ping",
        "/ready",
        "/metrics",
        "/openapi.json",
        "/docs",
        "/docs/oauth2-redirect",
        "/redoc",
    }
)
"""Paths answered without an API key: probes, scrapers and browsers (the API's own
description) carry none."""
CANCELLED_MESSAGE = (
    "The server shut down before this request finished (its --shutdown-timeout ran out); "
    "send it again."
)


async def send_error(send: Send, status: int, message: str, path: str) -> None:
    body = error_bytes(message, status, path)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return value
    return None


INCOMING_REQUEST_ID: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "incoming_request_id", default=None
)
"""The ``X-Request-Id`` the client sent with the request being handled (None: none)."""
MAX_REQUEST_ID_CHARS = 256


class RequestIdMiddleware:
    """Makes the client's ``X-Request-Id`` the base of the ids the routes give the request
    (``chatcmpl-<id>``, as vLLM does) and, with ``echo`` (``--enable-request-id-headers``),
    answers with an ``X-Request-Id`` header: the client's, or a fresh one. An id that is
    not 1-256 printable ASCII characters is a 400."""

    def __init__(self, app: ASGIApp, echo: bool) -> None:
        self.app = app
        self.echo = echo

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        raw = _header(scope, b"x-request-id")
        incoming = None
        if raw is not None:
            incoming = raw.decode("latin-1")
            if not (
                0 < len(incoming) <= MAX_REQUEST_ID_CHARS
                and incoming.isascii()
                and incoming.isprintable()
            ):
                message = (
                    f"X-Request-Id must be 1-{MAX_REQUEST_ID_CHARS} printable ASCII "
                    "characters; send another or none."
                )
                await send_error(send, 400, message, scope.get("path", ""))
                return
        token = INCOMING_REQUEST_ID.set(incoming)
        try:
            if not self.echo:
                await self.app(scope, receive, send)
                return
            header = (incoming or uuid.uuid4().hex).encode("latin-1")

            async def send_with_id(message: Message) -> None:
                if message["type"] == "http.response.start":
                    headers = list(message.get("headers", ()))
                    headers.append((b"x-request-id", header))
                    message = {**message, "headers": headers}
                await send(message)

            await self.app(scope, receive, send_with_id)
        finally:
            INCOMING_REQUEST_ID.reset(token)


class APIKeyMiddleware:
    """401 unless ``Authorization: Bearer <key>`` or ``x-api-key: <key>`` matches one of
    the keys (several let clients move from an old key to a new one).

    The comparison is constant-time (``hmac.compare_digest``) on bytes, against every key;
    only the exact paths in ``OPEN_PATHS`` skip it.
    """

    def __init__(self, app: ASGIApp, api_keys: str | Sequence[str]) -> None:
        self.app = app
        keys = [api_keys] if isinstance(api_keys, str) else list(api_keys)
        if not keys or not all(keys):
            raise ValueError("an API key must be a non-empty string")
        self._keys = [key.encode() for key in keys]

    def _authorized(self, scope: Scope) -> bool:
        presented = b""
        authorization = _header(scope, b"authorization")
        if authorization is not None and authorization[:7].lower() == b"bearer ":
            presented = authorization[7:].strip()
        elif (x_api_key := _header(scope, b"x-api-key")) is not None:
            presented = x_api_key.strip()
        matches = [hmac.compare_digest(presented, key) for key in self._keys]
        return any(matches)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS or scope["method"] == "OPTIONS":
            await self.app(scope, receive, send)
            return
        if not self._authorized(scope):
            await send_error(
                send,
                401,
                "Missing or invalid API key: send 'Authorization: Bearer <key>' (or "
                "'x-api-key: <key>') with the key the server was started with.",
                scope["path"],
            )
            return
        await self.app(scope, receive, send)


class BodySizeLimitMiddleware:
    """413 for bodies over ``max_bytes``, whether announced by Content-Length or chunked.

    The body is read here in full (at most ``max_bytes``) and replayed to the app as one
    message; later ``receive()`` calls go to the server, so disconnects still reach the app.
    """

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    def _too_large(self) -> str:
        return (
            f"Request body exceeds the server's limit of {self.max_bytes} bytes; send a "
            "smaller request or restart the server with a larger --max-request-body-bytes."
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = _header(scope, b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await send_error(send, 413, self._too_large(), scope["path"])
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                await self.app(scope, _replay([message], receive), send)
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await send_error(send, 413, self._too_large(), scope["path"])
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        await self.app(scope, _replay([body], receive), send)


def _replay(messages: list[Message], receive: Receive) -> Receive:
    pending = list(messages)

    async def replayed() -> Message:
        if pending:
            return pending.pop(0)
        return await receive()

    return replayed


class CancelledRequestMiddleware:
    """Ends a request that uvicorn cancels (past its graceful-shutdown timeout) cleanly:
    a JSON 503 if nothing was sent yet, else an error event (then ``[DONE]`` for OpenAI
    paths) to close an event stream; no traceback is logged.

    ``ServingContext.begin_shutdown`` normally ends generation first; this covers a
    request cancelled anywhere else (a slow reader, a long template render).
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        state: dict[str, Any] = {"started": False, "ended": False, "stream": False}

        async def tracking_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                state["started"] = True
                headers = dict(message.get("headers", ()))
                state["stream"] = headers.get(b"content-type", b"").startswith(b"text/event-stream")
            elif message["type"] == "http.response.body" and not message.get("more_body"):
                state["ended"] = True
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except asyncio.CancelledError:
            if state["ended"]:
                return
            path = scope["path"]
            if not state["started"]:
                await send_error(send, 503, CANCELLED_MESSAGE, path)
            elif state["stream"]:
                anthropic = is_anthropic_path(path)
                event = sse_error_event(CANCELLED_MESSAGE, 503, anthropic)
                tail = event if anthropic else event + "data: [DONE]\n\n"
                body = {"type": "http.response.body", "body": tail.encode(), "more_body": False}
                await send(body)


class ServerLoad:
    """Requests in flight on ``paths`` (vLLM's ``server_load_metrics``, read at ``/load``)."""

    def __init__(self, paths: Sequence[str]) -> None:
        self.paths = frozenset(paths)
        self.value = 0


class ServerLoadMiddleware:
    """Counts a request on ``load.paths`` from its arrival until its response's last byte
    is sent (a stream's too) or it ends otherwise."""

    def __init__(self, app: ASGIApp, load: ServerLoad) -> None:
        self.app = app
        self.load = load

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] not in self.load.paths:
            await self.app(scope, receive, send)
            return
        load = self.load
        load.value += 1
        counted = True

        async def counting_send(message: Message) -> None:
            nonlocal counted
            await send(message)
            if counted and message["type"] == "http.response.body" and not message.get("more_body"):
                counted = False
                load.value -= 1

        try:
            await self.app(scope, receive, counting_send)
        finally:
            if counted:
                load.value -= 1
