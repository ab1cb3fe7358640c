"""The log line's cache hit rates over the most recent requests (vLLM's CachingMetrics),
fed the scheduler's cumulative counters one snapshot at a time."""

from __future__ import annotations

import pytest

from pagedlm.core.scheduler_interface import SchedulerStats
from pagedlm.metrics.caching_window import (
    CacheUpdate,
    CachingWindow,
    EngineHitRates,
    HitRateWindows,
)


def test_the_window_keeps_about_the_last_requests_and_always_the_latest_update():
    window = CachingWindow(max_recent_requests=10)
    assert window.empty and window.hit_rate == 0.0
    window.observe(CacheUpdate(requests=6, queries=60, hits=0))
    window.observe(CacheUpdate(requests=4, queries=40, hits=40))
    assert (window.requests, window.hit_rate) == (10, 0.4)  # 10 requests: both kept
    window.observe(CacheUpdate(requests=3, queries=30, hits=30))
    # 13 > 10: the oldest update leaves, the rate is over the last 7 requests only.
    assert (window.requests, window.hit_rate) == (7, 1.0)
    window.observe(CacheUpdate(requests=50, queries=100, hits=25))
    assert (window.requests, window.hit_rate) == (50, 0.25)  # alone above the limit, kept


def test_updates_without_requests_are_not_kept_and_a_reset_starts_over():
    window = CachingWindow(max_recent_requests=2)
    window.observe(CacheUpdate(2, 20, 10))
    for _ in range(5):  # idle steps must not push the informative update out
        window.observe(CacheUpdate(0, 0, 0))
    assert window.hit_rate == 0.5
    window.observe(CacheUpdate(0, 0, 0), reset=True)
    assert window.empty and window.hit_rate == 0.0
    window.observe(CacheUpdate(1, 8, 8), reset=True)  # emptied before this update
    assert (window.requests, window.hit_rate) == (1, 1.0)


def _stats(requests: int, queries: int, hits: int, resets: int = 0, **external) -> SchedulerStats:
    return SchedulerStats(
        0,
        0,
        0.0,
        0,
        queries,
        hits,
        prefix_cache_requests=requests,
        prefix_cache_resets=resets,
        **external,
    )


def test_snapshots_are_turned_into_updates_and_a_reset_empties_the_local_window():
    windows = HitRateWindows(max_recent_requests=4)
    first = _stats(4, 40, 0)
    windows.observe(first, None)
    second = _stats(8, 80, 40)  # 4 more requests that hit everything
    windows.observe(second, first)
    assert windows.prefix_cache.hit_rate == 1.0  # cumulative would be 0.5
    third = _stats(9, 100, 40, resets=1)  # emptied, then one request that missed
    windows.observe(third, second)
    assert (windows.prefix_cache.requests, windows.prefix_cache.hit_rate) == (1, 0.0)
    assert windows.external_prefix_cache.empty  # no connector was asked


def test_the_connector_window_fills_once_a_connector_is_asked():
    windows = HitRateWindows()
    asked = _stats(
        1,
        10,
        0,
        external_prefix_cache_requests=1,
        external_prefix_cache_queries=10,
        external_prefix_cache_hits=6,
    )
    windows.observe(asked, _stats(0, 0, 0))
    assert not windows.external_prefix_cache.empty
    assert windows.external_prefix_cache.hit_rate == pytest.approx(0.6)


def test_each_engine_has_its_windows_and_the_aggregate_sees_them_all():
    hit_rates = EngineHitRates()

    def whole(*engines: SchedulerStats) -> SchedulerStats:
        return SchedulerStats(0, 0, 0.0, 0, 0, 0, engines=list(engines))

    miss, hit = _stats(2, 20, 0), _stats(2, 20, 20)
    snapshot = whole(miss, hit)
    hit_rates.observe(snapshot)
    hit_rates.observe(snapshot)  # the same snapshot again (a metrics scrape) adds nothing
    assert [w.prefix_cache.hit_rate for w in hit_rates.engines] == [0.0, 1.0]
    assert (hit_rates.all.prefix_cache.requests, hit_rates.all.prefix_cache.hit_rate) == (4, 0.5)
    one_engine = EngineHitRates()
    one_engine.observe(hit)  # without data parallelism: the snapshot is engine 0's
    assert one_engine.engines[0].prefix_cache.hit_rate == 1.0
