"""``/v1/responses`` against OpenAI's documented Responses API (and vLLM's, where users rely
on it), over HTTP to the app with a scripted engine: which request fields are served,
which field a 400 names, what usage reports.

``ScriptedEngine`` writes its script one token per byte, then EOS; the tiny tokenizer has
one token per byte, so a token count is a byte count of the rendered prompt.
"""

from __future__ import annotations

import pytest
from fake_engine import ScriptedEngine, fake_context
from starlette.testclient import TestClient

from pagedlm.entrypoints.openai.app import build_app

EFFORT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if reasoning_effort is defined %}effort={{ reasoning_effort }}\n{% endif %}assistant:"
)


def _client(checkpoint, script: str = "Hi.", engine=None, **server_flags) -> TestClient:
    engine = engine or ScriptedEngine(checkpoint, script)
    return TestClient(build_app(fake_context(engine, **server_flags)))


def _create(client: TestClient, **body) -> dict:
    response = client.post("/v1/responses", json={"model": "tiny", "input": "Hi", **body})
    assert response.status_code == 200, response.text
    return response.json()


def _error(client: TestClient, **body) -> dict:
    response = client.post("/v1/responses", json={"model": "tiny", "input": "Hi", **body})
    assert response.status_code == 400, response.text
    return response.json()["error"]


def test_reasoning_effort_reaches_the_chat_template_and_is_echoed(chat_checkpoint):
    """OpenAI's ``reasoning`` ({"effort", "summary"}) is served as chat's
    ``reasoning_effort`` (handed to the chat template, as vLLM hands it to gpt-oss's
    prompt); the response echoes the config. It was a 400 for any effort."""
    with _client(chat_checkpoint, chat_template=EFFORT_TEMPLATE) as client:
        plain = _create(client)
        assert plain["reasoning"] == {"effort": None, "summary": None}
        reasoning = {"effort": "high", "summary": "auto"}
        high = _create(client, reasoning=reasoning)
        assert high["reasoning"] == reasoning
        assert high["usage"]["input_tokens"] == plain["usage"]["input_tokens"] + len(
            "effort=high\n"
        )
        error = _error(client, reasoning={"effort": "extreme"})
        assert error["param"] == "reasoning.effort"


@pytest.mark.parametrize(
    ("body", "param", "not_named"),
    [
        ({"max_output_tokens": 100_000}, "max_output_tokens", "max_tokens"),
        (
            {"tools": [{"type": "function", "name": "f", "parameters": 5}]},
            "tools.0.parameters",
            "function",
        ),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema", "response_format"),
    ],
)  # fmt: skip
def test_a_400_names_the_responses_field_not_the_chat_field(
    chat_checkpoint, body, param, not_named
):
    """The request is served by the chat path; its errors named chat's fields
    (max_tokens, tools.0.function.parameters, response_format), which a Responses
    request does not have."""
    with _client(chat_checkpoint) as client:
        for stream in (False, True):
            error = _error(client, stream=stream, **body)
            assert error["param"] == param, error
            assert param in error["message"] and not_named not in error["message"], error


class CachingEngine(ScriptedEngine):
    """Reports ``num_cached`` of every prompt's tokens as served by the prefix cache."""

    num_cached = 16

    def _step(self, child_id, processed, step):
        output = super()._step(child_id, processed, step)
        return output._replace(num_cached_tokens=self.num_cached)


def test_usage_reports_cached_input_tokens(chat_checkpoint):
    """With ``--enable-prompt-tokens-details`` chat reports the prompt's cached tokens;
    a response's ``input_tokens_details.cached_tokens`` said 0 whatever the cache did."""
    engine = CachingEngine(chat_checkpoint, "Hi.")
    with _client(chat_checkpoint, engine=engine, enable_prompt_tokens_details=True) as client:
        usage = _create(client)["usage"]
        assert usage["input_tokens_details"] == {"cached_tokens": CachingEngine.num_cached}
        stream = client.post("/v1/responses", json={"model": "tiny", "input": "Hi", "stream": True})
        assert f'"cached_tokens": {CachingEngine.num_cached}' in stream.text.splitlines()[-2]
