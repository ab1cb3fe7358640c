"""Counters the front end keeps, plus the scheduler's snapshot, as a flat metric list."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

from pagedlm.core.outputs import EngineCoreOutput
from pagedlm.core.scheduler_interface import SchedulerStats


@dataclass(frozen=True)
class Metric:
    """One metric value (``LLM.get_metrics()`` returns a list of these)."""

    name: str
    value: float
    kind: str = "counter"
    """"counter" (cumulative) or "gauge" (current value)."""
    labels: dict[str, str] = field(default_factory=dict)


class EngineMetrics:
    """Accumulates per-step counts; ``snapshot`` merges them with the scheduler's stats."""

    def __init__(self) -> None:
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.request_success: Counter[str] = Counter()

    def record_prompt(self, num_prompt_tokens: int, num_samples: int) -> None:
        self.prompt_tokens += num_prompt_tokens * num_samples

    def record_outputs(self, outputs: list[EngineCoreOutput]) -> None:
        for out in outputs:
            self.generation_tokens += len(out.new_token_ids)
            if out.finish_reason is not None and out.finish_reason != "abort":
                self.request_success[out.finish_reason] += 1

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
        for reason in ("stop", "length"):
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
        return metrics


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
