"""Admin endpoints on a real server: prefix-cache reset, sleep levels 1 and 2 (requests
answered 503 meanwhile, woken at once or by tags, the same greedy tokens after waking),
pause and resume, and the profiler; and the switches off (in process, over FakeEngine)."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest

from pagedlm.entrypoints.openai.app import build_app
from pagedlm.entrypoints.openai.serving_engine import ServingContext
from pagedlm.metrics.prometheus import PrometheusMetrics
from server.fake_engine import FakeEngine
from server.server_utils import start_server, statuses_of_a_dropped_upload

PROMPT = "a prompt long enough to fill two blocks of the prefix cache, or more"


@pytest.fixture(scope="module")
def server(chat_checkpoint, tmp_path_factory):
    profiles = tmp_path_factory.mktemp("profiles")
    server = start_server(
        chat_checkpoint,
        tmp_path_factory.mktemp("logs") / "server.log",
        "--enable-sleep-mode",
        "--enable-weight-updates",
        "--profiler-dir",
        str(profiles),
    )
    server.profiles = profiles
    yield server
    server.stop()


def complete(url: str) -> httpx.Response:
    body = {
        "model": "tiny",
        "prompt": PROMPT,
        "max_tokens": 6,
        "temperature": 0,
        "ignore_eos": True,
    }
    return httpx.post(f"{url}/v1/completions", json=body, timeout=60)


def sleep_state(url: str) -> str:
    """The state vLLM's ``engine_sleep_state`` gauge sets to 1 (the others are 0)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics").text
    (family,) = [f for f in text_string_to_metric_families(text) if f.name.endswith("sleep_state")]
    values = {sample.labels["sleep_state"]: sample.value for sample in family.samples}
    assert sorted(values.values()) == [0, 0, 1], values
    return next(state for state, value in values.items() if value == 1)


def prefix_hits(url: str) -> float:
    text = httpx.get(f"{url}/metrics").text
    name = "pagedlm:prefix_cache_hits_total"
    return float(next(row for row in text.splitlines() if row.startswith(name)).split()[-1])


def test_reset_prefix_cache(server):
    complete(server.url)
    before = prefix_hits(server.url)
    complete(server.url)
    assert prefix_hits(server.url) > before  # the second request hit the cached prefix
    assert httpx.post(f"{server.url}/reset_prefix_cache").status_code == 200
    before = prefix_hits(server.url)
    complete(server.url)
    assert prefix_hits(server.url) == before  # nothing cached any more


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_and_wake_up(server, level):
    expected = complete(server.url).json()["choices"][0]["text"]
    assert httpx.get(f"{server.url}/is_sleeping").json() == {"is_sleeping": False}
    assert sleep_state(server.url) == "awake"
    assert httpx.post(f"{server.url}/sleep", params={"level": 3}).status_code == 400
    response = httpx.post(f"{server.url}/sleep", params={"level": level}, timeout=60)
    assert response.status_code == 200, response.text
    assert httpx.get(f"{server.url}/is_sleeping").json() == {"is_sleeping": True}
    assert sleep_state(server.url) == ("weights_offloaded" if level == 1 else "discard_all")
    asleep = complete(server.url)
    assert asleep.status_code == 503
    assert "/wake_up" in asleep.json()["error"]["message"]
    assert httpx.get(f"{server.url}/v1/models").status_code == 200  # no weights needed
    assert httpx.get(f"{server.url}/health").status_code == 200
    wake_up = f"{server.url}/wake_up"
    assert httpx.post(wake_up, params={"tags": "gpu"}).status_code == 400
    if level == 2:  # vLLM's tags: the weights, then the KV cache
        assert httpx.post(wake_up, params={"tags": "kv_cache"}).status_code == 409
        response = httpx.post(wake_up, params={"tags": "weights"}, timeout=120)
        assert response.status_code == 200, response.text
        assert httpx.get(f"{server.url}/is_sleeping").json() == {"is_sleeping": True}
        assert sleep_state(server.url) == "discard_all"  # asleep until both are awake
        assert complete(server.url).status_code == 503
        response = httpx.post(wake_up, params={"tags": "kv_cache"}, timeout=120)
    else:
        response = httpx.post(wake_up, timeout=120)
    assert response.status_code == 200, response.text
    assert httpx.get(f"{server.url}/is_sleeping").json() == {"is_sleeping": False}
    assert sleep_state(server.url) == "awake"
    awake = complete(server.url)
    assert awake.status_code == 200
    assert awake.json()["choices"][0]["text"] == expected


@pytest.mark.slow  # starting torch's profiler takes ~10 s on a loaded 2-core machine
def test_profiler_writes_a_trace(server):
    assert httpx.post(f"{server.url}/stop_profile").status_code == 409  # none running
    assert httpx.post(f"{server.url}/start_profile", timeout=120).status_code == 200
    assert httpx.post(f"{server.url}/start_profile").status_code == 409
    assert complete(server.url).status_code == 200
    assert httpx.post(f"{server.url}/stop_profile", timeout=120).status_code == 200
    traces = list(Path(server.profiles).glob("*.json*"))
    assert traces, list(Path(server.profiles).iterdir())


def test_switches_off(chat_checkpoint):
    from starlette.testclient import TestClient

    engine = FakeEngine(chat_checkpoint)
    ctx = ServingContext(engine=engine, model_names=["tiny"], metrics=PrometheusMetrics("tiny"))
    with TestClient(build_app(ctx)) as client:
        response = client.post("/sleep")
        assert response.status_code == 400
        assert "--enable-sleep-mode" in response.json()["error"]["message"]
        assert client.get("/is_sleeping").json() == {"is_sleeping": False}
        assert client.post("/start_profile").status_code == 404
        assert client.post("/stop_profile").status_code == 404


def test_pause_and_resume_over_http(server):
    """vLLM's /pause, /resume, /is_paused: an in-flight stream ends with "abort", a request
    sent while paused waits and completes after /resume; a bad mode is a 400."""
    import json
    import threading
    from concurrent.futures import ThreadPoolExecutor

    url = server.url
    long = {"model": "tiny", "prompt": PROMPT, "max_tokens": 400, "temperature": 0,
            "ignore_eos": True, "stream": True}  # fmt: skip
    started = threading.Event()

    def stream_reasons() -> list:
        reasons = []
        with httpx.stream("POST", f"{url}/v1/completions", json=long, timeout=60) as response:
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    started.set()
                    reasons.append(json.loads(line[6:])["choices"][0]["finish_reason"])
        return reasons

    with ThreadPoolExecutor(2) as pool:
        streaming = pool.submit(stream_reasons)
        assert started.wait(60)
        assert httpx.post(f"{url}/pause", params={"mode": "later"}).status_code == 400
        assert httpx.get(f"{url}/is_paused").json() == {"is_paused": False}
        paused = httpx.post(f"{url}/pause", timeout=60)
        assert paused.status_code == 200 and paused.json() == {"status": "paused"}
        reasons = streaming.result(60)
        assert reasons[-1] == "abort" and len(reasons) < 400
        assert httpx.get(f"{url}/is_paused").json() == {"is_paused": True}
        waiting = pool.submit(complete, url)
        time.sleep(0.5)
        assert not waiting.done()  # held in the front end, neither sent nor failed
        assert httpx.post(f"{url}/resume", timeout=60).json() == {"status": "resumed"}
        done = waiting.result(60)
        assert done.status_code == 200
        assert done.json()["choices"][0]["finish_reason"] == "length"
        assert httpx.get(f"{url}/is_paused").json() == {"is_paused": False}


def test_pause_routes_need_weight_updates_or_dev_mode(chat_checkpoint, monkeypatch):
    import argparse

    from starlette.testclient import TestClient

    from pagedlm.entrypoints.openai.admin import AdminOptions

    def pause_routes(admin: AdminOptions) -> set[str]:
        """The pause routes the app serves (FakeEngine cannot pause: 500, not 404)."""
        engine = FakeEngine(chat_checkpoint)
        ctx = ServingContext(engine=engine, model_names=["tiny"], metrics=PrometheusMetrics("tiny"))
        app = build_app(ctx, admin=admin)
        with TestClient(app, raise_server_exceptions=False) as client:
            served = {
                "/pause": client.post("/pause", params={"mode": "later"}).status_code,
                "/resume": client.post("/resume").status_code,
                "/is_paused": client.get("/is_paused").status_code,
            }
        return {path for path, status in served.items() if status != 404}

    args = argparse.Namespace(
        enable_sleep_mode=False, profiler_dir=None, enable_weight_updates=False
    )
    off = AdminOptions.from_args(args)
    assert off.dev_mode is False and pause_routes(off) == set()  # absent: 404, as vLLM's
    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")
    dev = AdminOptions.from_args(args)
    assert dev.dev_mode is True
    assert pause_routes(dev) == {"/pause", "/resume", "/is_paused"}
    monkeypatch.delenv("VLLM_SERVER_DEV_MODE")
    args.enable_weight_updates = True
    assert pause_routes(AdminOptions.from_args(args)) == {"/pause", "/resume", "/is_paused"}


def test_a_dropped_weight_update_upload_is_499_quietly(chat_checkpoint, caplog):
    """A client gone before its ``/update_weights_from_disk`` body arrived got starlette's
    500 (and a traceback); the model routes answer 499 quietly, and so does this one."""
    from pagedlm.entrypoints.openai.admin import AdminOptions

    engine = FakeEngine(chat_checkpoint)
    ctx = ServingContext(engine=engine, model_names=["tiny"], metrics=PrometheusMetrics("tiny"))
    app = build_app(ctx, admin=AdminOptions(enable_weight_updates=True))
    with caplog.at_level("ERROR"):
        statuses = statuses_of_a_dropped_upload(app, "/update_weights_from_disk", b'{"model_pa')
    assert statuses == [499]
    assert not [r for r in caplog.records if r.levelname == "ERROR"], caplog.text
