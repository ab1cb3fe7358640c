"""Operability through a real ``pagedlm serve``: /ready, request-supplied chat templates
(refused, or trusted and sandboxed), and grammar limits answering 400."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from server_utils import CHATML, start_server

from pagedlm.structured_output.benchmark import large_schema

SLOW_TEMPLATE = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}hi"
MESSAGES = [{"role": "user", "content": "hello"}]


MAX_SPEC_CHARS = 200_000
"""Room for a schema (1,800 properties, 166k characters) that compiles for seconds even
on a fast machine, well past the 0.5 s compile timeout; 2,500 properties (232k) is over."""


@pytest.fixture(scope="module")
def server(chat_checkpoint, tmp_path_factory):
    server = start_server(
        chat_checkpoint,
        tmp_path_factory.mktemp("logs") / "operability.log",
        "--trust-request-chat-template",
        "--structured-outputs-compile-timeout-s", "0.5",
        "--structured-outputs-max-spec-chars", str(MAX_SPEC_CHARS),
    )  # fmt: skip
    yield server
    server.stop()


def _chat(url: str, **body) -> httpx.Response:
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 1, **body}
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)


def test_request_chat_template_is_refused_without_the_flag(tiny_server):
    response = _chat(tiny_server.url, chat_template=CHATML)
    assert response.status_code == 400
    error = response.json()["error"]
    assert "--trust-request-chat-template is not set" in error["message"]
    assert error["param"] == "chat_template"
    assert _chat(tiny_server.url).status_code == 200


def test_ready_and_health(server):
    assert httpx.get(f"{server.url}/health").status_code == 200
    ready = httpx.get(f"{server.url}/ready")
    assert ready.status_code == 200
    assert ready.json()["status"] == "ok" and ready.json()["reason"] is None


def test_trusted_request_template_renders_like_the_servers(server):
    own = _chat(server.url).json()["usage"]["prompt_tokens"]
    same = _chat(server.url, chat_template=CHATML).json()["usage"]["prompt_tokens"]
    marked = _chat(server.url, chat_template="XYZ" + CHATML).json()["usage"]["prompt_tokens"]
    assert same == own and marked == own + 3  # one token per byte
    failing = _chat(server.url, chat_template="{{ raise_exception('no system role') }}")
    assert failing.status_code == 400 and "no system role" in failing.text
    greedy = _chat(server.url, chat_template="{{ 'a' * 10**10 }}")
    assert greedy.status_code == 400 and "more memory than a template may use" in greedy.text
    huge = _chat(server.url, chat_template="{# #}" * 20000)
    assert huge.status_code == 400 and "at most 65536 are accepted" in huge.text


def test_slow_request_template_is_stopped_without_blocking_health(server):
    result: dict = {}

    def slow() -> None:
        started = time.monotonic()
        result["response"] = _chat(server.url, chat_template=SLOW_TEMPLATE)
        result["seconds"] = time.monotonic() - started

    thread = threading.Thread(target=slow)
    thread.start()
    health_latencies = []
    while thread.is_alive():
        started = time.monotonic()
        assert httpx.get(f"{server.url}/health", timeout=5).status_code == 200
        health_latencies.append(time.monotonic() - started)
        time.sleep(0.2)
    thread.join()
    response = result["response"]
    assert response.status_code == 400 and "did not render within" in response.text
    print(
        f"slow template refused after {result['seconds']:.1f} s; /health max "
        f"{max(health_latencies) * 1e3:.0f} ms over {len(health_latencies)} polls"
    )
    assert max(health_latencies) < 1.0
    assert _chat(server.url, chat_template=CHATML).status_code == 200  # a fresh worker


def _structured(url: str, schema: dict) -> httpx.Response:
    body = {
        "model": "tiny",
        "prompt": "x",
        "max_tokens": 2,
        "structured_outputs": {"json": schema},
    }
    return httpx.post(f"{url}/v1/completions", json=body, timeout=60)


def test_grammar_limits_answer_400_and_small_schemas_do_not_wait(server):
    too_big = _structured(server.url, large_schema(2500))
    assert too_big.status_code == 400
    assert "--structured-outputs-max-spec-chars" in too_big.json()["error"]["message"]

    slow = {}

    def compile_slowly() -> None:
        slow["response"] = _structured(server.url, large_schema(1800))  # seconds to compile

    thread = threading.Thread(target=compile_slowly)
    thread.start()
    time.sleep(0.2)
    started = time.monotonic()
    small = _structured(server.url, {"type": "object", "properties": {"a": {"type": "integer"}}})
    small_s = time.monotonic() - started
    thread.join()
    assert small.status_code == 200, small.text
    response = slow["response"]
    assert response.status_code == 400, response.text
    message = response.json()["error"]["message"]
    assert "longer than 0.5 s" in message and "--structured-outputs-compile-timeout-s" in message
    print(f"small schema answered in {small_s:.2f} s while a large one compiled")
    assert json.loads(httpx.get(f"{server.url}/ready").text)["status"] == "ok"
