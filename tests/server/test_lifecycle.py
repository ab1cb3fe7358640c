"""API key, body-size limit, abort on client disconnect, and draining on SIGTERM, against a
server started with ``--api-key`` and a small ``--max-request-body-bytes``."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import threading
import time

import anthropic
import httpx
import openai
import pytest
from server_utils import child_pids, start_server
from test_metrics import scrape, value

KEY = "s3cret-key-0123456789"
BODY_LIMIT = 4096


@pytest.fixture(scope="module")
def server(chat_checkpoint, tmp_path_factory):
    server = start_server(
        chat_checkpoint,
        tmp_path_factory.mktemp("logs") / "keyed.log",
        "--api-key",
        KEY,
        "--max-request-body-bytes",
        str(BODY_LIMIT),
        "--shutdown-timeout",
        "20",
        "--log-level",
        "info",
    )
    yield server
    server.stop()


def test_api_key(server):
    url = server.url
    assert httpx.get(f"{url}/health").status_code == 200
    assert httpx.get(f"{url}/metrics").status_code == 200
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        response = httpx.get(f"{url}/v1/models", headers=headers)
        assert response.status_code == 401
        assert response.json()["error"]["code"] == 401
    assert httpx.get(f"{url}/version").status_code == 401
    assert httpx.get(f"{url}/health/", headers={}).status_code in (401, 404)
    anthropic_error = httpx.post(f"{url}/v1/messages", json={}).json()
    assert anthropic_error["error"]["type"] == "authentication_error"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{url}/v1", api_key="nope", max_retries=0).models.list()
    good = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
    assert (
        good.completions.create(model="tiny", prompt="hi", max_tokens=2).usage.completion_tokens
        == 2
    )
    claude = anthropic.Anthropic(base_url=url, api_key=KEY, max_retries=0)
    assert claude.messages.create(
        model="tiny", max_tokens=2, messages=[{"role": "user", "content": "hi"}]
    )


def test_body_size_limit(server):
    headers = {"Authorization": f"Bearer {KEY}", "content-type": "application/json"}
    body = json.dumps({"model": "tiny", "prompt": "x" * (2 * BODY_LIMIT)}).encode()
    response = httpx.post(f"{server.url}/v1/completions", content=body, headers=headers)
    assert response.status_code == 413
    assert "max-request-body-bytes" in response.json()["error"]["message"]

    def chunked():  # no Content-Length: the limit must count the bytes
        for start in range(0, len(body), 1000):
            yield body[start : start + 1000]

    response = httpx.post(f"{server.url}/v1/completions", content=chunked(), headers=headers)
    assert response.status_code == 413
    small = json.dumps({"model": "tiny", "prompt": "x", "max_tokens": 1}).encode()
    response = httpx.post(f"{server.url}/v1/completions", content=iter([small]), headers=headers)
    assert response.status_code == 200


async def _open_and_drop(client: httpx.AsyncClient, url: str) -> None:
    body = {
        "model": "tiny",
        "prompt": "abort me",
        "max_tokens": 200,
        "ignore_eos": True,
        "stream": True,
    }
    async with client.stream("POST", url, json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                return  # leaving the block closes the connection mid-stream


def _wait_idle(url: str, idle: float) -> dict:
    deadline = time.monotonic() + 15
    while True:
        samples = scrape(url)
        state = tuple(
            value(samples, f"pagedlm:{name}")
            for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")
        )
        if state == (0, 0, idle):
            return samples
        assert time.monotonic() < deadline, state
        time.sleep(0.2)


def test_disconnect_aborts(server):
    headers = {"Authorization": f"Bearer {KEY}"}
    idle = value(scrape(server.url), "pagedlm:kv_cache_usage_perc")

    async def run() -> None:
        async with httpx.AsyncClient(headers=headers, timeout=60) as client:
            await asyncio.gather(
                *(_open_and_drop(client, f"{server.url}/v1/completions") for _ in range(50))
            )

    asyncio.run(run())
    samples = _wait_idle(server.url, idle)
    generated = value(samples, "pagedlm:generation_tokens_total")
    assert generated < 50 * 200  # the requests really stopped early
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)
    # ignore_eos: the random tiny model samples its EOS at times, which is not the point.
    after = client.completions.create(
        model="tiny", prompt="after", max_tokens=3, extra_body={"ignore_eos": True}
    )
    assert after.usage.completion_tokens == 3


def test_disconnect_aborts_non_streaming(server):
    idle = value(scrape(server.url), "pagedlm:kv_cache_usage_perc")
    before = value(scrape(server.url), "pagedlm:generation_tokens_total")
    body = json.dumps({"model": "tiny", "prompt": "wait", "max_tokens": 1000, "ignore_eos": True})
    host, port = server.url.removeprefix("http://").split(":")
    request = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {KEY}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n{body}"
    )
    # The client goes away 0.1 s after asking: 1,000 tokens take the server longer (a
    # 0.5 s read timeout left 500 of them time to finish on a Zen 5 core).
    with socket.create_connection((host, int(port))) as client:
        client.sendall(request.encode())
        time.sleep(0.1)
    samples = _wait_idle(server.url, idle)
    assert value(samples, "pagedlm:generation_tokens_total") - before < 1000


def test_sigterm_drains_in_flight_requests(server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)
    children = child_pids(server.process.pid)
    assert children, "the engine core should run as a child process"
    result: dict = {}
    first_chunk = threading.Event()

    def stream() -> None:
        texts = []
        for chunk in client.completions.create(
            model="tiny",
            prompt="drain",
            max_tokens=60,
            stream=True,
            extra_body={"ignore_eos": True},
        ):
            texts.append(chunk.choices[0].text)
            first_chunk.set()
            result["finish"] = chunk.choices[0].finish_reason
        result["chunks"] = len(texts)

    thread = threading.Thread(target=stream)
    thread.start()
    assert first_chunk.wait(30)
    server.process.send_signal(signal.SIGTERM)
    thread.join(30)
    assert result.get("finish") == "length", result
    assert server.process.wait(30) == 0
    time.sleep(0.5)
    for pid in children:
        assert not _alive(pid), f"child process {pid} outlived the server"
    assert KEY not in server.log_text()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split()[2] != "Z"
    except FileNotFoundError:
        return False
