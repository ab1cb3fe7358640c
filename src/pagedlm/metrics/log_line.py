"""vLLM's periodic engine log line: prompt and generation throughput since the last line,
running and waiting requests, KV cache usage and the prefix cache's hit rate, then, once a
KV connector has been asked for tokens (as vLLM: only with a connector, once it has seen a
request), the connector's ("External prefix cache hit rate"); computed from the engine's
metrics (``LLMEngine/AsyncLLM.get_metrics()``), hit rates over the whole run; with data
parallelism the engines' counts summed and their KV usage averaged."""

from __future__ import annotations

from collections.abc import Sequence

from pagedlm.metrics.stats import Metric

DEFAULT_INTERVAL_S = 10.0
"""Seconds between lines (vLLM's default)."""


class StatsLine:
    """``line(metrics, now)``: the log line for the time since the previous call, or None
    while the engine has been idle (nothing ran, nothing waits)."""

    def __init__(self) -> None:
        self._last: tuple[float, dict[str, float]] | None = None

    def line(self, metrics: Sequence[Metric], now: float) -> str | None:
        values: dict[str, float] = {}
        num_engines = 0
        for metric in metrics:
            if metric.kind != "histogram":
                values[metric.name] = values.get(metric.name, 0.0) + metric.value
                num_engines += metric.name == "pagedlm:kv_cache_usage_perc"
        if num_engines > 1:  # the engines' mean usage, as vLLM's aggregated line shows
            values["pagedlm:kv_cache_usage_perc"] /= num_engines
        last, self._last = self._last, (now, values)
        if last is None:
            return None
        then, before = last
        seconds = max(now - then, 1e-9)

        def delta(name: str) -> float:
            return values.get(f"pagedlm:{name}", 0.0) - before.get(f"pagedlm:{name}", 0.0)

        running = values.get("pagedlm:num_requests_running", 0.0)
        waiting = values.get("pagedlm:num_requests_waiting", 0.0)
        prompt, generated = delta("prompt_tokens"), delta("generation_tokens")
        if not (prompt or generated or running or waiting):
            return None
        text = (
            f"Avg prompt throughput: {prompt / seconds:.1f} tokens/s, "
            f"Avg generation throughput: {generated / seconds:.1f} tokens/s, "
            f"Running: {running:.0f} reqs, Waiting: {waiting:.0f} reqs, "
            f"KV cache usage: {100 * values.get('pagedlm:kv_cache_usage_perc', 0.0):.1f}%, "
            f"Prefix cache hit rate: {_hit_rate(values, 'prefix_cache'):.1f}%"
        )
        # Every admission asks a connector for at least the prompt's last token, so its
        # queries are 0 only without a connector or before its first request.
        if values.get("pagedlm:external_prefix_cache_queries"):
            text += (
                ", External prefix cache hit rate: "
                f"{_hit_rate(values, 'external_prefix_cache'):.1f}%"
            )
        return text


def _hit_rate(values: dict[str, float], cache: str) -> float:
    """Percent of ``cache``'s queried tokens that hit."""
    queries = values.get(f"pagedlm:{cache}_queries", 0.0)
    return 100 * values.get(f"pagedlm:{cache}_hits", 0.0) / queries if queries else 0.0
