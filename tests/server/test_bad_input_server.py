"""The malformed requests of issue 22 against a real ``pagedlm serve``: each is a 400 in
the route's error shape whose message names the field, and the server serves normally
afterwards. Also: unknown fields are reported, ``guided_*`` still work."""

from __future__ import annotations

import json

import httpx
import pytest

JSON = {"content-type": "application/json"}
PROMPT = '{"model": "tiny", "prompt": "x", "max_tokens": 2'
CHAT = '{"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": %s}]'
CLAUDE = '{"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": %s}]'


def _completion(extra: str) -> bytes:
    return (PROMPT + extra + "}").encode()


CASES = [
    ("/v1/completions", b"[" * 10_000 + b"]" * 10_000, "deeper than 64 levels"),
    ("/v1/completions", _completion(', "seed": 18446744073709551616'), "seed"),
    ("/v1/completions", _completion(', "seed": -9223372036854775809'), "seed"),
    ("/v1/completions", _completion(', "temperature": NaN'), "NaN"),
    ("/v1/completions", _completion(', "temperature": Infinity'), "Infinity"),
    ("/v1/completions", _completion(', "temperature": 1e999'), "1e999"),
    ("/v1/completions", _completion(', "temperature": "NaN"'), "temperature"),
    ("/v1/completions", _completion(', "repetition_penalty": NaN'), "NaN"),
    ("/v1/completions", _completion(', "logit_bias": {"5": NaN}'), "NaN"),
    ("/v1/completions", _completion(', "temperature": 1e308'), "temperature"),
    ("/v1/completions", _completion(', "top_k": 1000000000'), "top_k"),
    ("/v1/completions", _completion(', "max_tokens": 3'), "'max_tokens' appears more than once"),
    ("/v1/completions", _completion(', "stop": ' + json.dumps(["a"] * 10_000)), "--max-stop-strings"),
    (
        "/v1/completions",
        _completion(', "logit_bias": ' + json.dumps({str(i): 1 for i in range(49_000)})),
        "--max-logit-bias-tokens",
    ),
    ("/v1/completions", _completion(', "stop_token_ids": [100000000000000000000000]'), "stop_token_ids"),
    ("/v1/completions", b'"just a string"', "must be a JSON object"),
    ("/v1/completions", _completion(', "stream_options": {"include_usage": true}'), "send stream=true or drop stream_options"),
    ("/v1/chat/completions", (CHAT % '"hi"' + ', "stream": false, "stream_options": {"include_usage": true}}').encode(), "send stream=true or drop stream_options"),
    # These reached the engine core, whose decoder refused them and died.
    ("/v1/completions", _completion(', "structured_outputs": {"json_object": "yes"}'), "json_object must be true or null"),
    ("/v1/completions", _completion(', "structured_outputs": {"regex": "a", "disable_any_whitespace": 5}'), "disable_any_whitespace"),
    ("/v1/completions", _completion(', "structured_outputs": {"choice": "ab"}'), "choice must be a non-empty list of strings"),
    # A text part without text is skipped, as vLLM skips it; one whose text is no string is not.
    ("/v1/chat/completions", (CHAT % '[{"type": "text", "text": 5}]' + "}").encode(), "messages.0.content.0"),
    ("/v1/chat/completions", (CHAT % '[{"type": "image_url", "image_url": {"url": "u"}}]' + "}").encode(), "text-only"),
    ("/v1/chat/completions", json.dumps({"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{bad"}}]}]}).encode(), "messages.1.tool_calls.0.function.arguments is not valid JSON"),
    ("/v1/responses", json.dumps({"model": "tiny", "max_output_tokens": 2, "input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{bad"}]}).encode(), "input.0.arguments is not valid JSON"),
    ("/v1/messages", (CLAUDE % '"hi"' + ', "temperature": NaN}').encode(), "NaN"),
    ("/v1/messages", (CLAUDE % '[{"type": "text"}]' + "}").encode(), 'messages.0.content.0: a "text" block'),
    ("/v1/messages", (CLAUDE % '"hi"' + ', "stop_sequences": ' + json.dumps(["s"] * 5) + "}").encode(), "stop_sequences"),
]  # fmt: skip


@pytest.mark.parametrize(("path", "body", "needle"), CASES)
def test_malformed_request_is_a_400_naming_the_problem(tiny_server, path, body, needle):
    response = httpx.post(f"{tiny_server.url}{path}", content=body, headers=JSON, timeout=60)
    assert response.status_code == 400, response.text
    payload = response.json()
    message = payload["error"]["message"]
    if path.startswith("/v1/messages"):
        assert payload["type"] == "error" and payload["error"]["type"] == "invalid_request_error"
    else:
        assert payload["error"]["code"] == 400
    assert needle in message, message


def test_server_still_serves_after_bad_input(tiny_server):
    for path, body, _ in CASES:
        httpx.post(f"{tiny_server.url}{path}", content=body, headers=JSON, timeout=60)
    assert httpx.get(f"{tiny_server.url}/health").status_code == 200
    body = {"model": "tiny", "prompt": "x", "max_tokens": 3, "ignore_eos": True}
    response = httpx.post(f"{tiny_server.url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 3


def test_unknown_fields_are_listed_and_guided_fields_still_work(tiny_server):
    body = {
        "model": "tiny",
        "prompt": "Answer:",
        "max_tokens": 5,
        "guided_choice": ["yes", "no"],
        "frobnicate": 1,
        "stream": True,  # stream_options needs it (vLLM's rule)
        "stream_options": {"include_usage": True, "sparkle": 2},
    }
    response = httpx.post(f"{tiny_server.url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    events = [
        json.loads(line.removeprefix("data: "))
        for line in response.text.splitlines()
        if line.startswith("data: {")
    ]
    assert "".join(c["text"] for e in events for c in e["choices"]) in ("yes", "no")
    warning = response.headers["warning"]
    assert "ignored unknown fields: frobnicate, stream_options.sparkle" in warning
    assert "guided_choice is deprecated" in warning
    both = {**body, "structured_outputs": {"regex": "a+"}}
    conflict = httpx.post(f"{tiny_server.url}/v1/completions", json=both, timeout=60)
    assert conflict.status_code == 400 and "not both" in conflict.json()["error"]["message"]
    plain = httpx.post(
        f"{tiny_server.url}/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 1}
    )
    assert "warning" not in plain.headers
    log = tiny_server.log_text()
    assert log.count("'frobnicate' is not known") == 1  # logged once per field name
