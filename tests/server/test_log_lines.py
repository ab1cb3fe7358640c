"""The server's logging flags: vLLM's periodic engine stats lines (``--disable-log-stats``
turns them off, ``--aggregate-engine-logging`` makes one line of all engines) and
``--enable-log-requests``."""

from __future__ import annotations

import itertools
import logging
import time

from fake_engine import FakeEngine, fake_context
from starlette.testclient import TestClient

from pagedlm.core.scheduler_interface import SchedulerStats
from pagedlm.entrypoints.cli.main import parse_args
from pagedlm.entrypoints.openai.app import build_app
from pagedlm.metrics.caching_window import EngineHitRates
from pagedlm.metrics.log_line import LogLine, StatsLine
from pagedlm.metrics.stats import Metric

INFO, DEBUG = logging.INFO, logging.DEBUG


def _metrics(
    prompt: float,
    generated: float,
    running: float,
    waiting: float = 0.0,
    *,
    engine: str = "0",
    usage: float = 0.25,
    preemptions: float = 0.0,
    deferred: float = 0.0,
) -> list[Metric]:
    labels = {"engine": engine}
    return [
        Metric("pagedlm:prompt_tokens", prompt, labels=labels),
        Metric("pagedlm:generation_tokens", generated, labels=labels),
        Metric("pagedlm:num_requests_running", running, "gauge", labels),
        Metric("pagedlm:num_requests_waiting", waiting, "gauge", labels),
        *(
            Metric(
                "pagedlm:num_requests_waiting_by_reason",
                count,
                "gauge",
                {**labels, "reason": reason},
            )
            for reason, count in (("capacity", waiting - deferred), ("deferred", deferred))
        ),
        Metric("pagedlm:kv_cache_usage_perc", usage, "gauge", labels),
        Metric("pagedlm:num_preemptions", preemptions, labels=labels),
        Metric("pagedlm:prefix_cache_queries", 200, labels=labels),
        Metric("pagedlm:prefix_cache_hits", 50, labels=labels),
    ]


def _stats(requests: int, queries: int, hits: int, **fields) -> SchedulerStats:
    return SchedulerStats(0, 0, 0.0, 0, queries, hits, prefix_cache_requests=requests, **fields)


def test_the_line_is_vllms_part_for_part():
    line, hit_rates = StatsLine(), EngineHitRates()
    hit_rates.observe(_stats(4, 200, 50))
    assert line.lines(_metrics(0, 0, 0), hit_rates, now=0.0) == []  # starts the count
    assert line.lines(_metrics(1000, 200, 3, 1), hit_rates, now=10.0) == [
        LogLine(
            INFO,
            "Engine 000: Avg prompt throughput: 100.0 tokens/s, Avg generation throughput: "
            "20.0 tokens/s, Running: 3 reqs, Waiting: 1 reqs, GPU KV cache usage: 25.0%, "
            "Prefix cache hit rate: 25.0%",
        )
    ]


def test_deferred_and_preemptions_appear_when_there_are_some():
    """vLLM's "Deferred: N reqs" (of the waiting ones) and "Preemptions: N" (since the
    last line), each only when above 0."""
    line, hit_rates = StatsLine(), EngineHitRates()
    line.lines(_metrics(0, 0, 0, preemptions=5), hit_rates, now=0.0)
    busy = _metrics(10, 10, 2, 3, preemptions=7, deferred=1)
    [text] = [entry.text for entry in line.lines(busy, hit_rates, now=1.0)]
    assert "Waiting: 3 reqs, Deferred: 1 reqs, Preemptions: 2, GPU KV cache usage" in text
    [text] = [
        entry.text for entry in line.lines(_metrics(20, 20, 2, preemptions=7), hit_rates, 2.0)
    ]
    assert "Deferred" not in text and "Preemptions" not in text


def test_an_idle_engine_is_logged_at_debug_after_an_interval_without_work():
    """vLLM's rule: DEBUG once neither this interval nor the one before computed a token
    (whatever runs or waits), so an idle server is quiet at INFO."""
    line, hit_rates = StatsLine(), EngineHitRates()
    line.lines(_metrics(0, 0, 0), hit_rates, now=0.0)
    levels = [
        line.lines(_metrics(prompt, 0, running), hit_rates, now)[0].level
        for prompt, running, now in ((100, 1, 10.0), (100, 1, 20.0), (100, 1, 30.0), (150, 0, 40.0))
    ]
    assert levels == [INFO, INFO, DEBUG, INFO]


def test_the_hit_rate_covers_the_most_recent_requests_not_the_whole_run():
    line, hit_rates = StatsLine(), EngineHitRates()
    line.lines(_metrics(0, 0, 1), hit_rates, now=0.0)
    hit_rates.observe(_stats(1000, 10_000, 0))  # a thousand misses first
    hit_rates.observe(_stats(2000, 20_000, 10_000))  # then a thousand full hits
    [entry] = line.lines(_metrics(10, 10, 1), hit_rates, now=10.0)
    assert entry.text.endswith("Prefix cache hit rate: 100.0%")  # cumulative: 50.0%
    hit_rates.observe(_stats(2001, 20_010, 10_000, prefix_cache_resets=1))  # emptied
    [entry] = line.lines(_metrics(20, 20, 1), hit_rates, now=20.0)
    assert entry.text.endswith("Prefix cache hit rate: 0.0%")


def test_the_line_has_the_kv_connectors_hit_rate_once_it_was_asked():
    """vLLM adds "External prefix cache hit rate" once its connector window holds a
    request: without a connector no request asks one, and the line has no such part."""
    line, hit_rates = StatsLine(), EngineHitRates()
    line.lines(_metrics(0, 0, 0), hit_rates, now=0.0)
    hit_rates.observe(_stats(4, 200, 50))
    assert "External" not in line.lines(_metrics(1000, 200, 3), hit_rates, now=10.0)[0].text
    hit_rates.observe(
        _stats(
            5,
            210,
            50,
            external_prefix_cache_requests=1,
            external_prefix_cache_queries=150,
            external_prefix_cache_hits=60,
        )
    )
    [entry] = line.lines(_metrics(2000, 400, 3), hit_rates, now=20.0)
    assert entry.text.endswith(
        "Prefix cache hit rate: 23.8%, External prefix cache hit rate: 40.0%"
    )


def _replicas(generated: float) -> list[Metric]:
    return [
        metric
        for engine, usage in (("0", 0.2), ("1", 0.6))
        for metric in _metrics(0, generated * (1 + int(engine)), 2, engine=engine, usage=usage)
    ]


def _two_engines() -> EngineHitRates:
    hit_rates = EngineHitRates()
    whole = SchedulerStats(0, 0, 0.0, 0, 0, 0, engines=[_stats(1, 10, 0), _stats(1, 10, 10)])
    hit_rates.observe(whole)
    return hit_rates


def test_each_engine_has_its_own_line():
    """vLLM's default with data parallelism: one "Engine 00i:" line per replica, each
    with its own counts, KV usage and hit-rate window."""
    line, hit_rates = StatsLine(), _two_engines()
    line.lines(_replicas(0), hit_rates, now=0.0)
    first, second = (entry.text for entry in line.lines(_replicas(50), hit_rates, now=10.0))
    assert first.startswith("Engine 000: Avg prompt throughput: 0.0 tokens/s, ")
    assert "generation throughput: 5.0 tokens/s, Running: 2 reqs" in first
    assert "GPU KV cache usage: 20.0%, Prefix cache hit rate: 0.0%" in first
    assert second.startswith("Engine 001: ") and "throughput: 10.0 tokens/s" in second
    assert "GPU KV cache usage: 60.0%, Prefix cache hit rate: 100.0%" in second


def test_the_aggregated_line_sums_the_engines_and_averages_their_kv_usage():
    """``--aggregate-engine-logging``: one "N Engines Aggregated:" line, tokens and
    requests summed, KV usage averaged, one window over every engine."""
    line, hit_rates = StatsLine(aggregate=True), _two_engines()
    line.lines(_replicas(0), hit_rates, now=0.0)
    [entry] = line.lines(_replicas(50), hit_rates, now=10.0)
    assert entry.text.startswith("2 Engines Aggregated: Avg prompt throughput: 0.0 tokens/s")
    assert "Avg generation throughput: 15.0 tokens/s, Running: 4 reqs" in entry.text
    assert entry.text.endswith("GPU KV cache usage: 40.0%, Prefix cache hit rate: 50.0%")


def test_speculative_decoding_adds_vllms_spec_decoding_line():
    def spec(drafts: float, drafted: float, accepted: float, per_position) -> list[Metric]:
        labels = {"engine": "0"}
        return [
            *_metrics(0, accepted + drafts, 1),
            Metric("pagedlm:spec_decode_num_drafts", drafts, labels=labels),
            Metric("pagedlm:spec_decode_num_draft_tokens", drafted, labels=labels),
            Metric("pagedlm:spec_decode_num_accepted_tokens", accepted, labels=labels),
            *(
                Metric(
                    "pagedlm:spec_decode_num_accepted_tokens_per_pos",
                    count,
                    labels={**labels, "position": str(position)},
                )
                for position, count in enumerate(per_position)
            ),
        ]

    line, hit_rates = StatsLine(), EngineHitRates()
    line.lines(spec(10, 20, 5, [4, 1]), hit_rates, now=0.0)
    main, spec_line = line.lines(spec(30, 60, 35, [20, 15]), hit_rates, now=10.0)
    assert main.text.startswith("Engine 000: ")
    assert spec_line == LogLine(
        INFO,
        "SpecDecoding metrics: Mean acceptance length: 2.50, Accepted throughput: 3.00 "
        "tokens/s, Drafted throughput: 4.00 tokens/s, Accepted: 30 tokens, Drafted: 40 "
        "tokens, Per-position acceptance rate: 0.800, 0.700, Avg Draft acceptance rate: 75.0%",
    )
    assert len(line.lines(spec(30, 60, 35, [20, 15]), hit_rates, now=20.0)) == 1  # no drafts


def test_the_aggregate_flag_is_vllms():
    assert parse_args(["serve", "m"]).aggregate_engine_logging is False
    assert parse_args(["serve", "m", "--aggregate-engine-logging"]).aggregate_engine_logging


def _ctx(checkpoint, **fields):
    return fake_context(FakeEngine(checkpoint), **fields)


def test_the_server_logs_the_line_while_busy(chat_checkpoint, caplog):
    for aggregate, prefix in ((False, "Engine 000: "), (True, "1 Engines Aggregated: ")):
        ctx = _ctx(chat_checkpoint)
        tokens = itertools.count(0, 100)
        ctx.engine.get_metrics = lambda tokens=tokens: _metrics(next(tokens), 0, 1)
        ctx.engine.metrics.record_stats(_stats(4, 200, 50))
        app = build_app(ctx, log_stats_interval_s=0.05, aggregate_engine_logging=aggregate)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="pagedlm.server"), TestClient(app):
            deadline = time.monotonic() + 10
            while "Avg prompt throughput" not in caplog.text and time.monotonic() < deadline:
                time.sleep(0.05)
        assert f"{prefix}Avg prompt throughput" in caplog.text
        assert "Running: 1 reqs" in caplog.text and "Prefix cache hit rate: 25.0%" in caplog.text


def test_requests_are_logged_when_asked(chat_checkpoint, caplog):
    body = {"model": "tiny", "prompt": "hello there", "max_tokens": 2}
    for log_requests in (False, True):
        ctx = _ctx(chat_checkpoint, log_requests=log_requests)
        caplog.clear()
        level = caplog.at_level(logging.INFO, logger="pagedlm.server")
        with level, TestClient(build_app(ctx)) as client:
            assert client.post("/v1/completions", json=body).status_code == 200
        logged = "Received request cmpl-" in caplog.text and "'hello there'" in caplog.text
        assert logged == log_requests


def test_max_log_len_cuts_the_logged_prompt(chat_checkpoint, caplog):
    ctx = _ctx(chat_checkpoint, log_requests=True, max_log_len=8)
    body = {"model": "tiny", "prompt": "a long prompt to cut", "max_tokens": 2}
    level = caplog.at_level(logging.INFO, logger="pagedlm.server")
    with level, TestClient(build_app(ctx)) as client:
        assert client.post("/v1/completions", json=body).status_code == 200
    assert "prompt 'a long ..." in caplog.text and "to cut" not in caplog.text


def test_outputs_are_logged_whole_at_the_end_and_piece_by_piece_when_asked(chat_checkpoint, caplog):
    body = {"model": "tiny", "prompt": "hello there", "max_tokens": 4, "temperature": 0}
    for deltas, stream in ((False, False), (True, True), (False, True)):
        ctx = _ctx(chat_checkpoint, log_requests=True, log_outputs=True, log_deltas=deltas)
        caplog.clear()
        level = caplog.at_level(logging.INFO, logger="pagedlm.server")
        with level, TestClient(build_app(ctx)) as client:
            response = client.post("/v1/completions", json={**body, "stream": stream})
            assert response.status_code == 200
        lines = [r.getMessage() for r in caplog.records]
        pieces = [line for line in lines if "(streaming delta)" in line]
        [whole] = [line for line in lines if "finish_reason" in line]
        assert whole.startswith("Generated response cmpl-"), whole
        assert bool(pieces) == deltas, pieces  # the fake engine streams token by token
        if not stream:
            text = response.json()["choices"][0]["text"]
            assert f"output {text!r}" in whole
    ctx = _ctx(chat_checkpoint, log_requests=False, log_outputs=True)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="pagedlm.server"), TestClient(build_app(ctx)) as c:
        assert c.post("/v1/completions", json=body).status_code == 200
    assert "Generated response" not in caplog.text  # vLLM's rule: outputs need requests
