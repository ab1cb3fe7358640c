"""Engine metrics: counters and gauges named like vLLM's, prefixed ``pagedlm:``."""

from pagedlm.metrics.stats import EngineMetrics, Metric

__all__ = ["EngineMetrics", "Metric"]
