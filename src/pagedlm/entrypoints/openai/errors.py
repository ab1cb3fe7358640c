"""Error responses in the OpenAI and Anthropic shapes.

OpenAI: ``{"error": {"message", "type", "param", "code"}}``.
Anthropic (paths under ``/v1/messages``): ``{"type": "error", "error": {"type", "message"}}``.
The SDKs turn these into their exception classes by status code.
"""

from __future__ import annotations

import dataclasses
import json
import re
from http import HTTPStatus

from starlette.responses import JSONResponse

from pagedlm.sampling_params import SamplingParams

ANTHROPIC_PATH_PREFIX = "/v1/messages"

_OPENAI_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    413: "RequestTooLargeError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    413: "request_too_large",
    500: "api_error",
    503: "overloaded_error",
}


class APIError(Exception):
    """An error to report to the client with ``status`` (raised anywhere in a handler)."""

    def __init__(self, message: str, status: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param


_REQUEST_FIELDS = frozenset(
    {"prompt", "priority", "cache_salt", "messages", "model"}
    | {"dimensions", "normalize", "use_activation"}  # PoolingParams'
    | {f.name for f in dataclasses.fields(SamplingParams)}
)
_LEADING_NAME = re.compile(r"(?:Got )?([a-z][a-z_]*)\b")


def from_value_error(error: ValueError) -> APIError:
    """A 400 for an engine-side validation error, ``param`` set to the request field the
    message starts with ("top_k=500 exceeds ...", "temperature must be ...", vLLM's "Got
    priority 1 but ...")."""
    message = str(error)
    match = _LEADING_NAME.match(message)
    param = match.group(1) if match and match.group(1) in _REQUEST_FIELDS else None
    return APIError(message, param=param)


def is_anthropic_path(path: str) -> bool:
    return path == ANTHROPIC_PATH_PREFIX or path.startswith(ANTHROPIC_PATH_PREFIX + "/")


def error_body(message: str, status: int, param: str | None, anthropic: bool) -> dict:
    if anthropic:
        kind = _ANTHROPIC_TYPES.get(status, "api_error")
        return {"type": "error", "error": {"type": kind, "message": message}}
    kind = _OPENAI_TYPES.get(status) or HTTPStatus(status).phrase.replace(" ", "") + "Error"
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def error_response(
    message: str, status: int = 400, param: str | None = None, *, anthropic: bool = False
) -> JSONResponse:
    return JSONResponse(error_body(message, status, param, anthropic), status_code=status)


def error_bytes(message: str, status: int, path: str) -> bytes:
    """The body for middleware that answers before the app runs."""
    return json.dumps(error_body(message, status, None, is_anthropic_path(path))).encode()


def sse_error_event(message: str, status: int, anthropic: bool) -> str:
    """An error sent inside an already-started event stream."""
    body = error_body(message, status, None, anthropic)
    if anthropic:
        return f"event: error\ndata: {json.dumps(body)}\n\n"
    return f"data: {json.dumps(body)}\n\n"
