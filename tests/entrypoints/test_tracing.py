"""--otlp-traces-endpoint: an OTLP/HTTP receiver in the test gets one span per request,
with vLLM's attribute names and the trace id of the request's W3C traceparent; without
the flag nothing of OpenTelemetry's SDK is imported."""

from __future__ import annotations

import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from starlette.testclient import TestClient

from pagedlm.entrypoints.openai.app import build_app
from pagedlm.entrypoints.openai.serving_engine import ServingContext
from pagedlm.entrypoints.openai.tracing import (
    RequestTracer,
    TraceContextMiddleware,
    make_tracer_provider,
)
from pagedlm.metrics.prometheus import PrometheusMetrics
from server.fake_engine import FakeEngine

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_SPAN_ID = "00f067aa0ba902b7"


class Receiver(ThreadingHTTPServer):
    """Collects the spans of every OTLP/HTTP export request it is sent."""

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _ExportHandler)
        self.spans: list = []
        self.paths: list[str] = []


class _ExportHandler(BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["content-length"]))
        request = ExportTraceServiceRequest.FromString(body)
        for resource_spans in request.resource_spans:
            for scope_spans in resource_spans.scope_spans:
                self.server.spans.extend(scope_spans.spans)
        self.server.paths.append(self.path)
        answer = ExportTraceServiceResponse().SerializeToString()
        self.send_response(200)
        self.send_header("content-type", "application/x-protobuf")
        self.send_header("content-length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def receiver():
    server = Receiver()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()
    thread.join()


def attributes(span) -> dict:
    result = {}
    for attribute in span.attributes:
        value = attribute.value
        kind = value.WhichOneof("value")
        if kind == "array_value":
            result[attribute.key] = [v.string_value for v in value.array_value.values]
        else:
            result[attribute.key] = getattr(value, kind)
    return result


def test_one_span_per_request_with_parent(receiver, chat_checkpoint):
    provider = make_tracer_provider(f"http://127.0.0.1:{receiver.server_port}/v1/traces")
    engine = FakeEngine(chat_checkpoint, num_tokens=3)
    ctx = ServingContext(
        engine=engine,
        model_names=["tiny"],
        metrics=PrometheusMetrics("tiny"),
        tokenizer=engine.get_tokenizer(),
        tracer=RequestTracer(provider, "tiny"),
    )
    try:
        with TestClient(TraceContextMiddleware(build_app(ctx))) as client:
            traced = client.post(
                "/v1/completions",
                json={"model": "tiny", "prompt": "hello", "max_tokens": 8, "n": 2},
                headers={"traceparent": f"00-{TRACE_ID}-{PARENT_SPAN_ID}-01"},
            )
            assert traced.status_code == 200, traced.text
            chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
            plain = client.post("/v1/chat/completions", json={**chat, "max_tokens": 2})
            assert plain.status_code == 200, plain.text
    finally:
        provider.shutdown()  # exports what is queued

    assert receiver.paths and set(receiver.paths) == {"/v1/traces"}
    assert len(receiver.spans) == 2
    by_trace = {span.trace_id.hex(): span for span in receiver.spans}
    span = by_trace.pop(TRACE_ID)
    assert span.name == "llm_request"
    assert span.parent_span_id.hex() == PARENT_SPAN_ID
    found = attributes(span)
    assert found["gen_ai.request.id"].startswith("cmpl-")
    assert found["gen_ai.usage.prompt_tokens"] == len("hello")
    assert found["gen_ai.usage.completion_tokens"] == 2 * 3
    assert found["gen_ai.request.n"] == 2
    assert found["gen_ai.request.max_tokens"] == 8
    assert found["gen_ai.response.finish_reasons"] == ["stop", "stop"]
    assert found["gen_ai.response.model"] == "tiny"
    for name in (
        "gen_ai.latency.e2e",
        "gen_ai.latency.time_to_first_token",
        "gen_ai.latency.time_in_queue",
        "gen_ai.latency.time_in_model_prefill",
        "gen_ai.latency.time_in_model_decode",
        "gen_ai.latency.time_in_model_inference",
    ):
        assert found[name] >= 0, name
    assert found["gen_ai.latency.e2e"] >= found["gen_ai.latency.time_to_first_token"]
    assert span.end_time_unix_nano > span.start_time_unix_nano
    (other,) = by_trace.values()  # no traceparent: a trace of its own, no parent
    assert other.parent_span_id == b""
    assert attributes(other)["gen_ai.response.finish_reasons"] == ["length"]


def test_bad_endpoint_names_the_fix():
    with pytest.raises(ValueError, match="OTLP over HTTP"):
        make_tracer_provider("grpc://localhost:4317")


def test_off_imports_nothing_of_opentelemetry_sdk():
    code = (
        "import argparse, sys\n"
        "from pagedlm.entrypoints.openai import api_server, app, server_args\n"
        "args = server_args.add_server_args(argparse.ArgumentParser()).parse_args([])\n"
        "assert args.otlp_traces_endpoint is None\n"
        "assert api_server._tracer_provider(args.otlp_traces_endpoint) is None\n"
        "loaded = [m for m in sys.modules if m.startswith('opentelemetry.sdk') "
        "or m == 'pagedlm.entrypoints.openai.tracing']\n"
        "assert not loaded, loaded\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
