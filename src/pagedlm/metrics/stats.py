"""Counters and histograms the front end keeps, plus the scheduler's snapshot, as a flat
metric list (``LLM.get_metrics()``, ``AsyncLLM.get_metrics()``; ``/metrics`` renders it).

Everything is counted per sequence (one of a request's ``n`` samples), as vLLM v1 does;
see ``sequence_stats`` for the request-level histograms."""

from __future__ import annotations

import dataclasses
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pagedlm.core.outputs import EngineCoreOutput
from pagedlm.core.scheduler_interface import SchedulerStats
from pagedlm.metrics.sequence_stats import SequenceStats

if TYPE_CHECKING:
    from pagedlm.core.request import Request


FINISH_REASONS = ("stop", "length", "abort")
"""The ``finished_reason`` labels of ``request_success`` (vLLM exports each, 0 included);
"abort" counts the requests the engine core ended (a pause, a failed grammar), not the
ones a client aborted."""


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

    def __init__(self, max_model_len: int = 2048, cache_info: dict[str, str] | None = None) -> None:
        """``cache_info``: the labels of vLLM's ``cache_config_info`` (see ``cache_info``)."""
        self.generation_tokens = 0
        self.request_success: Counter[str] = Counter()
        self.sequences = SequenceStats(max_model_len)
        self.cache_info = cache_info

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
        return self.sequences.num_prompt_tokens

    def record_outputs(self, outputs: list[EngineCoreOutput]) -> None:
        self.generation_tokens += sum(len(out.new_token_ids) for out in outputs)
        finished = self.sequences.record_outputs(outputs)
        if finished:
            self.request_success.update(finished)

    def record_stopped(self, child_ids: Iterable[str]) -> None:
        """Sequences finished by a stop string (only the front end sees those)."""
        child_ids = list(child_ids)
        self.request_success["stop"] += len(child_ids)
        self.sequences.record_stopped(child_ids)

    def snapshot(self, stats: SchedulerStats) -> list[Metric]:
        metrics = [
            Metric("pagedlm:num_requests_running", stats.num_running_reqs, "gauge"),
            Metric("pagedlm:num_requests_waiting", stats.num_waiting_reqs, "gauge"),
            Metric("pagedlm:kv_cache_usage_perc", stats.kv_cache_usage, "gauge"),
            Metric("pagedlm:num_preemptions", stats.num_preemptions),
            Metric("pagedlm:prefix_cache_queries", stats.prefix_cache_queries),
            Metric("pagedlm:prefix_cache_hits", stats.prefix_cache_hits),
            Metric("pagedlm:prompt_tokens", self.prompt_tokens),
            Metric("pagedlm:generation_tokens", self.generation_tokens),
        ]
        if stats.max_loras:
            metrics.append(_lora_requests_info(stats))
        for reason in FINISH_REASONS:
            metrics.append(
                Metric(
                    "pagedlm:request_success",
                    self.request_success.get(reason, 0),
                    labels={"finished_reason": reason},
                )
            )
        spec = stats.spec_decoding
        if spec is not None:
            metrics += [
                Metric("pagedlm:spec_decode_num_drafts", spec.num_drafts),
                Metric("pagedlm:spec_decode_num_draft_tokens", spec.num_draft_tokens),
                Metric("pagedlm:spec_decode_num_accepted_tokens", spec.num_accepted_tokens),
            ]
            metrics += [
                Metric(
                    "pagedlm:spec_decode_num_accepted_tokens_per_pos",
                    count,
                    labels={"position": str(position)},
                )
                for position, count in enumerate(spec.num_accepted_tokens_per_pos)
            ]
        if self.cache_info is not None:
            metrics.append(Metric("pagedlm:cache_config_info", 1.0, "gauge", dict(self.cache_info)))
        for name, histogram in self.sequences.histograms.items():
            metrics.append(Metric(name, histogram.sum, "histogram", buckets=histogram.cumulative()))
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
