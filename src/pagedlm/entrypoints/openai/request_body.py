"""The one parser of every route's JSON body: strict JSON, the route's pydantic model, caps.

Strict JSON is what RFC 8259 allows and nothing more of what Python's ``json`` accepts:
no ``NaN``/``Infinity``, no number beyond a float's range (``1e999`` would become
infinity), no duplicate keys (Python keeps the last one silently), no lone UTF-16
surrogates (``"\\ud800"``: no tokenizer can encode them), at most ``MAX_JSON_DEPTH``
levels of nesting, and the body is an object. Every failure is an ``APIError`` 400 whose
message names the problem; the route's guard gives it the route's error shape.

Fields a model does not know are dropped, as OpenAI's SDKs send fields a server may not
know; each name is logged once per process and listed, with deprecated fields in use, in
the response's ``Warning`` header (``request.state.warnings``).

A body of more than ``INLINE_BODY_BYTES`` is parsed and validated on a worker thread, so
that a multi-megabyte body (a long prompt, a million token ids, a bad body's errors) never
holds up the event loop, and with it every other request's stream. The worker runs Python
code between short stretches in C: the JSON scanner calls a Python hook per number, and
validation stops at a collection's first bad item (``fail_fast.py``).
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import json
import logging
import math
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, ClassVar, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    PrivateAttr,
    ValidationError,
    ValidationInfo,
    model_validator,
)
from starlette.requests import Request

from pagedlm.entrypoints.openai.errors import APIError
from pagedlm.entrypoints.openai.fail_fast import FailFastModel
from pagedlm.entrypoints.openai.limits import RequestLimits

logger = logging.getLogger("pagedlm.server")

MAX_JSON_DEPTH = 64
"""Deepest nesting of arrays and objects a body may have (a tool's JSON schema nests ~2
levels per property level, so this leaves room for ~30)."""
MAX_LOGGED_FIELD_NAMES = 256
"""Unknown field names are client-chosen: log at most this many distinct ones."""

MAX_NAME_CHARS = 64
"""Longer unknown field names are cut to this many characters where reported."""
MAX_LISTED_FIELD_NAMES = 16
"""Unknown field names listed in one response's ``Warning`` header."""
INLINE_BODY_BYTES = 16 << 10
"""Larger bodies are parsed on a worker thread. One this size parses inline in at most
~4 ms (all small numbers, the slowest kind; text takes microseconds), against ~30 us for
the hop to a thread and back."""
BODY_PARSING_THREADS = 2
"""Workers parsing large bodies: at most this many parse at once, others queue, so large
bodies never take the threads that tokenize other requests' prompts."""

ModelT = TypeVar("ModelT", bound=BaseModel)
ResultT = TypeVar("ResultT")
_logged_field_names: set[str] = set()
_body_threads: ThreadPoolExecutor | None = None


class _InvalidJSON(ValueError):
    """Raised from inside ``json.loads`` hooks; becomes the 400's message."""


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _InvalidJSON(f"the number {text} is out of range for a 64-bit float")
    return value


def _python_int(text: str) -> int:
    # A Python function, not ``int`` itself: the C scanner runs no Python code through a
    # long array of integers, so a worker thread would hold the interpreter throughout.
    return int(text)


def _no_constants(name: str) -> Any:
    raise _InvalidJSON(f"{name} is not a JSON value; send a finite number or null")


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: set[str] = set()
        duplicate = next(key for key, _ in pairs if key in seen or seen.add(key))
        raise _InvalidJSON(f"the key {duplicate!r} appears more than once in one object")
    return obj


def _check_tree(value: Any) -> None:
    """Depth and strings of a decoded body, iteratively (no recursion to exhaust);
    ``RecursionError`` when it nests deeper than ``MAX_JSON_DEPTH``."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, str):
            _check_string(node)
            continue
        if not isinstance(node, dict | list):
            continue
        if depth > MAX_JSON_DEPTH:
            raise RecursionError  # reported as what it is: too deep
        if isinstance(node, dict):
            for key in node:
                _check_string(key)
            children = node.values()
        else:
            children = node
        stack.extend(
            (child, depth + 1) for child in children if isinstance(child, str | dict | list)
        )


def _check_string(text: str) -> None:
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        bad = text[error.start]
        raise _InvalidJSON(
            f"a string holds the lone UTF-16 surrogate \\u{ord(bad):04x}, which is not a "
            "character; escape characters outside the BMP as surrogate pairs"
        ) from None


def loads_strict(raw: bytes) -> dict[str, Any]:
    """``raw`` as a JSON object, strictly (see the module docstring); ``APIError`` 400."""
    try:
        body = json.loads(
            raw,
            parse_constant=_no_constants,
            parse_float=_finite_float,
            parse_int=_python_int,
            object_pairs_hook=_unique_keys,
        )
        _check_tree(body)
    except RecursionError:
        raise APIError(
            f"The request body nests arrays/objects deeper than {MAX_JSON_DEPTH} levels."
        ) from None
    except _InvalidJSON as error:
        raise APIError(f"The request body is not valid JSON: {error}.") from None
    except ValueError as error:  # json.JSONDecodeError, UnicodeDecodeError, huge ints
        raise APIError(f"The request body is not valid JSON: {error}.") from None
    if not isinstance(body, dict):
        kind = {list: "an array", str: "a string", bool: "a boolean", type(None): "null"}
        raise APIError(
            "The request body must be a JSON object ({...}), got "
            f"{kind.get(type(body), 'a number')}."
        )
    return body


class RequestModel(FailFastModel):
    """Base of request bodies: drops unknown fields (noting them), refuses NaN/Infinity
    even spelled as strings ("NaN"), notes the deprecated fields it reads.

    ``field_path`` prefixes the names this model reports ("" for a whole body);
    ``deprecated_fields`` maps a field to the advice logged when a request uses it.
    """

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)
    field_path: ClassVar[str] = ""
    deprecated_fields: ClassVar[dict[str, str]] = {}
    _body_bytes: int = PrivateAttr(0)

    @property
    def body_bytes(self) -> int:
        """The size of the body this request was parsed from (0: built otherwise): work
        that grows with it goes through ``off_loop_if_large``."""
        return self._body_bytes

    @model_validator(mode="before")
    @classmethod
    def _note_fields(cls, data: Any, info: ValidationInfo) -> Any:
        if not isinstance(data, dict) or not isinstance(info.context, dict):
            return data
        known = _known_names(cls)
        prefix = f"{cls.field_path}." if cls.field_path else ""
        for key in data:
            if key not in known:
                info.context.setdefault("ignored", {})[prefix + key[:MAX_NAME_CHARS]] = None
            elif key in cls.deprecated_fields and data[key] is not None:
                info.context.setdefault("deprecated", {})[prefix + key] = cls.deprecated_fields[key]
        return data


@functools.cache
def _known_names(model: type[BaseModel]) -> frozenset[str]:
    return frozenset(
        name
        for field_name, info in model.model_fields.items()
        for name in (field_name, info.alias)
        if name is not None
    )


def validation_message(error: ValidationError) -> tuple[str, str | None]:
    """(message, param) for the most specific of pydantic's errors.

    Unions report one error per member ("prompt.str", "prompt.list[int]"); the deepest
    error is the member the input came closest to, and the member tags are dropped from
    the reported location. Equally deep errors at one location list the types accepted.
    """
    errors = error.errors(include_url=False)
    deepest = max(len(e["loc"]) for e in errors)
    candidates = [e for e in errors if len(e["loc"]) == deepest]
    param = _location(candidates[0]["loc"]) or None
    same_place = [e for e in candidates if _location(e["loc"]) == (param or "")]
    tags = [str(e["loc"][-1]) for e in same_place if _is_type_tag(e["loc"][-1])]
    message = f"expected one of: {', '.join(tags)}" if len(tags) > 1 else candidates[0]["msg"]
    return (f"{param}: {message}" if param else message), param


def _is_type_tag(part: Any) -> bool:
    # pydantic names union members by their type ("str", "list[TextPart]", "TextPart");
    # request field names are snake_case.
    return isinstance(part, str) and (
        "[" in part or part in {"str", "int", "float", "bool", "dict", "list"} or part[:1].isupper()
    )


def _location(loc: tuple[Any, ...]) -> str:
    return ".".join(str(part) for part in loc if not _is_type_tag(part))


def _note_warnings(request: Request, context: dict[str, Any]) -> None:
    warnings = []
    ignored = list(context.get("ignored", {}))
    if ignored:
        listed = ", ".join(ignored[:MAX_LISTED_FIELD_NAMES])
        more = len(ignored) - MAX_LISTED_FIELD_NAMES
        warnings.append(
            f"ignored unknown fields: {listed}" + (f" and {more} more" if more > 0 else "")
        )
        _log_once(ignored, "The request field %r is not known to this server; it is ignored.")
    for name, advice in context.get("deprecated", {}).items():
        warnings.append(f"{name} is deprecated: {advice}")
        _log_once([name], f"The request field %r is deprecated: {advice}")
    request.state.warnings = warnings


def _log_once(names: list[str], template: str) -> None:
    for name in names:
        if name in _logged_field_names or len(_logged_field_names) >= MAX_LOGGED_FIELD_NAMES:
            continue
        _logged_field_names.add(name)
        logger.warning(template, name)


def warning_header(warnings: list[str]) -> str:
    """RFC 7234 ``Warning`` values (299: a persistent miscellaneous warning). The texts
    are JSON-quoted: field names are client-chosen, and a header must be printable ASCII."""
    return ", ".join(f"299 pagedlm {json.dumps(warning)}" for warning in warnings)


def is_json_content_type(content_type: str) -> bool:
    """What FastAPI (so vLLM) reads as JSON: no Content-Type at all (``requests.post(url,
    data=...)`` sends none), ``application/json`` or ``application/<anything>+json``. Other
    types, ``text/plain`` among them (a browser's cross-site form post), are refused."""
    media = content_type.split(";")[0].strip().lower()
    if not media:
        return True
    kind, _, subtype = media.partition("/")
    return kind == "application" and (subtype == "json" or subtype.endswith("+json"))


async def parse_body(request: Request, model: type[ModelT], limits: RequestLimits) -> ModelT:
    """The JSON body validated as ``model`` and checked against ``limits``; every failure
    is an ``APIError`` 400 naming the field."""
    content_type = request.headers.get("content-type", "")
    if not is_json_content_type(content_type):
        raise APIError(f"Content-Type must be application/json, got {content_type!r}.")
    raw = await request.body()
    context: dict[str, Any] = {}
    try:
        body = await off_loop_if_large(len(raw), _validated, raw, model, limits, context)
    except APIError:
        _note_warnings(request, context)
        raise
    _note_warnings(request, context)
    return body


async def read_json(request: Request) -> dict[str, Any]:
    """The body as a strict JSON object, without a model (``loads_strict``)."""
    raw = await request.body()
    return await off_loop_if_large(len(raw), loads_strict, raw)


def _validated(
    raw: bytes, model: type[ModelT], limits: RequestLimits, context: dict[str, Any]
) -> ModelT:
    decoded = loads_strict(raw)
    try:
        body = model.model_validate(decoded, context=context)
    except ValidationError as error:
        message, param = validation_message(error)
        raise APIError(message, param=param) from None
    limits.check(body)
    if isinstance(body, RequestModel):
        body._body_bytes = len(raw)
    return body


async def off_loop_if_large(
    num_bytes: int, function: Callable[..., ResultT], *args: Any
) -> ResultT:
    """``function(*args)``, on a body-parsing thread when it works on more than
    ``INLINE_BODY_BYTES``; inline otherwise."""
    if num_bytes <= INLINE_BODY_BYTES:
        return function(*args)
    global _body_threads
    if _body_threads is None:
        _body_threads = ThreadPoolExecutor(BODY_PARSING_THREADS, "pagedlm-body")
    call = functools.partial(contextvars.copy_context().run, function, *args)
    return await asyncio.get_running_loop().run_in_executor(_body_threads, call)
