"""/metrics of a real server: every vLLM metric the issue names, counted per sequence, and
the Grafana dashboard in examples/grafana reads only metrics that exist."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from server.server_utils import start_server, write_chat_checkpoint

DASHBOARD = Path(__file__).parents[2] / "examples" / "grafana" / "pagedlm.json"
HISTOGRAMS = [
    "time_to_first_token_seconds",
    "inter_token_latency_seconds",
    "time_per_output_token_seconds",
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


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    checkpoint = write_chat_checkpoint(tmp_path_factory.mktemp("tiny-chat"))
    server = start_server(checkpoint, tmp_path_factory.mktemp("logs") / "server.log")
    yield server
    server.stop()


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    response = httpx.get(f"{url}/metrics")
    assert response.status_code == 200
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(response.text)
        for sample in family.samples
    }


def value(samples, name: str, **labels) -> float:
    return samples.get((name, tuple(sorted({"model_name": "tiny", **labels}.items()))), 0.0)


def test_n2_request_is_two_sequences_everywhere(server):
    before = scrape(server.url)
    response = httpx.post(
        f"{server.url}/v1/completions",
        json={"model": "tiny", "prompt": "hello", "max_tokens": 3, "n": 2, "ignore_eos": True},
    )
    assert response.status_code == 200, response.text
    after = scrape(server.url)

    def delta(name: str, **labels) -> float:
        return value(after, f"pagedlm:{name}", **labels) - value(
            before, f"pagedlm:{name}", **labels
        )

    assert delta("request_success_total", finished_reason="length") == 2
    for name in HISTOGRAMS:
        if name not in ("request_params_n", "iteration_tokens_total"):
            assert delta(f"{name}_count") == (4 if name == "inter_token_latency_seconds" else 2)
    assert delta("request_params_n_count") == 1
    assert delta("request_params_n_sum") == 2
    assert delta("request_params_max_tokens_sum") == 6
    assert delta("request_prompt_tokens_sum") == 2 * len("hello")
    assert delta("request_generation_tokens_sum") == 6
    assert delta("iteration_tokens_total_sum") == 2 * len("hello") + 6
    assert delta("request_params_n_bucket", le="2.0") == 1
    assert delta("request_params_n_bucket", le="1.0") == 0
    info = [labels for (name, labels) in after if name == "pagedlm:cache_config_info"]
    assert len(info) == 1
    assert dict(info[0])["num_gpu_blocks"] == "64"
    assert dict(info[0])["block_size"] == "16"


def test_grafana_dashboard_reads_existing_metrics(server):
    names = {name for name, _ in scrape(server.url)}
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    exprs += [v["query"]["query"] for v in dashboard["templating"]["list"]]
    used = {m for expr in exprs for m in re.findall(r"pagedlm:[A-Za-z0-9_:]+", expr)}
    assert used, "the dashboard reads no pagedlm metric"
    assert not used - names, f"the dashboard reads metrics /metrics lacks: {used - names}"
    # Every histogram the issue names is on the dashboard.
    missing = [h for h in HISTOGRAMS if not any(u.startswith(f"pagedlm:{h}") for u in used)]
    assert not missing, missing
