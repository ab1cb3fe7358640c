"""Prometheus exposition of the engine's metrics, named like vLLM's with a ``pagedlm:`` prefix.

Two sources feed one private registry (nothing is added to prometheus_client's global one):

- the engine's own counters and gauges (``AsyncLLM.get_metrics()``, refreshed with
  ``get_scheduler_stats()`` before each scrape), exposed through a custom collector;
- per-request latency histograms, observed by the server from ``RequestOutput.metrics``
  as outputs stream past (``observe_output``).

Importing this module imports ``prometheus_client``; only the server does.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from pagedlm.metrics.stats import Metric as EngineMetric
from pagedlm.outputs import RequestOutput

_DOCS = {
    "pagedlm:num_requests_running": "Number of requests in model execution batches.",
    "pagedlm:num_requests_waiting": "Number of requests waiting to be processed.",
    "pagedlm:kv_cache_usage_perc": "KV-cache usage: 1 means 100 percent.",
    "pagedlm:num_preemptions": "Cumulative number of preemptions.",
    "pagedlm:prefix_cache_queries": "Prefix-cache queries, in tokens.",
    "pagedlm:prefix_cache_hits": "Prefix-cache hits, in tokens.",
    "pagedlm:prompt_tokens": "Number of prefill tokens processed.",
    "pagedlm:generation_tokens": "Number of generation tokens processed.",
    "pagedlm:request_success": "Count of successfully finished requests.",
    "pagedlm:spec_decode_num_drafts": "Number of spec decoding drafts (verification steps).",
    "pagedlm:spec_decode_num_draft_tokens": "Number of draft tokens verified.",
    "pagedlm:spec_decode_num_accepted_tokens": "Number of accepted draft tokens.",
    "pagedlm:spec_decode_num_accepted_tokens_per_pos": "Accepted draft tokens per position.",
    "pagedlm:lora_requests_info": "Running and waiting LoRA adapters (value: update time).",
}

_LATENCY_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip


class _EngineMetricsCollector:
    """Turns the latest ``list[EngineMetric]`` into Prometheus metric families."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.latest: list[EngineMetric] = []

    def collect(self) -> Iterable[Metric]:
        grouped: dict[tuple[str, str], list[EngineMetric]] = defaultdict(list)
        for metric in self.latest:
            grouped[(metric.name, metric.kind)].append(metric)
        for (name, kind), samples in grouped.items():
            label_names = ["model_name", *sorted(samples[0].labels)]
            family_type = GaugeMetricFamily if kind == "gauge" else CounterMetricFamily
            family = family_type(name, _DOCS.get(name, name), labels=label_names)
            for sample in samples:
                values = [self.model_name, *(sample.labels[k] for k in label_names[1:])]
                family.add_metric(values, sample.value)
            yield family


class PrometheusMetrics:
    """The server's metrics registry. ``render()`` gives the text exposition format."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self._engine = _EngineMetricsCollector(model_name)
        self.registry.register(self._engine)
        labels = ["model_name"]

        def histogram(name: str, doc: str) -> Histogram:
            metric = Histogram(name, doc, labels, registry=self.registry, buckets=_LATENCY_BUCKETS)
            return metric.labels(model_name)

        self.time_to_first_token = histogram(
            "pagedlm:time_to_first_token_seconds", "Time to first token in seconds."
        )
        self.inter_token_latency = histogram(
            "pagedlm:inter_token_latency_seconds", "Latency between generated tokens in seconds."
        )
        self.e2e_request_latency = histogram(
            "pagedlm:e2e_request_latency_seconds", "End-to-end request latency in seconds."
        )
        self.request_queue_time = histogram(
            "pagedlm:request_queue_time_seconds",
            "Time from arrival until the request was first scheduled, in seconds.",
        )

    def update_engine_metrics(self, metrics: list[EngineMetric]) -> None:
        self._engine.latest = list(metrics)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestLatencyTracker:
    """Observes one request's latency histograms from its stream of DELTA outputs.

    ``RequestOutput.metrics`` carries monotonic times: ``arrival_time``, ``first_token_time``,
    ``last_token_time``, ``finished_time`` (when finished) and, when the engine reports it,
    ``first_scheduled_time``. Inter-token latency is observed once per new token: the gap
    between two outputs divided evenly over the tokens the later one brought.
    """

    def __init__(self, metrics: PrometheusMetrics) -> None:
        self.metrics = metrics
        self.last_token_time: float | None = None
        self.done = False

    def observe(self, output: RequestOutput) -> None:
        if self.done:
            return
        times = output.metrics
        last = times.get("last_token_time")
        new_tokens = sum(len(c.token_ids) for c in output.outputs)
        if last is not None and new_tokens > 0:
            if self.last_token_time is None:
                ttft = times.get("time_to_first_token")
                if ttft is not None:
                    self.metrics.time_to_first_token.observe(ttft)
                if "first_scheduled_time" in times and "arrival_time" in times:
                    queued = times["first_scheduled_time"] - times["arrival_time"]
                    self.metrics.request_queue_time.observe(max(queued, 0.0))
                new_tokens -= 1
                self.last_token_time = times.get("first_token_time", last)
            if new_tokens > 0:
                gap = (last - self.last_token_time) / new_tokens
                for _ in range(new_tokens):
                    self.metrics.inter_token_latency.observe(max(gap, 0.0))
            self.last_token_time = last
        if output.finished:
            self.done = True
            e2e = times.get("e2e_latency")
            if e2e is not None:
                self.metrics.e2e_request_latency.observe(e2e)
