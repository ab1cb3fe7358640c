"""Counters and histograms the front end keeps, plus the scheduler's snapshot, as a flat
metric list (``LLM.get_metrics()``, ``AsyncLLM.get_metrics()``; ``/metrics`` renders it).

Everything is counted per sequence (one of a request's ``n`` samples), as vLLM v1 does;
see ``sequence_stats`` for the request-level histograms. Every series carries vLLM's
``engine`` label (a data-parallel replica's index, "0" with one engine), but two that
vLLM keeps without it: ``lora_requests_info`` (the whole engine's adapters) and, per
engine yet without a model name, ``cache_config_info``."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pagedlm.core.outputs import EngineCoreOutput
from pagedlm.core.scheduler_interface import SchedulerStats
from pagedlm.metrics.caching_window import EngineHitRates
from pagedlm.metrics.sequence_stats import EngineSeries, SequenceStats

if TYPE_CHECKING:
    from pagedlm.core.request import Request


FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")
"""The ``finished_reason`` labels of ``request_success``: vLLM's ``FinishReason`` values,
each exported, 0 included. "abort" counts the requests the engine core ended (a pause, a
failed grammar), not the ones a client aborted; "repetition" stays 0 (pagedlm has no
repetition detector)."""

SLEEP_STATES = ("awake", "weights_offloaded", "discard_all")
"""``engine_sleep_state``'s ``sleep_state`` labels: awake, sleep level 1, sleep level 2."""

WAITING_REASONS = ("capacity", "deferred")
"""``num_requests_waiting_by_reason``'s ``reason`` labels, vLLM's: waiting for the token
budget, a seat or KV blocks; held back by a transient constraint while requests behind
may start (``core/waiting_reasons.py``)."""


@dataclass(frozen=True)
class Metric:
    """One metric value (``LLM.get_metrics()`` returns a list of these)."""

    name: str
    value: float
    kind: str = "counter"
    """"counter" (cumulative), "gauge" (current value) or "histogram" (``value`` is the
    sum of the observations, ``buckets`` their cumulative counts)."""
    labels: dict[str, str] = field(default_factory=dict)
    buckets: tuple[tuple[float, int], ...] = ()
    """Histograms only: (upper bound, observations <= it), ending with (inf, count)."""


class EngineMetrics:
    """Accumulates per-step counts; ``snapshot`` merges them with the scheduler's stats."""

    def __init__(
        self,
        max_model_len: int = 2048,
        cache_info: dict[str, str] | None = None,
        num_engines: int = 1,
    ) -> None:
        """``cache_info``: the labels of vLLM's ``cache_config_info`` (see ``cache_info``);
        ``num_engines``: the data-parallel replicas, each its own ``engine`` label value."""
        self.sequences = SequenceStats(max_model_len, num_engines=num_engines)
        self.cache_info = cache_info
        self.hit_rates = EngineHitRates()
        """The log line's cache hit rates over the most recent requests."""

    def record_request(self, request_id: str, children: Sequence[Request]) -> None:
        """A user request whose ``n`` samples (``children``) entered the engine core."""
        first = children[0]
        self.sequences.add_request(
            request_id,
            [child.request_id for child in children],
            first.arrival_time,
            len(first.prompt_token_ids),
            first.sampling_params.max_tokens,
        )

    def forget_request(self, request_id: str) -> None:
        """An aborted request, or one the core refused, observes nothing more."""
        self.sequences.forget_request(request_id)

    @property
    def prompt_tokens(self) -> int:
        return sum(series.num_prompt_tokens for series in self.sequences.engines)

    @property
    def generation_tokens(self) -> int:
        return sum(series.num_generation_tokens for series in self.sequences.engines)

    def record_outputs(
        self, outputs: list[EngineCoreOutput], timestamp: float | None = None
    ) -> None:
        """One engine-core step's outputs (``timestamp``: ``SequenceStats.record_outputs``)."""
        self.sequences.record_outputs(outputs, timestamp)

    def record_stats(self, stats: SchedulerStats) -> None:
        """A scheduler snapshot (each step's, each call's), for the hit-rate windows."""
        self.hit_rates.observe(stats)

    def record_stopped(self, child_ids: Iterable[str]) -> None:
        """Sequences finished by a stop string (only the front end sees those)."""
        self.sequences.record_stopped(child_ids)

    def snapshot(self, stats: SchedulerStats, sleep_level: int = 0) -> list[Metric]:
        """Every series: ``stats`` (the scheduler's, one engine's or the sum of the
        replicas' with each in ``stats.engines``) and ``sleep_level`` (0 awake, else the
        engine's sleep level) beside the front end's counts."""
        per_engine = stats.engines or [stats]
        series = self.sequences.engines
        metrics: list[Metric] = []
        for index in range(max(len(per_engine), len(series))):
            engine = {"engine": str(index)}
            if index < len(per_engine):
                metrics += _scheduler_metrics(per_engine[index], engine)
            metrics += _sleep_state(sleep_level, engine)
            if index < len(series):
                metrics += _front_end_metrics(series[index], engine)
            if self.cache_info is not None:
                labels = {**self.cache_info, **engine}
                metrics.append(Metric("pagedlm:cache_config_info", 1.0, "gauge", labels))
        if stats.max_loras:
            metrics.append(_lora_requests_info(stats))
        return metrics


def _scheduler_metrics(stats: SchedulerStats, engine: dict[str, str]) -> list[Metric]:
    metrics = [
        Metric("pagedlm:num_requests_running", stats.num_running_reqs, "gauge", engine),
        Metric("pagedlm:num_requests_waiting", stats.num_waiting_reqs, "gauge", engine),
        *_waiting_by_reason(stats, engine),
        Metric("pagedlm:kv_cache_usage_perc", stats.kv_cache_usage, "gauge", engine),
        Metric("pagedlm:num_preemptions", stats.num_preemptions, labels=engine),
        Metric("pagedlm:prefix_cache_queries", stats.prefix_cache_queries, labels=engine),
        Metric("pagedlm:prefix_cache_hits", stats.prefix_cache_hits, labels=engine),
        Metric(
            "pagedlm:external_prefix_cache_queries",
            stats.external_prefix_cache_queries,
            labels=engine,
        ),
        Metric(
            "pagedlm:external_prefix_cache_hits", stats.external_prefix_cache_hits, labels=engine
        ),
    ]
    spec = stats.spec_decoding
    if spec is not None:
        metrics += [
            Metric("pagedlm:spec_decode_num_drafts", spec.num_drafts, labels=engine),
            Metric("pagedlm:spec_decode_num_draft_tokens", spec.num_draft_tokens, labels=engine),
            Metric(
                "pagedlm:spec_decode_num_accepted_tokens", spec.num_accepted_tokens, labels=engine
            ),
        ]
        metrics += [
            Metric(
                "pagedlm:spec_decode_num_accepted_tokens_per_pos",
                count,
                labels={**engine, "position": str(position)},
            )
            for position, count in enumerate(spec.num_accepted_tokens_per_pos)
        ]
    return metrics


def _waiting_by_reason(stats: SchedulerStats, engine: dict[str, str]) -> list[Metric]:
    """vLLM's ``num_requests_waiting_by_reason``: its two reasons add up to the waiting."""
    deferred = stats.num_deferred_reqs
    counts = {"capacity": stats.num_waiting_reqs - deferred, "deferred": deferred}
    return [
        Metric(
            "pagedlm:num_requests_waiting_by_reason",
            counts[reason],
            "gauge",
            {**engine, "reason": reason},
        )
        for reason in WAITING_REASONS
    ]


def _sleep_state(sleep_level: int, engine: dict[str, str]) -> list[Metric]:
    """vLLM's ``engine_sleep_state``: 1 for the state the engine is in, 0 for the others."""
    state = SLEEP_STATES[sleep_level] if 0 <= sleep_level < len(SLEEP_STATES) else None
    return [
        Metric(
            "pagedlm:engine_sleep_state",
            float(name == state),
            "gauge",
            {**engine, "sleep_state": name},
        )
        for name in SLEEP_STATES
    ]


def _front_end_metrics(series: EngineSeries, engine: dict[str, str]) -> list[Metric]:
    metrics = [
        Metric("pagedlm:prompt_tokens", series.num_prompt_tokens, labels=engine),
        *(
            Metric("pagedlm:prompt_tokens_by_source", count, labels={**engine, "source": source})
            for source, count in series.prompt_tokens_by_source.items()
        ),
        Metric("pagedlm:prompt_tokens_cached", series.num_cached_prompt_tokens, labels=engine),
        Metric(
            "pagedlm:prompt_tokens_recomputed", series.num_recomputed_prompt_tokens, labels=engine
        ),
        Metric("pagedlm:generation_tokens", series.num_generation_tokens, labels=engine),
    ]
    metrics += [
        Metric(
            "pagedlm:request_success",
            series.request_success.get(reason, 0),
            labels={**engine, "finished_reason": reason},
        )
        for reason in FINISH_REASONS
    ]
    metrics += [
        Metric(name, histogram.sum, "histogram", engine, histogram.cumulative())
        for name, histogram in series.histograms.items()
    ]
    return metrics


def cache_info(cache_config: object, num_gpu_blocks: int) -> dict[str, str]:
    """vLLM's ``cache_config_info`` labels: every ``CacheConfig`` field as a string, plus
    the number of KV blocks actually allocated as ``num_gpu_blocks``."""
    labels = {f.name: str(getattr(cache_config, f.name)) for f in dataclasses.fields(cache_config)}
    labels["num_gpu_blocks"] = str(num_gpu_blocks)
    return labels


def _lora_requests_info(stats: SchedulerStats) -> Metric:
    """vLLM's ``lora_requests_info``: the adapters in use as labels, the time as value."""
    return Metric(
        "pagedlm:lora_requests_info",
        time.time(),
        "gauge",
        labels={
            "max_lora": str(stats.max_loras),
            "running_lora_adapters": ",".join(sorted(stats.running_lora_adapters)),
            "waiting_lora_adapters": ",".join(sorted(stats.waiting_lora_adapters)),
        },
    )
