"""vLLM's limits on a request's header fields: ``--h11-max-header-count`` (how many) and
``--h11-max-incomplete-event-size`` (how many bytes).

uvicorn's h11 parser bounds the bytes itself (``h11_max_incomplete_event_size``, passed by
``http_options.uvicorn_options``: a longer head is a 400 before any app code runs), but
neither uvicorn nor h11 counts header fields, so vLLM's count (which it sets on
``uvicorn.Config``, where nothing reads it) is checked here, on the ASGI scope, for every
HTTP request. The bytes are checked here too, because uvicorn parses with httptools instead
of h11 where httptools is installed, and then ignores its h11 option.
"""

from __future__ import annotations

from pagedlm.entrypoints.openai.middleware import ASGIApp, Receive, Scope, Send, send_error


def header_bytes(headers: list[tuple[bytes, bytes]]) -> int:
    """The bytes of the header fields as sent (``name: value`` and CRLF each), at most
    the head's bytes that h11 bounds, so a head h11 took is never refused here."""
    return sum(len(name) + len(value) + 4 for name, value in headers)


class HeaderLimitMiddleware:
    """A 400 naming the flag for an HTTP request with more than ``max_count`` header
    fields, or whose fields take more than ``max_bytes``."""

    def __init__(self, app: ASGIApp, max_count: int, max_bytes: int) -> None:
        self.app = app
        self.max_count = max_count
        self.max_bytes = max_bytes

    def refusal(self, headers: list[tuple[bytes, bytes]]) -> str | None:
        if len(headers) > self.max_count:
            return (
                f"The request has {len(headers)} header fields, more than this server's "
                f"limit of {self.max_count}; send fewer headers, or restart the server with "
                "a larger --h11-max-header-count."
            )
        size = header_bytes(headers)
        if size > self.max_bytes:
            return (
                f"The request's header fields take {size} bytes, more than this server's "
                f"limit of {self.max_bytes}; send shorter headers, or restart the server "
                "with a larger --h11-max-incomplete-event-size."
            )
        return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            refusal = self.refusal(scope.get("headers", []))
            if refusal is not None:
                await send_error(send, 400, refusal, scope["path"])
                return
        await self.app(scope, receive, send)
