"""Schemathesis against ``/openapi.json``, in process over ``FakeEngine``: generated
bodies (valid and invalid by the schema) to every route, and no answer may be a 5xx.

The default run is small (CI); ``-m slow`` asks for 1,000 examples per route and
generation mode plus schemathesis' boundary-value (coverage) cases, and prints how many
cases each route answered with which status class (``-s`` to see it).
"""

from __future__ import annotations

import collections

import pytest
import schemathesis
from fake_engine import FakeEngine, fake_context
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error

from pagedlm.entrypoints.openai.app import build_app

FAST_EXAMPLES = 8
SLOW_EXAMPLES = 1000
"""Per generation mode (valid and invalid bodies). Hypothesis stops short of it on these
schemas: 500 gave 528-992 cases per body route (23 min on a loaded 2-core machine)."""
PROGRESS_EVERY = 250
FUZZ_SETTINGS = dict(deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
STATUSES: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)


def _app(checkpoint):
    return build_app(fake_context(FakeEngine(checkpoint)))


def _config(coverage: bool) -> schemathesis.Config:
    return schemathesis.Config.from_dict(
        {"phases": {"coverage": {"enabled": coverage}, "stateful": {"enabled": False}}}
    )


@pytest.fixture(scope="module")
def fast_schema(chat_checkpoint):
    return schemathesis.openapi.from_asgi(
        "/openapi.json", _app(chat_checkpoint), config=_config(coverage=False)
    )


@pytest.fixture(scope="module")
def full_schema(chat_checkpoint):
    return schemathesis.openapi.from_asgi(
        "/openapi.json", _app(chat_checkpoint), config=_config(coverage=True)
    )


fast = schemathesis.pytest.from_fixture("fast_schema")
full = schemathesis.pytest.from_fixture("full_schema")


def _call(case) -> None:
    mode = case.meta.generation.mode.value if case.meta is not None else "explicit"
    if mode == "positive" and isinstance(case.body, dict) and "model" in case.body:
        case.body["model"] = "tiny"  # a random name is a 404 before anything else runs
    response = case.call_and_validate(checks=[not_a_server_error])
    counts = STATUSES[f"{case.method} {case.path} ({mode})"]
    counts[f"{response.status_code // 100}xx"] += 1
    if sum(counts.values()) % PROGRESS_EVERY == 0:
        print(f"{case.method} {case.path} ({mode}): {dict(sorted(counts.items()))}", flush=True)


@fast.parametrize()
@settings(max_examples=FAST_EXAMPLES, **FUZZ_SETTINGS)
def test_generated_requests_get_no_server_error(case):
    _call(case)


@pytest.mark.slow
@full.parametrize()
@settings(max_examples=SLOW_EXAMPLES, **FUZZ_SETTINGS)
def test_many_generated_requests_get_no_server_error(case):
    _call(case)


def test_every_body_route_is_described(fast_schema):
    raw = fast_schema.raw_schema
    bodies = {
        path: operation["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        for path, item in raw["paths"].items()
        for operation in item.values()
        if "requestBody" in operation
    }
    assert bodies == {
        "/v1/completions": "#/components/schemas/CompletionRequest",
        "/v1/chat/completions": "#/components/schemas/ChatCompletionRequest",
        "/v1/messages": "#/components/schemas/MessagesRequest",
        "/v1/messages/count_tokens": "#/components/schemas/CountTokensRequest",
        "/v1/embeddings": "#/components/schemas/EmbeddingRequest",
        "/tokenize": "#/components/schemas/TokenizeRequest",
        "/detokenize": "#/components/schemas/DetokenizeRequest",
        "/v1/load_lora_adapter": "#/components/schemas/LoadLoRAAdapterRequest",
        "/v1/unload_lora_adapter": "#/components/schemas/UnloadLoRAAdapterRequest",
        "/v1/responses": "#/components/schemas/ResponsesRequest",
        "/classify": "#/components/schemas/ClassificationRequest",
        "/pooling": "#/components/schemas/PoolingRequest",
        "/score": "#/components/schemas/ScoreRequest",
        "/v1/score": "#/components/schemas/ScoreRequest",
        "/rerank": "#/components/schemas/RerankRequest",
        "/v1/rerank": "#/components/schemas/RerankRequest",
        "/v2/rerank": "#/components/schemas/RerankRequest",
    }
    schemas = raw["components"]["schemas"]
    assert {"ChatMessage", "AnthropicMessage", "ContentPart"} <= set(schemas)
    assert schemas["CompletionRequest"]["properties"]["guided_json"]["deprecated"] is True


def test_zz_report(capsys):
    """Prints the status classes per route of the fuzz runs above (with ``-s``)."""
    with capsys.disabled():
        for route, counts in sorted(STATUSES.items()):
            print(f"{route}: {sum(counts.values())} cases, {dict(sorted(counts.items()))}")
    assert all("5xx" not in counts for counts in STATUSES.values())
