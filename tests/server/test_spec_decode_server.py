"""``pagedlm serve --speculative-config``: the same completions as without speculation,
bad requests answered 400 without harming the others, spec-decode counters on /metrics,
and a bad config refused at start-up with a message naming the fix."""

from __future__ import annotations

import json

import httpx
import pytest
from server_utils import start_server
from test_metrics import scrape, value


@pytest.fixture(scope="module")
def spec_server(chat_checkpoint, tmp_path_factory):
    config = {"method": "draft_model", "model": str(chat_checkpoint), "num_speculative_tokens": 3}
    server = start_server(
        chat_checkpoint,
        tmp_path_factory.mktemp("spec-logs") / "server.log",
        "--speculative-config",
        json.dumps(config),
    )
    yield server
    server.stop()


def _complete(url: str, **body) -> httpx.Response:
    body = {"model": "tiny", "temperature": 0, "max_tokens": 16, "ignore_eos": True, **body}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=60)


@pytest.mark.slow  # a second server process: ~30 s on two loaded cores
def test_completions_match_and_bad_requests_harm_no_one(spec_server, tiny_server) -> None:
    prompts = ["one two three", "hello hello hello", "Café"]
    expected = [_complete(tiny_server.url, prompt=p).json()["choices"][0]["text"] for p in prompts]
    bad = _complete(spec_server.url, prompt="x", max_tokens=10**6)
    assert bad.status_code == 400 and "max_tokens" in bad.json()["error"]["message"]
    got = [_complete(spec_server.url, prompt=p).json()["choices"][0]["text"] for p in prompts]
    assert got == expected
    samples = scrape(spec_server.url)
    drafted = value(samples, "pagedlm:spec_decode_num_draft_tokens_total")
    accepted = value(samples, "pagedlm:spec_decode_num_accepted_tokens_total")
    assert accepted == drafted > 0  # the target drafting for itself is always right
    assert value(samples, "pagedlm:spec_decode_num_accepted_tokens_per_pos_total", position="0") > 0


def test_a_bad_speculative_config_stops_the_server_at_start_up(chat_checkpoint, tmp_path) -> None:
    config = '{"method": "ngram", "num_speculative_tokens": 0}'
    server = start_server(
        chat_checkpoint, tmp_path / "server.log", "--speculative-config", config, wait=False
    )
    assert server.process.wait(timeout=120) != 0
    assert "num_speculative_tokens must be an integer >= 1" in server.log_text()
