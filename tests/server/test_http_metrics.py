"""vLLM's ``http_*`` series on /metrics (prometheus-fastapi-instrumentator's defaults with
vLLM's excluded handlers): names, label conventions, what is left out, and streams timed
to their last byte."""

from __future__ import annotations

import json

from fake_engine import FakeEngine, fake_context
from prometheus_client.parser import text_string_to_metric_families
from starlette.testclient import TestClient

from pagedlm.entrypoints.openai.app import build_app

COMPLETION = {"model": "tiny", "prompt": "hello there", "max_tokens": 2}


def _families(client: TestClient) -> dict[str, list]:
    response = client.get("/metrics")
    assert response.status_code == 200
    return {
        family.name: family.samples
        for family in text_string_to_metric_families(response.text)
        if family.name.startswith("http_")
    }


def _value(samples: list, name: str, **labels: str) -> float:
    [value] = [s.value for s in samples if s.name == name and s.labels == labels]
    return value


def test_series_names_labels_and_excluded_handlers(chat_checkpoint):
    app = build_app(fake_context(FakeEngine(chat_checkpoint)))
    body, bad = json.dumps(COMPLETION).encode(), b'{"model": "tiny"}'
    with TestClient(app) as client:
        assert client.post("/v1/completions", content=body).status_code == 200
        assert client.post("/v1/completions", content=bad).status_code == 400
        models = client.get("/v1/models")
        assert client.get("/no/such/route").status_code == 404
        for path in ("/health", "/ping", "/version", "/load", "/metrics"):  # vLLM's exclusions
            client.get(path)
        families = _families(client)

    names = {
        "http_requests",
        "http_request_size_bytes",
        "http_response_size_bytes",
        "http_request_duration_highr_seconds",
        "http_request_duration_seconds",
    }
    # prometheus_client's ``*_created`` series beside each, as on vLLM's /metrics.
    assert set(families) == names | {f"{name}_created" for name in names}
    requests = families["http_requests"]
    completions = {"handler": "/v1/completions", "method": "POST"}
    assert _value(requests, "http_requests_total", **completions, status="2xx") == 1
    assert _value(requests, "http_requests_total", **completions, status="4xx") == 1
    # A path no route has is counted under handler "none".
    assert _value(requests, "http_requests_total", handler="none", method="GET", status="4xx") == 1
    handlers = {s.labels["handler"] for f in families.values() for s in f if "handler" in s.labels}
    assert handlers == {"/v1/completions", "/v1/models", "none"}

    sizes = families["http_request_size_bytes"]
    size_sum = _value(sizes, "http_request_size_bytes_sum", handler="/v1/completions")
    assert size_sum == len(body) + len(bad)
    responses = families["http_response_size_bytes"]
    models_size = _value(responses, "http_response_size_bytes_sum", handler="/v1/models")
    assert models_size == len(models.content)

    lowr = families["http_request_duration_seconds"]
    buckets = {s.labels["le"] for s in lowr if s.name.endswith("_bucket")}
    assert buckets == {"0.1", "0.5", "1.0", "+Inf"}
    assert {frozenset(s.labels) for s in lowr if s.name.endswith("_count")} == {
        frozenset({"handler", "method"})
    }
    highr = families["http_request_duration_highr_seconds"]
    assert all(set(s.labels) <= {"le"} for s in highr)
    assert _value(highr, "http_request_duration_highr_seconds_count") == 4
    assert len([s for s in highr if s.name.endswith("_bucket")]) == 22


def test_a_stream_is_timed_to_its_end(chat_checkpoint):
    """Five engine steps of 0.1 s: the stream's duration covers them all, not just the
    time to its headers."""
    engine = FakeEngine(chat_checkpoint, num_tokens=5, step_s=0.1)
    app = build_app(fake_context(engine))
    with TestClient(app) as client:
        streamed = client.post(
            "/v1/completions", json={**COMPLETION, "max_tokens": 5, "stream": True}
        )
        assert streamed.status_code == 200 and streamed.text.endswith("data: [DONE]\n\n")
        families = _families(client)
    lowr = families["http_request_duration_seconds"]
    labels = {"handler": "/v1/completions", "method": "POST"}
    assert _value(lowr, "http_request_duration_seconds_count", **labels) == 1
    assert _value(lowr, "http_request_duration_seconds_sum", **labels) >= 0.5
    # A stream has no Content-Length: its size is the library's 0.
    responses = families["http_response_size_bytes"]
    assert _value(responses, "http_response_size_bytes_sum", handler="/v1/completions") == 0
