"""Killing the engine-core process: /health turns 503 and in-flight requests fail promptly."""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import openai
import pytest
from server_utils import child_pids, start_server


@pytest.fixture(scope="module")
def server(chat_checkpoint, tmp_path_factory):
    server = start_server(chat_checkpoint, tmp_path_factory.mktemp("logs") / "death.log")
    yield server
    server.stop()


def test_killed_core_fails_requests_and_health(server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=30)
    streaming: dict = {}
    whole: dict = {}
    first_chunk = threading.Event()

    def stream() -> None:
        try:
            for _ in client.completions.create(
                model="tiny",
                prompt="long",
                max_tokens=400,
                stream=True,
                extra_body={"ignore_eos": True},
            ):
                first_chunk.set()
        except openai.APIError as error:
            streaming["error"] = error
        streaming["ended"] = time.monotonic()

    def non_streaming() -> None:
        try:
            client.completions.create(
                model="tiny", prompt="long too", max_tokens=400, extra_body={"ignore_eos": True}
            )
        except openai.APIError as error:
            whole["error"] = error
        whole["ended"] = time.monotonic()

    threads = [threading.Thread(target=stream), threading.Thread(target=non_streaming)]
    for thread in threads:
        thread.start()
    assert first_chunk.wait(30)
    (core,) = child_pids(server.process.pid)
    killed = time.monotonic()
    os.kill(core, signal.SIGKILL)
    for thread in threads:
        thread.join(15)
    assert "error" in streaming and "error" in whole, (streaming, whole)
    assert streaming["ended"] - killed < 5 and whole["ended"] - killed < 5
    assert isinstance(whole["error"], openai.InternalServerError)
    assert "engine core" in str(whole["error"])
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 503
    with pytest.raises(openai.InternalServerError):
        client.completions.create(model="tiny", prompt="after", max_tokens=2)
    assert httpx.get(f"{server.url}/metrics").status_code == 200
