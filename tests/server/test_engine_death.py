"""Killing the engine-core process: streams end with an error event at once, new requests
get 503 naming the cause, and ``pagedlm serve`` exits non-zero after its grace period (or
stays up with ``--keep-alive-on-engine-death``)."""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import openai
import pytest
from server_utils import child_pids, start_server

GRACE_S = 3.0


def _kill_core_during_requests(server) -> tuple[float, dict, dict]:
    """Start a streaming and a non-streaming request, SIGKILL the core once the stream
    has produced a chunk; (kill time, stream result, non-streaming result)."""
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=30)
    streaming: dict = {"chunks": 0}
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
                streaming["chunks"] += 1
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
    return killed, streaming, whole


def test_killed_core_fails_requests_then_the_server_exits(chat_checkpoint, tmp_path):
    server = start_server(
        chat_checkpoint, tmp_path / "death.log", "--engine-death-grace-period", str(GRACE_S)
    )
    try:
        killed, streaming, whole = _kill_core_during_requests(server)
        assert "error" in streaming and "error" in whole, (streaming, whole)
        print(
            f"stream ended {streaming['ended'] - killed:.2f} s and the non-streaming request "
            f"{whole['ended'] - killed:.2f} s after the kill"
        )
        assert streaming["ended"] - killed < 5 and whole["ended"] - killed < 5
        assert isinstance(whole["error"], openai.InternalServerError)
        assert whole["error"].status_code == 503 and "signal 9" in str(whole["error"])
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.InternalServerError) as late:
            client.completions.create(model="tiny", prompt="after", max_tokens=2)
        assert late.value.status_code == 503 and "engine core" in str(late.value)
        health = httpx.get(f"{server.url}/health", timeout=10)
        assert health.status_code == 503 and "signal 9" in health.json()["error"]["message"]
        ready = httpx.get(f"{server.url}/ready", timeout=10)
        assert ready.status_code == 503 and ready.json()["status"] == "dead"
        status = server.process.wait(timeout=15)
        print(f"pagedlm serve exited with {status} {time.monotonic() - killed:.2f} s after")
        assert status == 1
        assert time.monotonic() - killed < 10 + 5  # grace 3 s, drain, engine shutdown
        assert "--keep-alive-on-engine-death" in server.log_text()
    finally:
        server.stop()


@pytest.mark.slow
def test_keep_alive_on_engine_death_stays_up(chat_checkpoint, tmp_path):
    server = start_server(
        chat_checkpoint,
        tmp_path / "alive.log",
        "--engine-death-grace-period", "0.5",
        "--keep-alive-on-engine-death",
    )  # fmt: skip
    try:
        (core,) = child_pids(server.process.pid)
        os.kill(core, signal.SIGKILL)
        time.sleep(3)
        assert server.process.poll() is None
        assert httpx.get(f"{server.url}/health", timeout=10).status_code == 503
        assert httpx.get(f"{server.url}/metrics").status_code == 200
    finally:
        assert server.stop() == 0
