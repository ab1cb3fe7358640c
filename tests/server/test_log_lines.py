"""The server's logging flags: vLLM's periodic throughput line (``--disable-log-stats``
turns it off) and ``--enable-log-requests``."""

from __future__ import annotations

import itertools
import logging
import time

from fake_engine import FakeEngine, fake_context
from starlette.testclient import TestClient

from pagedlm.entrypoints.openai.app import build_app
from pagedlm.metrics.log_line import StatsLine
from pagedlm.metrics.stats import Metric


def _metrics(prompt: float, generated: float, running: float, waiting: float = 0.0):
    return [
        Metric("pagedlm:prompt_tokens", prompt),
        Metric("pagedlm:generation_tokens", generated),
        Metric("pagedlm:num_requests_running", running, "gauge"),
        Metric("pagedlm:num_requests_waiting", waiting, "gauge"),
        Metric("pagedlm:kv_cache_usage_perc", 0.25, "gauge"),
        Metric("pagedlm:prefix_cache_queries", 200),
        Metric("pagedlm:prefix_cache_hits", 50),
    ]


def test_the_line_gives_rates_since_the_last_and_stays_quiet_when_idle():
    line = StatsLine()
    assert line.line(_metrics(0, 0, 0), now=0.0) is None  # nothing to compare with yet
    text = line.line(_metrics(1000, 200, 3, 1), now=10.0)
    assert text == (
        "Avg prompt throughput: 100.0 tokens/s, Avg generation throughput: 20.0 tokens/s, "
        "Running: 3 reqs, Waiting: 1 reqs, KV cache usage: 25.0%, Prefix cache hit rate: 25.0%"
    )
    assert line.line(_metrics(1000, 200, 0), now=20.0) is None  # idle: no line


def test_the_line_has_the_kv_connectors_hit_rate_once_it_was_asked():
    """vLLM adds "External prefix cache hit rate" with a KV connector, once it has seen a
    request; every admission asks a connector for at least the prompt's last token, so
    without one its queries stay 0 and the line has no such part."""
    line = StatsLine()
    line.line(_metrics(0, 0, 0), now=0.0)
    assert "External" not in line.line(_metrics(1000, 200, 3), now=10.0)
    external = [
        Metric("pagedlm:external_prefix_cache_queries", 150),
        Metric("pagedlm:external_prefix_cache_hits", 60),
    ]
    text = line.line(_metrics(2000, 400, 3) + external, now=20.0)
    assert text.endswith("Prefix cache hit rate: 25.0%, External prefix cache hit rate: 40.0%")


def test_the_line_sums_the_engines_counts_and_averages_their_kv_usage():
    """With data parallelism each replica reports its own series (vLLM's ``engine``
    label): the line adds their tokens and requests and shows their mean KV usage."""
    line = StatsLine()

    def replicas(generated: float) -> list[Metric]:
        return [
            metric
            for engine, usage in (("0", 0.2), ("1", 0.6))
            for metric in (
                Metric("pagedlm:generation_tokens", generated, labels={"engine": engine}),
                Metric("pagedlm:num_requests_running", 2, "gauge", {"engine": engine}),
                Metric("pagedlm:kv_cache_usage_perc", usage, "gauge", {"engine": engine}),
            )
        ]

    line.line(replicas(0), now=0.0)
    text = line.line(replicas(50), now=10.0)
    assert "Avg generation throughput: 10.0 tokens/s, Running: 4 reqs" in text
    assert "KV cache usage: 40.0%" in text


def _ctx(checkpoint, **fields):
    return fake_context(FakeEngine(checkpoint), **fields)


def test_the_server_logs_the_line_while_busy(chat_checkpoint, caplog):
    ctx = _ctx(chat_checkpoint)
    tokens = itertools.count(0, 100)
    ctx.engine.get_metrics = lambda: _metrics(next(tokens), 0, 1)
    app = build_app(ctx, log_stats_interval_s=0.05)
    with caplog.at_level(logging.INFO, logger="pagedlm.server"), TestClient(app):
        deadline = time.monotonic() + 10
        while "Avg prompt throughput" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.05)
    assert "Avg prompt throughput" in caplog.text and "Running: 1 reqs" in caplog.text


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
