"""vLLM's periodic engine log lines (its ``LoggingStatLogger``), part for part:

``Engine 000: Avg prompt throughput: 4.1 tokens/s, Avg generation throughput: 12.3
tokens/s, Running: 3 reqs, Waiting: 1 reqs[, Deferred: 1 reqs][, Preemptions: 2], GPU KV
cache usage: 25.0%, Prefix cache hit rate: 40.0%[, External prefix cache hit rate: 10.0%]``

- throughputs and preemptions are counted since the previous line; "Deferred" (waiting
  requests held back while later ones may start) and "Preemptions" only when above 0;
- the cache hit rates are over about the last 1,000 requests that looked the cache up
  (``caching_window.py``), the external one (a KV connector's) once a connector was asked;
- "GPU KV cache usage" is vLLM's wording on every platform, its CPU one included;
- a line in which nothing was computed, nor in the line before, is logged at DEBUG (an
  idle server stays quiet at INFO), as vLLM does;
- one line per engine (``Engine 001: ...`` for the second data-parallel replica), or with
  ``aggregate`` (``--aggregate-engine-logging``) one ``N Engines Aggregated: ...`` line:
  counts summed, KV usage averaged, one hit-rate window over every engine;
- with speculative decoding, vLLM's ``SpecDecoding metrics: ...`` line follows each line
  whose interval verified drafts.

vLLM's "Corrupted: N reqs" (``VLLM_COMPUTE_NANS_IN_LOGITS``) and "MM cache hit rate" (its
multimodal processor cache) have no counterpart here: pagedlm counts no NaN logits and
has no processor cache.

Everything but the hit rates is read from the engine's metrics
(``LLMEngine/AsyncLLM.get_metrics()``); the hit-rate windows are fed every scheduler
snapshot (``EngineMetrics.hit_rates``).
"""

from __future__ import annotations

import itertools
import logging
from collections import defaultdict
from collections.abc import Sequence
from typing import NamedTuple

from pagedlm.metrics.caching_window import EngineHitRates, HitRateWindows
from pagedlm.metrics.stats import Metric

DEFAULT_INTERVAL_S = 10.0
"""Seconds between lines (vLLM's default)."""

_COUNTERS = (
    "prompt_tokens",
    "generation_tokens",
    "num_preemptions",
    "spec_decode_num_drafts",
    "spec_decode_num_draft_tokens",
    "spec_decode_num_accepted_tokens",
)
"""Cumulative series whose growth since the last line the lines report."""


class LogLine(NamedTuple):
    level: int
    """``logging.INFO``, or ``logging.DEBUG`` while the engine is idle."""
    text: str


class StatsLine:
    """``lines(metrics, hit_rates, now)``: the lines for the time since the previous call
    (none on the first call, which only starts the count)."""

    def __init__(self, aggregate: bool = False) -> None:
        self.aggregate = aggregate
        self._last_time: float | None = None
        self._before: dict[str, dict[str, float]] = {}
        self._last_throughput: dict[str, tuple[float, float]] = {}

    def lines(
        self, metrics: Sequence[Metric], hit_rates: EngineHitRates, now: float
    ) -> list[LogLine]:
        values = _by_engine(metrics)
        then, self._last_time = self._last_time, now
        before, self._before = self._before, values
        if then is None:
            return []
        seconds = now - then
        engines = sorted(values, key=int)
        if self.aggregate:
            groups = [(f"{len(engines)} Engines Aggregated: ", engines, hit_rates.all)]
        else:
            groups = [
                (f"Engine {int(engine):03d}: ", [engine], _windows(hit_rates, int(engine)))
                for engine in engines
            ]
        lines: list[LogLine] = []
        for prefix, group, windows in groups:
            now_values = [values[engine] for engine in group]
            then_values = [before.get(engine, {}) for engine in group]
            lines += self._group_lines(prefix, now_values, then_values, windows, seconds)
        return lines

    def _group_lines(
        self,
        prefix: str,
        values: list[dict[str, float]],
        before: list[dict[str, float]],
        windows: HitRateWindows,
        seconds: float,
    ) -> list[LogLine]:
        def total(name: str) -> float:
            return sum(engine.get(f"pagedlm:{name}", 0.0) for engine in values)

        grown = {
            name: total(name) - sum(engine.get(f"pagedlm:{name}", 0.0) for engine in before)
            for name in _COUNTERS
        }
        prompt = grown["prompt_tokens"] / seconds if seconds > 0 else 0.0
        generation = grown["generation_tokens"] / seconds if seconds > 0 else 0.0
        last_prompt, last_generation = self._last_throughput.get(prefix, (0.0, 0.0))
        self._last_throughput[prefix] = (prompt, generation)
        idle = not any((prompt, generation, last_prompt, last_generation))
        level = logging.DEBUG if idle else logging.INFO

        parts = [
            f"Avg prompt throughput: {prompt:.1f} tokens/s",
            f"Avg generation throughput: {generation:.1f} tokens/s",
            f"Running: {total('num_requests_running'):.0f} reqs",
            f"Waiting: {total('num_requests_waiting'):.0f} reqs",
        ]
        if (deferred := total("num_requests_waiting_by_reason{deferred}")) > 0:
            parts.append(f"Deferred: {deferred:.0f} reqs")
        if grown["num_preemptions"] > 0:
            parts.append(f"Preemptions: {grown['num_preemptions']:.0f}")
        usage = total("kv_cache_usage_perc") / max(len(values), 1)
        parts.append(f"GPU KV cache usage: {100 * usage:.1f}%")
        parts.append(f"Prefix cache hit rate: {100 * windows.prefix_cache.hit_rate:.1f}%")
        if not windows.external_prefix_cache.empty:
            rate = windows.external_prefix_cache.hit_rate
            parts.append(f"External prefix cache hit rate: {100 * rate:.1f}%")
        lines = [LogLine(level, prefix + ", ".join(parts))]
        if grown["spec_decode_num_drafts"] > 0:
            accepted_per_position = _per_position(values, before)
            lines.append(LogLine(level, _spec_line(grown, accepted_per_position, seconds)))
        return lines


def _windows(hit_rates: EngineHitRates, index: int) -> HitRateWindows:
    """Engine ``index``'s windows (empty ones before its first snapshot)."""
    if index < len(hit_rates.engines):
        return hit_rates.engines[index]
    return HitRateWindows(hit_rates.max_recent_requests)


def _by_engine(metrics: Sequence[Metric]) -> dict[str, dict[str, float]]:
    """Each engine's counters and gauges by name; a series split by ``reason`` or
    ``position`` as ``name{value}``, any other label summed over."""
    values: dict[str, dict[str, float]] = defaultdict(dict)
    for metric in metrics:
        engine = metric.labels.get("engine")
        if metric.kind == "histogram" or engine is None:
            continue
        name = metric.name
        for label in ("reason", "position"):
            if label in metric.labels:
                name += f"{{{metric.labels[label]}}}"
        values[engine][name] = values[engine].get(name, 0.0) + metric.value
    return values


def _per_position(values: list[dict[str, float]], before: list[dict[str, float]]) -> list[float]:
    """Accepted drafts per draft position since the last line, over the group's engines."""
    accepted: list[float] = []
    for position in itertools.count():
        key = f"pagedlm:spec_decode_num_accepted_tokens_per_pos{{{position}}}"
        if not any(key in engine for engine in values):
            return accepted
        now = sum(engine.get(key, 0.0) for engine in values)
        accepted.append(now - sum(engine.get(key, 0.0) for engine in before))
    return accepted


def _spec_line(grown: dict[str, float], accepted_per_position: list[float], seconds: float) -> str:
    """vLLM's ``SpecDecoding metrics`` line over the drafts verified since the last line."""
    drafts = grown["spec_decode_num_drafts"]
    drafted = grown["spec_decode_num_draft_tokens"]
    accepted = grown["spec_decode_num_accepted_tokens"]
    rates = ", ".join(f"{count / drafts:.3f}" for count in accepted_per_position)
    acceptance = 100 * accepted / drafted if drafted else float("nan")
    return (
        "SpecDecoding metrics: "
        f"Mean acceptance length: {1 + accepted / drafts:.2f}, "
        f"Accepted throughput: {accepted / seconds if seconds > 0 else 0.0:.2f} tokens/s, "
        f"Drafted throughput: {drafted / seconds if seconds > 0 else 0.0:.2f} tokens/s, "
        f"Accepted: {accepted:.0f} tokens, "
        f"Drafted: {drafted:.0f} tokens, "
        f"Per-position acceptance rate: {rates}, "
        f"Avg Draft acceptance rate: {acceptance:.1f}%"
    )
