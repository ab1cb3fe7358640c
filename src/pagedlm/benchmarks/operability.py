"""Operability under load and faults, measured against a real ``pagedlm serve``.

``python -m pagedlm.benchmarks.operability SCENARIO [--model M]`` starts a server (the
embedded SmolLM2 by default) for each scenario, runs it, prints one JSON line of figures
and stops the server. ``/health`` is polled from a separate process, so the load
generator's own event loop does not inflate its latencies.

- ``load``: 200 streaming clients, 30% of them hanging up mid-stream, twice; /health
  status and latency, completions, and the gauges afterwards.
- ``long-prompt``: a 2.5M-character prompt while another request streams.
- ``prefill``: one 7.5k-token prompt, computed in one long step.
- ``sigstop``: SIGSTOP the engine core for 20 s; when /health turns 503, and 200 again.
- ``schema``: a 5,000-property JSON schema, and a small schema right after it.
- ``kill``: SIGKILL the engine core under 20 streams; how they end, what new requests
  get, when and how the server exits.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from pagedlm.structured_output.benchmark import large_schema

MODULE = "pagedlm.benchmarks.operability"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Server:
    """``pagedlm serve`` in a subprocess, logging to a temporary file."""

    def __init__(self, model: str | None, *flags: str) -> None:
        import httpx

        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = Path(tempfile.mkstemp(prefix="pagedlm-operability-", suffix=".log")[1])
        cmd = [sys.executable, "-m", "pagedlm.entrypoints.cli.main", "serve"]
        cmd += [model] if model else []
        cmd += ["--port", str(self.port), "--log-level", "warning", *flags]
        with open(self.log, "wb") as log:
            self.process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited:\n{self.log.read_text()[-3000:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError("the server did not become healthy within 600 s")

    def core_pid(self) -> int:
        children = []
        for task in Path(f"/proc/{self.process.pid}/task").iterdir():
            children += [int(pid) for pid in (task / "children").read_text().split()]
        (core,) = children
        return core

    def stop(self) -> int | None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                self.process.kill()
        return self.process.wait()


class HealthPoller:
    """``path`` (/health) every ``interval_s`` from another process; ``stop()`` returns
    ``[(time.monotonic() when sent, status or 0, latency in seconds), ...]`` (Linux's
    monotonic clock is one clock for all processes)."""

    def __init__(self, url: str, interval_s: float = 0.1, path: str = "/health") -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", MODULE, "_poll", url + path, str(interval_s)],
            stdout=subprocess.PIPE,
            stdin=subprocess.PIPE,
            text=True,
        )

    def stop(self) -> list[tuple[float, int, float]]:
        out, _ = self.process.communicate("stop\n", timeout=60)
        return [tuple(row) for row in json.loads(out)]


def _poll(url: str, interval_s: float) -> None:
    import threading

    import httpx

    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.readline(), stop.set()), daemon=True).start()
    rows = []
    with httpx.Client(timeout=30) as client:
        while not stop.is_set():
            sent = time.monotonic()
            try:
                status = client.get(url).status_code
            except httpx.HTTPError:
                status = 0
            rows.append((sent, status, time.monotonic() - sent))
            stop.wait(max(0.0, interval_s - (time.monotonic() - sent)))
    print(json.dumps(rows))


def _health_summary(rows: list[tuple[float, int, float]]) -> dict[str, Any]:
    latencies = sorted(row[2] for row in rows)
    if not latencies:
        return {"polls": 0}

    def quantile(q: float) -> float:
        return round(latencies[min(len(latencies) - 1, int(q * len(latencies)))] * 1e3, 1)

    return {
        "polls": len(rows),
        "non_200": sum(1 for row in rows if row[1] != 200),
        "p50_ms": quantile(0.5),
        "p99_ms": quantile(0.99),
        "max_ms": round(latencies[-1] * 1e3, 1),
    }


async def _stream(client, url: str, body: dict, hang_up_after: int | None) -> dict[str, Any]:
    """One streaming completion; returns how it ended."""
    chunks, finish, error = 0, None, None
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        if response.status_code != 200:
            return {"status": response.status_code, "chunks": 0, "finish": None, "error": True}
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                error = event["error"]["message"]
                continue
            chunks += 1
            finish = event["choices"][0].get("finish_reason") or finish
            if hang_up_after is not None and chunks >= hang_up_after:
                return {"status": 200, "chunks": chunks, "finish": "hung_up", "error": None}
    return {"status": 200, "chunks": chunks, "finish": finish, "error": error}


def _gauges(url: str) -> dict[str, float]:
    import httpx

    wanted = ("pagedlm:num_requests_running", "pagedlm:num_requests_waiting")
    wanted += ("pagedlm:kv_cache_usage_perc",)
    values = {}
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        name = line.split("{")[0].split(" ")[0]
        if name in wanted:
            values[name.split(":")[1]] = float(line.rsplit(" ", 1)[1])
    return values


def _settle(url: str, timeout_s: float = 60.0) -> tuple[float, dict[str, float]]:
    start = time.monotonic()
    while True:
        gauges = _gauges(url)
        if all(value == 0 for value in gauges.values()) or time.monotonic() - start > timeout_s:
            return time.monotonic() - start, gauges
        time.sleep(0.5)


async def _load_round(url: str, clients: int, abort_share: float, max_tokens: int, seed: int):
    import httpx

    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=clients + 10, max_keepalive_connections=clients)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        jobs = []
        for i in range(clients):
            hang_up = rng.randint(1, max_tokens // 2) if rng.random() < abort_share else None
            body = {
                "model": "SmolLM2-135M-Instruct",
                "prompt": f"Story {i}: once upon a time, in a land far away,",
                "max_tokens": max_tokens,
                "temperature": 0.8,
                "stream": True,
            }
            jobs.append((hang_up, _stream(client, url, body, hang_up)))
        started = time.monotonic()
        results = await asyncio.gather(*(job for _, job in jobs), return_exceptions=True)
        elapsed = time.monotonic() - started
    kept = [r for (hang_up, _), r in zip(jobs, results) if hang_up is None]
    complete = [r for r in kept if isinstance(r, dict) and r["finish"] in ("length", "stop")]
    return {
        "seconds": round(elapsed, 1),
        "hung_up": clients - len(kept),
        "kept": len(kept),
        "kept_complete": len(complete),
        "failures": [repr(r)[:200] for r in results if not isinstance(r, dict) or r["error"]],
    }


def scenario_load(model: str | None, clients: int = 200, rounds: int = 2) -> dict[str, Any]:
    server = Server(model, "--served-model-name", "SmolLM2-135M-Instruct")
    try:
        poller = HealthPoller(server.url, 0.1)
        results = []
        for index in range(rounds):
            result = asyncio.run(_load_round(server.url, clients, 0.3, 32, seed=index))
            settle_s, gauges = _settle(server.url)
            result.update(settle_s=round(settle_s, 1), gauges_after=gauges)
            results.append(result)
        return {"rounds": results, "health": _health_summary(poller.stop())}
    finally:
        server.stop()


def scenario_long_prompt(model: str | None, chars: int = 2_500_000) -> dict[str, Any]:
    """A prompt of ``chars`` characters (far past the context: it is tokenized, counted
    and refused) while another request streams; the stream's longest pause between
    chunks while the long prompt is processed, and /health meanwhile."""
    import httpx

    server = Server(model, "--served-model-name", "m")
    try:

        async def run() -> dict[str, Any]:
            async with httpx.AsyncClient(timeout=600) as client:
                arrivals: list[float] = []

                async def stream() -> None:
                    body = {"model": "m", "prompt": "Count:", "max_tokens": 1000, "stream": True}
                    body["ignore_eos"] = True
                    url = f"{server.url}/v1/completions"
                    async with client.stream("POST", url, json=body) as response:
                        async for line in response.aiter_lines():
                            if line.startswith("data: "):
                                arrivals.append(time.monotonic())

                streaming = asyncio.ensure_future(stream())
                while len(arrivals) < 8:
                    await asyncio.sleep(0.1)
                started = time.monotonic()
                body = {"model": "m", "prompt": "word " * (chars // 5), "max_tokens": 4}
                long = await client.post(f"{server.url}/v1/completions", json=body)
                ended = time.monotonic()
                await asyncio.sleep(2.0)
                streaming.cancel()
                await asyncio.gather(streaming, return_exceptions=True)
                during = [t for t in arrivals if started <= t <= ended + 2.0]
                gaps = [b - a for a, b in itertools.pairwise(during)]
                before = [b - a for a, b in itertools.pairwise(arrivals) if b < started]
                return {
                    "other_stream_median_gap_before_ms": round(
                        sorted(before)[len(before) // 2] * 1e3, 1
                    ),
                    "long_prompt_status": long.status_code,
                    "long_prompt_seconds": round(ended - started, 1),
                    "long_prompt_message": long.text[:200],
                    "other_stream_chunks_meanwhile": len(during),
                    "other_stream_max_gap_ms": round(max(gaps, default=0) * 1e3, 1),
                }

        poller = HealthPoller(server.url, 0.1)
        result = asyncio.run(run())
        result["health"] = _health_summary(poller.stop())
        return result
    finally:
        server.stop()


def scenario_prefill(model: str | None, num_words: int = 7400) -> dict[str, Any]:
    """One long but healthy prefill step (about 7.5k tokens in one step): /health should
    stay 200 throughout, /ready may say busy."""
    import httpx

    server = Server(model, "--served-model-name", "m")
    try:
        health, ready = HealthPoller(server.url, 0.2), HealthPoller(server.url, 0.2, "/ready")
        time.sleep(1.0)
        body = {"model": "m", "prompt": "word " * num_words, "max_tokens": 2}
        started = time.monotonic()
        response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=900)
        seconds = time.monotonic() - started
        time.sleep(1.0)
        ready_rows = ready.stop()
        return {
            "prefill_status": response.status_code,
            "prefill_seconds": round(seconds, 1),
            "prompt_tokens": response.json().get("usage", {}).get("prompt_tokens"),
            "health": _health_summary(health.stop()),
            "ready_non_200": sum(1 for row in ready_rows if row[1] != 200),
            "ready_polls": len(ready_rows),
        }
    finally:
        server.stop()


def scenario_sigstop(model: str | None, stop_s: float = 20.0) -> dict[str, Any]:
    server = Server(model)
    try:
        core = server.core_pid()
        poller = HealthPoller(server.url, 0.1)
        time.sleep(1.0)
        stopped = time.monotonic()
        os.kill(core, signal.SIGSTOP)
        time.sleep(stop_s)
        resumed = time.monotonic()
        os.kill(core, signal.SIGCONT)
        time.sleep(5.0)
        rows = poller.stop()
        noticed = _first(rows, lambda row: row[0] > stopped and row[1] != 200)
        back = _first(rows, lambda row: row[0] > resumed and row[1] == 200)
        return {
            "stopped_for_s": stop_s,
            "503_after_stop_s": None if noticed is None else round(noticed - stopped, 2),
            "200_after_cont_s": None if back is None else round(back - resumed, 2),
            "non_200_before_stop": sum(1 for r in rows if r[0] < stopped and r[1] != 200),
            "health": _health_summary(rows),
        }
    finally:
        server.stop()


def _first(rows, predicate) -> float | None:
    """When the first poll matching ``predicate`` was answered."""
    return next((row[0] + row[2] for row in rows if predicate(row)), None)


def _post(url: str, body: dict) -> tuple[int, float, str]:
    import httpx

    started = time.monotonic()
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=600)
    return response.status_code, round(time.monotonic() - started, 2), response.text[:240]


def scenario_schema(model: str | None, num_properties: int = 5000) -> dict[str, Any]:
    import threading

    server = Server(model, "--served-model-name", "m")

    def body(schema: dict) -> dict:
        return {
            "model": "m",
            "prompt": "JSON:",
            "max_tokens": 1,
            "structured_outputs": {"json": schema},
        }

    def small(name: str) -> dict:
        return {"type": "object", "properties": {name: {"type": "integer"}}, "required": [name]}

    try:
        free = {"model": "m", "prompt": "JSON:", "max_tokens": 1}
        result: dict[str, Any] = {
            "unconstrained_one_token": _post(server.url, free)[:2],
            "first_constrained_request": _post(server.url, body(small("warm"))),
        }
        big: dict[str, Any] = {}
        thread = threading.Thread(
            target=lambda: big.setdefault(
                "r", _post(server.url, body(large_schema(num_properties)))
            )
        )
        thread.start()
        time.sleep(0.1)
        result["small_after_big"] = _post(server.url, body(small("fresh")))
        thread.join()
        result["big"] = big["r"]
        result["schema_chars"] = len(json.dumps(large_schema(num_properties)))
        return result
    finally:
        server.stop()


def scenario_kill(model: str | None, streams: int = 20) -> dict[str, Any]:
    import httpx

    server = Server(model, "--served-model-name", "m")
    try:

        async def run() -> dict[str, Any]:
            async with httpx.AsyncClient(timeout=120) as client:
                started = [asyncio.Event() for _ in range(streams)]
                ended: list[tuple[float, bool]] = []

                async def one(index: int) -> None:
                    body = {"model": "m", "prompt": f"{index}", "max_tokens": 500}
                    body.update(stream=True, ignore_eos=True)
                    error = False
                    async with client.stream(
                        "POST", f"{server.url}/v1/completions", json=body
                    ) as r:
                        async for line in r.aiter_lines():
                            started[index].set()
                            error = error or '"error"' in line
                    ended.append((time.monotonic(), error))

                tasks = [asyncio.ensure_future(one(i)) for i in range(streams)]
                await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 300)
                killed = time.monotonic()
                os.kill(server.core_pid(), signal.SIGKILL)
                await asyncio.gather(*tasks, return_exceptions=True)
                await asyncio.sleep(0.3)
                late = await client.post(
                    f"{server.url}/v1/completions", json={"model": "m", "prompt": "x"}
                )
                status = await asyncio.to_thread(server.process.wait, 60)
                return {
                    "streams": streams,
                    "ended_with_error_event": sum(1 for _, error in ended if error),
                    "last_stream_end_after_kill_s": round(max(t for t, _ in ended) - killed, 2),
                    "new_request_status": late.status_code,
                    "new_request_message": late.json()["error"]["message"][:160],
                    "server_exit_status": status,
                    "server_exit_after_kill_s": round(time.monotonic() - killed, 2),
                }

        return asyncio.run(run())
    finally:
        server.stop()


SCENARIOS = {
    "load": scenario_load,
    "long-prompt": scenario_long_prompt,
    "prefill": scenario_prefill,
    "sigstop": scenario_sigstop,
    "schema": scenario_schema,
    "kill": scenario_kill,
}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_poll"]:
        _poll(argv[1], float(argv[2]))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("scenario", choices=[*SCENARIOS, "all"])
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2")
    args = parser.parse_args(argv)
    names = list(SCENARIOS) if args.scenario == "all" else [args.scenario]
    for name in names:
        result = SCENARIOS[name](args.model)
        print(json.dumps({"scenario": name, **result}), flush=True)


if __name__ == "__main__":
    main()
