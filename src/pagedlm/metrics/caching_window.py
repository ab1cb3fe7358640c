"""Cache hit rates over the most recent requests, as vLLM's log line reports them (its
``CachingMetrics``): the prefix cache's and a KV connector's, per engine or over all
engines, fed the scheduler's cumulative counters one snapshot at a time.

A window holds the counts of whole updates (the requests admitted between two
snapshots): once it holds more than ``max_recent_requests`` requests, the oldest updates
leave it, but never the latest, so one large update is still reported. An update with no
request is not kept (it would push informative ones out), and an emptied prefix cache
(``reset_prefix_cache``) starts the local window over.
"""

from __future__ import annotations

from collections import deque
from typing import NamedTuple

from pagedlm.core.scheduler_interface import SchedulerStats

MAX_RECENT_REQUESTS = 1000
"""Requests a window covers (vLLM's default)."""


class CacheUpdate(NamedTuple):
    """The requests that looked up a cache between two snapshots, and their tokens."""

    requests: int
    queries: int
    """Tokens looked up."""
    hits: int
    """Of those, tokens the cache had."""


class CachingWindow:
    """Hit rate over the updates of about the last ``max_recent_requests`` requests.

    Invariant: ``requests``, ``queries`` and ``hits`` are the sums over ``updates``.
    """

    def __init__(self, max_recent_requests: int = MAX_RECENT_REQUESTS) -> None:
        self.max_recent_requests = max_recent_requests
        self.updates: deque[CacheUpdate] = deque()
        self.requests = self.queries = self.hits = 0

    def observe(self, update: CacheUpdate, reset: bool = False) -> None:
        """Add ``update``; ``reset``: the cache was emptied before it (start over)."""
        if reset:
            self.reset()
        if update.requests <= 0:
            return
        self.updates.append(update)
        self.requests += update.requests
        self.queries += update.queries
        self.hits += update.hits
        while len(self.updates) > 1 and self.requests > self.max_recent_requests:
            oldest = self.updates.popleft()
            self.requests -= oldest.requests
            self.queries -= oldest.queries
            self.hits -= oldest.hits

    def reset(self) -> None:
        self.updates.clear()
        self.requests = self.queries = self.hits = 0

    @property
    def empty(self) -> bool:
        """No request observed (since the last reset)."""
        return self.requests == 0

    @property
    def hit_rate(self) -> float:
        """Fraction of the window's looked-up tokens that hit, in [0, 1] (0 if none)."""
        return self.hits / self.queries if self.queries else 0.0


class HitRateWindows:
    """The prefix cache's and the KV connector's windows of one engine, or of several
    (an aggregated line observes every engine's snapshots)."""

    def __init__(self, max_recent_requests: int = MAX_RECENT_REQUESTS) -> None:
        self.prefix_cache = CachingWindow(max_recent_requests)
        self.external_prefix_cache = CachingWindow(max_recent_requests)

    def observe(self, stats: SchedulerStats, before: SchedulerStats | None) -> None:
        """What one engine's scheduler counted between snapshot ``before`` (None: the
        engine's start) and ``stats``."""
        local, external = _local(stats), _external(stats)
        resets = stats.prefix_cache_resets
        if before is not None:
            local = _minus(local, _local(before))
            external = _minus(external, _external(before))
            resets -= before.prefix_cache_resets
        self.prefix_cache.observe(local, reset=resets > 0)
        self.external_prefix_cache.observe(external)


def _local(stats: SchedulerStats) -> CacheUpdate:
    return CacheUpdate(
        stats.prefix_cache_requests, stats.prefix_cache_queries, stats.prefix_cache_hits
    )


def _external(stats: SchedulerStats) -> CacheUpdate:
    return CacheUpdate(
        stats.external_prefix_cache_requests,
        stats.external_prefix_cache_queries,
        stats.external_prefix_cache_hits,
    )


def _minus(update: CacheUpdate, before: CacheUpdate) -> CacheUpdate:
    return CacheUpdate(*(now - then for now, then in zip(update, before, strict=True)))


class EngineHitRates:
    """Each engine's windows (``engines[i]``: the data-parallel replica ``i``) and one
    window over them all (``all``, for the aggregated line), fed every snapshot."""

    def __init__(self, max_recent_requests: int = MAX_RECENT_REQUESTS) -> None:
        self.max_recent_requests = max_recent_requests
        self.engines: list[HitRateWindows] = []
        self.all = HitRateWindows(max_recent_requests)
        self._last: list[SchedulerStats | None] = []

    def observe(self, stats: SchedulerStats) -> None:
        """``stats``: the whole engine's snapshot (each replica's in ``stats.engines``)."""
        for index, engine in enumerate(stats.engines or [stats]):
            if index == len(self.engines):
                self.engines.append(HitRateWindows(self.max_recent_requests))
                self._last.append(None)
            before = self._last[index]
            if engine is before:
                continue
            self.engines[index].observe(engine, before)
            self.all.observe(engine, before)
            self._last[index] = engine
