"""OpenTelemetry tracing (``--otlp-traces-endpoint``): one span per finished request.

Off by default and then free: this module (and the OpenTelemetry SDK) is imported only
when the flag is given; the server then wraps its app in ``TraceContextMiddleware`` and
gives its ``ServingContext`` a ``RequestTracer``.

- The W3C ``traceparent``/``tracestate`` headers of an HTTP request become the parent of
  its span: the middleware keeps them in a context variable, which the request's tasks
  inherit, and ``RequestTracer.trace`` reads it when the engine's stream starts.
- A span (named ``llm_request``, kind SERVER, as vLLM's) starts at the request's arrival
  and ends when its last sample finishes, with vLLM's attribute names (``SpanAttributes``).
  Requests that end early (client gone, aborted, failed) get no span, as in vLLM.
- Spans leave through a ``BatchSpanProcessor`` to an OTLP/HTTP (protobuf) exporter; the
  SDK's ``OTEL_*`` environment variables (``OTEL_BSP_SCHEDULE_DELAY``, headers, ...) apply.

Needs the ``tracing`` extra: ``pip install 'pagedlm[tracing]'``.
"""

from __future__ import annotations

import contextvars
import time
from collections.abc import AsyncIterator, Mapping
from typing import Any

from starlette.types import ASGIApp, Receive, Scope, Send

from pagedlm.outputs import RequestOutput
from pagedlm.sampling_params import SamplingParams

TRACE_HEADERS = ("traceparent", "tracestate")
_trace_headers: contextvars.ContextVar[Mapping[str, str] | None] = contextvars.ContextVar(
    "pagedlm_trace_headers", default=None
)


class SpanAttributes:
    """vLLM's span attribute names (OpenTelemetry's gen_ai conventions plus its own)."""

    GEN_AI_USAGE_COMPLETION_TOKENS = "gen_ai.usage.completion_tokens"
    GEN_AI_USAGE_PROMPT_TOKENS = "gen_ai.usage.prompt_tokens"
    GEN_AI_USAGE_NUM_SEQUENCES = "gen_ai.usage.num_sequences"
    GEN_AI_REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
    GEN_AI_REQUEST_TOP_P = "gen_ai.request.top_p"
    GEN_AI_REQUEST_TEMPERATURE = "gen_ai.request.temperature"
    GEN_AI_REQUEST_ID = "gen_ai.request.id"
    GEN_AI_REQUEST_N = "gen_ai.request.n"
    GEN_AI_RESPONSE_MODEL = "gen_ai.response.model"
    GEN_AI_RESPONSE_FINISH_REASONS = "gen_ai.response.finish_reasons"
    GEN_AI_LATENCY_TIME_IN_QUEUE = "gen_ai.latency.time_in_queue"
    GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN = "gen_ai.latency.time_to_first_token"
    GEN_AI_LATENCY_E2E = "gen_ai.latency.e2e"
    GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL = "gen_ai.latency.time_in_model_prefill"
    GEN_AI_LATENCY_TIME_IN_MODEL_DECODE = "gen_ai.latency.time_in_model_decode"
    GEN_AI_LATENCY_TIME_IN_MODEL_INFERENCE = "gen_ai.latency.time_in_model_inference"


class TraceContextMiddleware:
    """Keeps an HTTP request's W3C trace headers for the spans of its engine requests."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {}
        for key, value in scope.get("headers", ()):
            name = key.decode("latin-1").lower()
            if name in TRACE_HEADERS:
                headers[name] = value.decode("latin-1")
        token = _trace_headers.set(headers or None)
        try:
            await self.app(scope, receive, send)
        finally:
            _trace_headers.reset(token)


def make_tracer_provider(endpoint: str) -> Any:
    """A ``TracerProvider`` exporting to ``endpoint`` (an OTLP/HTTP traces URL); a clear
    error when the extra is missing or the endpoint is not http(s)."""
    if not endpoint.startswith(("http://", "https://")):
        raise ValueError(
            f"--otlp-traces-endpoint {endpoint!r}: pagedlm exports OTLP over HTTP; give the "
            "collector's traces URL, e.g. http://localhost:4318/v1/traces."
        )
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError as error:
        raise ValueError(
            f"--otlp-traces-endpoint needs OpenTelemetry ({error.name} is missing); "
            "pip install 'pagedlm[tracing]'."
        ) from None
    provider = TracerProvider(resource=Resource.create({"service.name": "pagedlm"}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    return provider


class RequestTracer:
    """Wraps a request's output stream; emits its span when the request finishes."""

    def __init__(self, provider: Any, model_name: str) -> None:
        from opentelemetry.trace import SpanKind
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.provider = provider
        self.model_name = model_name
        self._tracer = provider.get_tracer("pagedlm.entrypoints.openai")
        self._propagator = TraceContextTextMapPropagator()
        self._server_kind = SpanKind.SERVER

    async def trace(
        self, stream: AsyncIterator[RequestOutput], request_id: str, params: SamplingParams
    ) -> AsyncIterator[RequestOutput]:
        """``stream`` unchanged (DELTA outputs), plus a span once it finished."""
        headers = _trace_headers.get()
        parent = self._propagator.extract(headers) if headers else None
        finish_reasons: dict[int, str] = {}
        num_tokens = 0
        try:
            async for output in stream:
                for completion in output.outputs:
                    num_tokens += len(completion.token_ids)
                    if completion.finish_reason is not None:
                        finish_reasons[completion.index] = completion.finish_reason
                if output.finished:
                    reasons = [finish_reasons[i] for i in sorted(finish_reasons)]
                    self._emit(output, request_id, params, parent, num_tokens, reasons)
                yield output
        finally:
            await stream.aclose()  # closing the wrapper closes (aborts) the engine's stream

    def _emit(
        self,
        output: RequestOutput,
        request_id: str,
        params: SamplingParams,
        parent: Any,
        num_tokens: int,
        finish_reasons: list[str],
    ) -> None:
        times = output.metrics
        now_ns, now = time.time_ns(), time.monotonic()
        arrival = times.get("arrival_time", now)
        start_ns = now_ns - int((now - arrival) * 1e9)  # monotonic arrival -> wall clock
        attributes = {
            SpanAttributes.GEN_AI_REQUEST_ID: request_id,
            SpanAttributes.GEN_AI_RESPONSE_MODEL: self.model_name,
            SpanAttributes.GEN_AI_USAGE_PROMPT_TOKENS: len(output.prompt_token_ids),
            SpanAttributes.GEN_AI_USAGE_COMPLETION_TOKENS: num_tokens,
            SpanAttributes.GEN_AI_USAGE_NUM_SEQUENCES: len(finish_reasons),
            SpanAttributes.GEN_AI_REQUEST_N: params.n,
            SpanAttributes.GEN_AI_REQUEST_TEMPERATURE: params.temperature,
            SpanAttributes.GEN_AI_REQUEST_TOP_P: params.top_p,
            SpanAttributes.GEN_AI_RESPONSE_FINISH_REASONS: finish_reasons,
            SpanAttributes.GEN_AI_LATENCY_E2E: times.get("e2e_latency", now - arrival),
        }
        if params.max_tokens is not None:
            attributes[SpanAttributes.GEN_AI_REQUEST_MAX_TOKENS] = params.max_tokens
        attributes.update(_phase_latencies(times, arrival))
        span = self._tracer.start_span(
            "llm_request",
            context=parent,
            kind=self._server_kind,
            attributes=attributes,
            start_time=start_ns,
        )
        span.end(end_time=now_ns)


def _phase_latencies(times: Mapping[str, float], arrival: float) -> dict[str, float]:
    """Queue, TTFT, prefill, decode and inference seconds, from what the engine reported
    (an engine that does not report scheduling counts no queue time)."""
    scheduled = times.get("first_scheduled_time", arrival)
    first = times.get("first_token_time")
    last = times.get("last_token_time")
    latencies = {SpanAttributes.GEN_AI_LATENCY_TIME_IN_QUEUE: max(scheduled - arrival, 0.0)}
    if first is not None and last is not None:
        latencies[SpanAttributes.GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN] = first - arrival
        latencies[SpanAttributes.GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL] = max(first - scheduled, 0)
        latencies[SpanAttributes.GEN_AI_LATENCY_TIME_IN_MODEL_DECODE] = last - first
        latencies[SpanAttributes.GEN_AI_LATENCY_TIME_IN_MODEL_INFERENCE] = max(last - scheduled, 0)
    return latencies
