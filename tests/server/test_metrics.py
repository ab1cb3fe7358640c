"""/metrics parses with prometheus_client's parser and its counters match what was sent;
every vLLM metric the issue names, counted per sequence; the Grafana dashboard in
examples/grafana reads only metrics that exist."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import httpx
import pytest
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
    """A sample of the one engine's series (vLLM's ``model_name`` and ``engine`` labels)."""
    return samples[(name, tuple(sorted({"model_name": "tiny", "engine": "0", **labels}.items())))]


DASHBOARD = Path(__file__).parents[2] / "examples" / "grafana" / "pagedlm.json"
SLEEP_STATES = ("awake", "weights_offloaded", "discard_all")
HISTOGRAMS = [
    "time_to_first_token_seconds",
    "inter_token_latency_seconds",
    "request_time_per_output_token_seconds",
    "e2e_request_latency_seconds",
    "request_queue_time_seconds",
    "request_prefill_time_seconds",
    "request_decode_time_seconds",
    "request_inference_time_seconds",
    "request_prompt_tokens",
    "request_generation_tokens",
    "request_params_n",
    "request_params_max_tokens",
    "iteration_tokens_total",
]


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
    # vLLM's split of them: computed, hit locally, loaded (no KV connector here).
    by_source = {
        source: delta("pagedlm:prompt_tokens_by_source_total", source=source)
        for source in ("local_compute", "local_cache_hit", "external_kv_transfer")
    }
    recomputed = delta("pagedlm:prompt_tokens_recomputed_total")
    assert sum(by_source.values()) - recomputed == sum(len(p) for p in prompts)
    assert by_source["external_kv_transfer"] == 0
    assert delta("pagedlm:generation_tokens_total") == 4 * len(prompts)
    assert delta("pagedlm:request_success_total", finished_reason="length") == len(prompts)
    assert delta("pagedlm:time_to_first_token_seconds_count") == len(prompts)
    assert delta("pagedlm:e2e_request_latency_seconds_count") == len(prompts)
    assert delta("pagedlm:request_queue_time_seconds_count") == len(prompts)
    assert delta("pagedlm:inter_token_latency_seconds_count") == 3 * len(prompts)
    assert value(after, "pagedlm:num_requests_running") == 0
    assert value(after, "pagedlm:num_requests_waiting") == 0
    for reason in ("capacity", "deferred"):  # vLLM's reasons, both exported
        assert value(after, "pagedlm:num_requests_waiting_by_reason", reason=reason) == 0
    for name in (
        "pagedlm:kv_cache_usage_perc",
        "pagedlm:num_preemptions_total",
        "pagedlm:prefix_cache_queries_total",
        "pagedlm:prefix_cache_hits_total",
    ):
        assert value(after, name) >= 0
    # No KV connector: asked nothing (vLLM exports the series anyway).
    assert value(after, "pagedlm:external_prefix_cache_queries_total") == 0
    assert value(after, "pagedlm:external_prefix_cache_hits_total") == 0
    sleep = {s: value(after, "pagedlm:engine_sleep_state", sleep_state=s) for s in SLEEP_STATES}
    assert sleep == {"awake": 1, "weights_offloaded": 0, "discard_all": 0}


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
        hits = value(after, name) - value(before, name)
        # vLLM's prompt_tokens_cached: the same tokens, counted as the prefills finish.
        cached = "pagedlm:prompt_tokens_cached_total"
        assert value(after, cached) - value(before, cached) == hits

        def by_source(sample, source: str) -> float:
            return value(sample, "pagedlm:prompt_tokens_by_source_total", source=source)

        recomputed = "pagedlm:prompt_tokens_recomputed_total"
        local_hits = by_source(after, "local_cache_hit") - by_source(before, "local_cache_hit")
        assert local_hits == hits + value(after, recomputed) - value(before, recomputed)
        return hits

    assert hits_after("tenant-a") == 0  # first sight of both prompts under this salt
    assert hits_after("tenant-a") > 0  # the same prompts again: their blocks are reused
    assert hits_after("tenant-b") == 0  # another tenant's salt shares nothing


def test_n2_request_is_two_sequences_everywhere(tiny_server):
    before = scrape(tiny_server.url)
    response = httpx.post(
        f"{tiny_server.url}/v1/completions",
        json={"model": "tiny", "prompt": "hello", "max_tokens": 3, "n": 2, "ignore_eos": True},
    )
    assert response.status_code == 200, response.text
    after = scrape(tiny_server.url)

    def delta(name: str, **labels) -> float:
        return value(after, f"pagedlm:{name}", **labels) - value(
            before, f"pagedlm:{name}", **labels
        )

    assert delta("request_success_total", finished_reason="length") == 2
    for name in HISTOGRAMS:
        if name not in ("request_params_n", "iteration_tokens_total"):
            # One observation per sequence; ITL one per later step (a token each here).
            per_step = name == "inter_token_latency_seconds"
            assert delta(f"{name}_count") == (4 if per_step else 2)
    assert delta("request_max_num_generation_tokens_count") == 1
    assert delta("request_max_num_generation_tokens_sum") == 3
    assert delta("request_params_n_count") == 1
    assert delta("request_params_n_sum") == 2
    assert delta("request_params_max_tokens_sum") == 6
    assert delta("request_prompt_tokens_sum") == 2 * len("hello")
    assert delta("request_prefill_kv_computed_tokens_count") == 2
    assert delta("request_generation_tokens_sum") == 6
    assert delta("iteration_tokens_total_sum") == 2 * len("hello") + 6
    assert delta("request_params_n_bucket", le="2.0") == 1
    assert delta("request_params_n_bucket", le="1.0") == 0
    info = [labels for (name, labels) in after if name == "pagedlm:cache_config_info"]
    assert len(info) == 1
    # vLLM's labels: the cache config's fields and the engine, no model name.
    assert "model_name" not in dict(info[0]) and dict(info[0])["engine"] == "0"
    assert dict(info[0])["num_gpu_blocks"] == "64"
    assert dict(info[0])["block_size"] == "16"


def test_grafana_dashboard_reads_existing_metrics(tiny_server):
    names = {name for name, _ in scrape(tiny_server.url)}
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    exprs += [v["query"]["query"] for v in dashboard["templating"]["list"]]
    used = {m for expr in exprs for m in re.findall(r"pagedlm:[A-Za-z0-9_:]+", expr)}
    assert used, "the dashboard reads no pagedlm metric"
    assert not used - names, f"the dashboard reads metrics /metrics lacks: {used - names}"
    # Every histogram the issue names is on the dashboard.
    missing = [h for h in HISTOGRAMS if not any(u.startswith(f"pagedlm:{h}") for u in used)]
    assert not missing, missing


def test_vllm_metric_names_on_request():
    """``--metric-name-prefix vllm``: the same metrics under vLLM's names (dashboards and
    autoscalers written for vLLM read them unchanged); the default keeps pagedlm's."""
    from pagedlm.metrics.prometheus import PrometheusMetrics
    from pagedlm.metrics.stats import Metric

    sample = [Metric("pagedlm:num_requests_running", 3.0, "gauge", {"engine": "0"})]
    ours, theirs = PrometheusMetrics("m"), PrometheusMetrics("m", "vllm")
    for metrics in (ours, theirs):
        metrics.update_engine_metrics(sample)
    assert b'pagedlm:num_requests_running{engine="0",model_name="m"} 3.0' in ours.render()
    text = theirs.render()
    assert b'vllm:num_requests_running{engine="0",model_name="m"} 3.0' in text
    assert b"pagedlm:" not in text
    assert b"# HELP vllm:num_requests_running Number of requests in model" in text
    with pytest.raises(ValueError, match="not one of"):
        PrometheusMetrics("m", "sglang")


def _start_time(pid: int) -> float:
    """A process's start time, seconds since the epoch, as prometheus_client reads it."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    ticks = float(stat.rpartition(")")[2].split()[19])
    boot = next(
        float(line.split()[1])
        for line in Path("/proc/stat").read_text().splitlines()
        if line.startswith("btime ")
    )
    return boot + ticks / os.sysconf("SC_CLK_TCK")


def test_process_and_gc_metrics_of_the_front_end(tiny_server):
    """prometheus_client's default collectors, as on vLLM's /metrics (its global registry):
    ``process_*`` of the process that serves /metrics (the front end, not the engine
    core), ``python_gc_*`` per generation and ``python_info``, unprefixed."""
    samples = scrape(tiny_server.url)
    assert samples[("process_start_time_seconds", ())] == pytest.approx(
        _start_time(tiny_server.process.pid), abs=0.02
    )
    assert samples[("process_resident_memory_bytes", ())] > 0
    assert samples[("process_cpu_seconds_total", ())] > 0
    assert samples[("process_open_fds", ())] > 0
    for generation in ("0", "1", "2"):
        labels = (("generation", generation),)
        assert samples[("python_gc_collections_total", labels)] >= 0
        assert ("python_gc_objects_collected_total", labels) in samples
        assert ("python_gc_objects_uncollectable_total", labels) in samples
    assert any(name == "python_info" for name, _ in samples)


def test_label_sets_are_vllms():
    """vLLM's label sets: ``model_name`` and ``engine`` on every series but
    ``lora_requests_info`` (its adapters only) and ``cache_config_info`` (its fields and
    ``engine``); ``engine_sleep_state`` adds ``sleep_state``."""
    from pagedlm.core.scheduler_interface import SchedulerStats
    from pagedlm.metrics.prometheus import PrometheusMetrics
    from pagedlm.metrics.stats import EngineMetrics

    engine = EngineMetrics(max_model_len=64, cache_info={"block_size": "16"})
    stats = SchedulerStats(0, 0, 0.0, 0, 0, 0, max_loras=1, running_lora_adapters={"sql": 1})
    metrics = PrometheusMetrics("m", "vllm")
    metrics.update_engine_metrics(engine.snapshot(stats))
    families = {f.name: f for f in text_string_to_metric_families(metrics.render().decode())}
    # prometheus_client's default collectors, unprefixed beside vLLM's names.
    assert {"process_resident_memory_bytes", "python_gc_collections", "python_info"} <= set(
        families
    )
    families = {name: f for name, f in families.items() if name.startswith("vllm:")}
    for name, family in families.items():
        labels = set(family.samples[0].labels) - {"le"}
        if name == "vllm:lora_requests_info":
            assert labels == {"max_lora", "running_lora_adapters", "waiting_lora_adapters"}
        elif name == "vllm:cache_config_info":
            assert labels == {"block_size", "engine"}
        elif name == "vllm:engine_sleep_state":
            assert labels == {"model_name", "engine", "sleep_state"}
        elif name == "vllm:num_requests_waiting_by_reason":
            assert labels == {"model_name", "engine", "reason"}
            reasons = {sample.labels["reason"] for sample in family.samples}
            assert reasons == {"capacity", "deferred"}
        elif name == "vllm:prompt_tokens_by_source":
            assert labels == {"model_name", "engine", "source"}
            sources = {sample.labels["source"] for sample in family.samples}
            assert sources == {"local_compute", "local_cache_hit", "external_kv_transfer"}
        elif name == "vllm:request_success":
            assert labels == {"model_name", "engine", "finished_reason"}
            reasons = {sample.labels["finished_reason"] for sample in family.samples}
            assert reasons == {"stop", "length", "abort", "error", "repetition"}
        else:
            assert labels == {"model_name", "engine"}, name
    assert {"vllm:external_prefix_cache_queries", "vllm:engine_sleep_state"} <= set(families)
