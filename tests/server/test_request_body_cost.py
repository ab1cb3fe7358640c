"""A large or bad request body costs other requests nothing: its parsing and validation
run on a worker thread, and validation stops at a collection's first bad item, so a
million-item list yields a handful of errors, not a million (listing those held the
interpreter for seconds, on the event loop or off it)."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import pytest
from fake_engine import FakeEngine, fake_context
from pydantic import ValidationError

from pagedlm.entrypoints.openai import request_body
from pagedlm.entrypoints.openai.app import build_app
from pagedlm.entrypoints.openai.fail_fast import COLLECTION_SCHEMAS
from pagedlm.entrypoints.openai.protocol import CompletionRequest
from pagedlm.entrypoints.openai.request_body import RequestModel, validation_message

NUM_IDS = 300_000
"""A 1.8 MB token-id prompt: its ~600k pydantic errors took the old server ~6 s to list."""
MAX_STALL_S = 0.5
"""Generous for a busy 2-core machine: the parse yields the interpreter every few ms."""


def _subclasses(cls: type) -> list[type]:
    return [sub for child in cls.__subclasses__() for sub in (child, *_subclasses(child))]


def _lenient_collections(model: type, seen: set[type]) -> list[str]:
    """Where the validator of ``model`` (or of a model it nests, which validates with its
    own) has a collection without ``fail_fast``."""
    found: list[str] = []

    def walk(node: object) -> None:
        if isinstance(node, list | tuple):
            for item in node:
                walk(item)
        if not isinstance(node, dict):
            return
        nested = node.get("cls") if node.get("type") == "model" else None
        if isinstance(nested, type) and nested not in seen:
            seen.add(nested)
            found.extend(_lenient_collections(nested, seen))
        kind = node.get("type")
        if isinstance(kind, str) and kind in COLLECTION_SCHEMAS and not node.get("fail_fast"):
            found.append(f"{model.__name__}: a {kind}")
        for key, value in node.items():
            if key not in ("metadata", "default", "serialization"):
                walk(value)

    walk(model.__pydantic_core_schema__)
    return found


def test_every_request_model_stops_at_the_first_bad_item():
    # Importing the app (build_app above) defined every route's body model.
    seen: set[type] = set(_subclasses(RequestModel))
    lenient = [spot for model in list(seen) for spot in _lenient_collections(model, seen)]
    assert not lenient, sorted(set(lenient))


@pytest.mark.parametrize(
    ("prompt", "where"),
    [
        ([7] * NUM_IDS + ["x"], "prompt.0"),  # list[str] meets an id first
        (["x"] + [7] * NUM_IDS, "prompt.1"),
        ([[7] * NUM_IDS, [7, "x"]], "prompt.1.1"),  # the deepest error
    ],
)
def test_a_long_bad_list_gives_few_errors(prompt, where):
    with pytest.raises(ValidationError) as caught:
        CompletionRequest.model_validate({"prompt": prompt})
    assert caught.value.error_count() <= 8  # one per union member, not one per item
    message, param = validation_message(caught.value)
    assert param == where and message.startswith(f"{where}: Input should be a valid")


def _post_while_ticking(app, path: str, raw: bytes) -> tuple[httpx.Response, float]:
    """POST ``raw`` to ``app`` while a task ticks on the app's event loop; the response
    and the loop's longest stall."""

    async def main() -> tuple[httpx.Response, float]:
        stall, done = 0.0, asyncio.Event()

        async def tick() -> None:
            nonlocal stall
            last = time.perf_counter()
            while not done.is_set():
                await asyncio.sleep(0.002)
                now = time.perf_counter()
                stall, last = max(stall, now - last), now

        ticker = asyncio.create_task(tick())
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
            await asyncio.sleep(0.01)
            response = await http.post(
                path, content=raw, headers={"content-type": "application/json"}
            )
        done.set()
        await ticker
        return response, stall

    return asyncio.run(main())


@pytest.fixture(scope="module")
def app(chat_checkpoint):
    return build_app(fake_context(FakeEngine(chat_checkpoint)))


@pytest.fixture()
def parsing_threads(monkeypatch) -> list[str]:
    """The names of the threads that parse bodies, as they do."""
    names: list[str] = []
    validated = request_body._validated

    def recorded(*args):
        names.append(threading.current_thread().name)
        return validated(*args)

    monkeypatch.setattr(request_body, "_validated", recorded)
    return names


def test_a_large_bad_body_leaves_the_event_loop_free(app, parsing_threads):
    raw = json.dumps({"model": "tiny", "prompt": [7] * NUM_IDS + ["x"]}).encode()
    response, stall = _post_while_ticking(app, "/v1/completions", raw)
    assert response.status_code == 400
    error = response.json()["error"]
    assert (error["param"], error["message"]) == (
        "prompt.0",
        "prompt.0: Input should be a valid string",
    )
    assert stall < MAX_STALL_S
    assert [name.startswith("pagedlm-body") for name in parsing_threads] == [True]


def test_large_bodies_off_the_loop_small_ones_on_it(app, parsing_threads):
    text = "hello " * (request_body.INLINE_BODY_BYTES // 6)  # one prompt token per byte
    large = {"model": "tiny", "prompt": text, "max_tokens": 2, "truncate_prompt_tokens": 8}
    response, _ = _post_while_ticking(app, "/v1/completions", json.dumps(large).encode())
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["prompt_tokens"] == 8
    small = {**large, "prompt": "hello"}
    response, _ = _post_while_ticking(app, "/v1/completions", json.dumps(small).encode())
    assert response.status_code == 200, response.text
    assert parsing_threads[0].startswith("pagedlm-body")
    assert parsing_threads[1] == threading.main_thread().name  # no hop for a small body


MESSAGES = [{"role": "user", "content": [{"type": "text", "text": "Hi there"}]}]
PADDING = {"padding": "x" * (2 * request_body.INLINE_BODY_BYTES)}  # ignored, but parsed


def _prompt_tokens(answer: dict) -> object:
    usage = answer.get("usage") or {}
    return usage.get("prompt_tokens", usage.get("input_tokens", answer))


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2}),
        ("/v1/completions", {"prompt": [70, 71], "max_tokens": 2}),
        ("/v1/messages", {"messages": MESSAGES, "max_tokens": 2}),
        ("/v1/messages/count_tokens", {"messages": MESSAGES}),
        ("/v1/responses", {"input": [{"role": "user", "content": "Hi"}], "max_output_tokens": 2}),
        ("/tokenize", {"messages": MESSAGES}),
        ("/tokenize", {"prompt": "Hi there", "return_token_strs": True}),
        ("/detokenize", {"tokens": [70, 71]}),
    ],
)
def test_a_large_body_is_served_as_a_small_one(app, parsing_threads, path, body):
    """The work after parsing (conversations, token strings) moves off the loop with the
    parse, and gives the same answer."""
    answers = []
    for extra in ({}, PADDING):
        response, _ = _post_while_ticking(
            app, path, json.dumps({"model": "tiny", **body, **extra}).encode()
        )
        assert response.status_code == 200, response.text
        answers.append(_prompt_tokens(response.json()))
    assert answers[0] == answers[1]
    assert parsing_threads[0] == threading.main_thread().name
    assert parsing_threads[1].startswith("pagedlm-body")
