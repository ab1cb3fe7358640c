"""/metrics parses with prometheus_client's parser and its counters match what was sent."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    response = httpx.get(f"{url}/metrics")
    assert response.status_code == 200
    samples = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            key = (sample.name, tuple(sorted(sample.labels.items())))
            samples[key] = sample.value
    return samples


def value(samples, name: str, **labels) -> float:
    return samples[(name, tuple(sorted({"model_name": "tiny", **labels}.items())))]


def test_counters_match_requests(tiny_server):
    before = scrape(tiny_server.url)
    prompts = ["one", "two two", "three three three"]
    for prompt in prompts:
        response = httpx.post(
            f"{tiny_server.url}/v1/completions",
            json={"model": "tiny", "prompt": prompt, "max_tokens": 4, "ignore_eos": True},
        )
        assert response.status_code == 200
    after = scrape(tiny_server.url)

    def delta(name: str, **labels) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert delta("pagedlm:prompt_tokens_total") == sum(len(p) for p in prompts)
    assert delta("pagedlm:generation_tokens_total") == 4 * len(prompts)
    assert delta("pagedlm:request_success_total", finished_reason="length") == len(prompts)
    assert delta("pagedlm:time_to_first_token_seconds_count") == len(prompts)
    assert delta("pagedlm:e2e_request_latency_seconds_count") == len(prompts)
    assert delta("pagedlm:request_queue_time_seconds_count") == len(prompts)
    assert delta("pagedlm:inter_token_latency_seconds_count") == 3 * len(prompts)
    assert value(after, "pagedlm:num_requests_running") == 0
    assert value(after, "pagedlm:num_requests_waiting") == 0
    for name in (
        "pagedlm:kv_cache_usage_perc",
        "pagedlm:num_preemptions_total",
        "pagedlm:prefix_cache_queries_total",
        "pagedlm:prefix_cache_hits_total",
    ):
        assert value(after, name) >= 0


def test_cache_salt_keeps_prefix_caches_apart(tiny_server):
    """Requests share prefix-cache blocks only under the same ``cache_salt``."""
    prompt = "salted prefix, long enough for several full blocks of the cache " * 2

    def hits_after(salt: str) -> float:
        before = scrape(tiny_server.url)
        for endpoint, body in (
            ("completions", {"prompt": prompt}),
            ("chat/completions", {"messages": [{"role": "user", "content": prompt}]}),
        ):
            response = httpx.post(
                f"{tiny_server.url}/v1/{endpoint}",
                json={"model": "tiny", "max_tokens": 1, "cache_salt": salt, **body},
            )
            assert response.status_code == 200, response.text
        after = scrape(tiny_server.url)
        name = "pagedlm:prefix_cache_hits_total"
        return value(after, name) - value(before, name)

    assert hits_after("tenant-a") == 0  # first sight of both prompts under this salt
    assert hits_after("tenant-a") > 0  # the same prompts again: their blocks are reused
    assert hits_after("tenant-b") == 0  # another tenant's salt shares nothing
