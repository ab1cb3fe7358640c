"""Prometheus exposition of the engine's metrics, named like vLLM's with a ``pagedlm:`` prefix
(``--metric-name-prefix vllm``: vLLM's own names, for dashboards, alerts, autoscalers and
routers written for vLLM).

The engine's front end (``AsyncLLM.get_metrics()``, refreshed with ``get_scheduler_stats()``
before each scrape) keeps every counter, gauge and histogram (``metrics.stats``,
``metrics.sequence_stats``); a custom collector on a private registry (nothing is added to
prometheus_client's global one) turns that list into metric families. Labels as vLLM's:
``model_name`` (the served name) and ``engine`` on every series, but ``cache_config_info``
(its fields and ``engine``) and ``lora_requests_info`` (its adapters only).

Beside them, as on vLLM's ``/metrics``, prometheus_client's default collectors, unprefixed:
``process_*`` (CPU seconds, resident and virtual memory, open and maximum file
descriptors, start time), ``python_gc_*`` (objects collected and uncollectable, and
collections, per generation) and ``python_info``. They describe the process that answers
``/metrics``, the server's front end, as vLLM's describe its API server: not the engine
core's or the workers' processes. vLLM drops them in its multiprocess mode (several API
server processes sharing one ``/metrics`` through ``PROMETHEUS_MULTIPROC_DIR`` files, which
prometheus_client cannot merge process metrics across); pagedlm runs one front-end process
(``--api-server-count`` above 1 is refused), so they are always the one server's.

Also beside them, vLLM's ``http_*`` series of the server's HTTP requests
(``http_metrics.py``; the app calls ``PrometheusMetrics.http.instrument``).

Importing this module imports ``prometheus_client`` and prometheus-fastapi-instrumentator;
only the server does.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

from prometheus_client import (
    CollectorRegistry,
    GCCollector,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from pagedlm.metrics.http_metrics import HttpMetrics
from pagedlm.metrics.stats import Metric as EngineMetric

_DOCS = {
    "pagedlm:num_requests_running": "Number of requests in model execution batches.",
    "pagedlm:num_requests_waiting": "Number of requests waiting to be processed.",
    "pagedlm:num_requests_waiting_by_reason": "Number of waiting requests by reason: "
    "capacity (waiting for the token budget, a seat or KV blocks), deferred (held back by a "
    "grammar compiling, a KV transfer or one LoRA adapter too many, while requests behind "
    "may start). The reasons add up to num_requests_waiting.",
    "pagedlm:engine_sleep_state": "Engine sleep state: 1 for the state it is in (awake; "
    "weights_offloaded: sleep level 1; discard_all: sleep level 2), 0 for the others.",
    "pagedlm:kv_cache_usage_perc": "KV-cache usage: 1 means 100 percent.",
    "pagedlm:num_preemptions": "Cumulative number of preemptions.",
    "pagedlm:prefix_cache_queries": "Prefix-cache queries, in tokens.",
    "pagedlm:prefix_cache_hits": "Prefix-cache hits, in tokens.",
    "pagedlm:external_prefix_cache_queries": "Tokens asked of the KV connector (past the "
    "local prefix-cache hit).",
    "pagedlm:external_prefix_cache_hits": "Tokens the KV connector had, to load.",
    "pagedlm:prompt_tokens": "Number of prefill tokens processed.",
    "pagedlm:prompt_tokens_by_source": "Prompt tokens by source: local_compute (computed), "
    "local_cache_hit (the prefix cache), external_kv_transfer (loaded by a KV connector); a "
    "whole cached prompt's recomputed last token counts as computed and as a cache hit.",
    "pagedlm:prompt_tokens_cached": "Prompt tokens not computed: prefix-cache hits and "
    "tokens a KV connector loaded.",
    "pagedlm:prompt_tokens_recomputed": "Cached prompt tokens computed again (a whole cached "
    "prompt's last token, for its logits).",
    "pagedlm:request_prefill_kv_computed_tokens": "Histogram of the prompt tokens a "
    "sequence's prefill computed (its cached ones left out).",
    "pagedlm:generation_tokens": "Number of generation tokens processed.",
    "pagedlm:request_success": "Count of successfully finished requests.",
    "pagedlm:spec_decode_num_drafts": "Number of spec decoding drafts (verification steps).",
    "pagedlm:spec_decode_num_draft_tokens": "Number of draft tokens verified.",
    "pagedlm:spec_decode_num_accepted_tokens": "Number of accepted draft tokens.",
    "pagedlm:spec_decode_num_accepted_tokens_per_pos": "Accepted draft tokens per position.",
    "pagedlm:lora_requests_info": "Running and waiting LoRA adapters (value: update time).",
    "pagedlm:cache_config_info": "Information of the engine's CacheConfig (value: 1).",
    "pagedlm:time_to_first_token_seconds": "Histogram of time to first token in seconds.",
    "pagedlm:inter_token_latency_seconds": "Histogram of inter-token latency in seconds.",
    "pagedlm:request_time_per_output_token_seconds": "Histogram of "
    "time_per_output_token_seconds per request.",
    "pagedlm:e2e_request_latency_seconds": "Histogram of e2e request latency in seconds.",
    "pagedlm:request_queue_time_seconds": "Histogram of time spent in WAITING phase.",
    "pagedlm:request_prefill_time_seconds": "Histogram of time spent in PREFILL phase.",
    "pagedlm:request_decode_time_seconds": "Histogram of time spent in DECODE phase.",
    "pagedlm:request_inference_time_seconds": "Histogram of time spent in RUNNING phase.",
    "pagedlm:request_prompt_tokens": "Number of prefill tokens processed, per sequence.",
    "pagedlm:request_generation_tokens": "Number of generation tokens processed, per sequence.",
    "pagedlm:request_params_max_tokens": "Histogram of the max_tokens request parameter.",
    "pagedlm:request_params_n": "Histogram of the n request parameter.",
    "pagedlm:request_max_num_generation_tokens": "Histogram of the most generation tokens "
    "one of a request's n sequences produced.",
    "pagedlm:iteration_tokens_total": "Histogram of number of tokens per engine step.",
}


WITHOUT_MODEL_NAME = frozenset({"pagedlm:cache_config_info", "pagedlm:lora_requests_info"})
"""The series vLLM exports without a ``model_name`` label (only their own labels)."""

METRIC_NAME_PREFIXES = ("pagedlm", "vllm")
"""What a metric's name starts with (``--metric-name-prefix``): ``pagedlm:num_requests_running``
or vLLM's ``vllm:num_requests_running``; the rest of the name is vLLM's either way."""


class _EngineMetricsCollector:
    """Turns the latest ``list[EngineMetric]`` into Prometheus metric families."""

    def __init__(self, model_name: str, prefix: str = "pagedlm") -> None:
        if prefix not in METRIC_NAME_PREFIXES:
            raise ValueError(
                f"metric name prefix {prefix!r} is not one of {list(METRIC_NAME_PREFIXES)}."
            )
        self.model_name = model_name
        self.prefix = prefix
        self.latest: list[EngineMetric] = []

    def _exposed(self, name: str) -> str:
        if self.prefix == "pagedlm" or not name.startswith("pagedlm:"):
            return name
        return f"{self.prefix}:{name.removeprefix('pagedlm:')}"

    def collect(self) -> Iterable[Metric]:
        grouped: dict[tuple[str, str], list[EngineMetric]] = defaultdict(list)
        for metric in self.latest:
            grouped[(metric.name, metric.kind)].append(metric)
        for (name, kind), samples in grouped.items():
            own = sorted(samples[0].labels)
            named = name not in WITHOUT_MODEL_NAME
            label_names = ["model_name", *own] if named else own
            family_type = _FAMILIES[kind]
            family = family_type(self._exposed(name), _DOCS.get(name, name), labels=label_names)
            for sample in samples:
                values = [sample.labels[k] for k in own]
                if named:
                    values.insert(0, self.model_name)
                if kind == "histogram":
                    buckets = [(_bound(le), count) for le, count in sample.buckets]
                    family.add_metric(values, buckets, sample.value)
                else:
                    family.add_metric(values, sample.value)
            yield family


_FAMILIES = {
    "counter": CounterMetricFamily,
    "gauge": GaugeMetricFamily,
    "histogram": HistogramMetricFamily,
}


def _bound(upper: float) -> str:
    return "+Inf" if upper == float("inf") else str(upper)


class PrometheusMetrics:
    """The server's metrics registry. ``render()`` gives the text exposition format."""

    def __init__(self, model_name: str, prefix: str = "pagedlm") -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        # prometheus_client's defaults, first as in its global registry (vLLM's).
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        GCCollector(registry=self.registry)
        self._engine = _EngineMetricsCollector(model_name, prefix)
        self.registry.register(self._engine)
        self.http = HttpMetrics(self.registry)

    def update_engine_metrics(self, metrics: list[EngineMetric]) -> None:
        self._engine.latest = list(metrics)

    def render(self) -> bytes:
        return generate_latest(self.registry)
