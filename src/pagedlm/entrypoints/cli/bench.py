"""``pagedlm bench serve``: load a running server and report throughput and latencies.

Requests go to ``/v1/completions`` with ``stream=true``, ``ignore_eos``, special tokens
shown as text and a fixed ``max_tokens``, so every request produces the same number of
tokens, each visible in the stream. Arrivals are
Poisson at ``--request-rate`` requests/s, or all at once (``inf``, a burst).

- TTFT: request sent -> first streamed text.
- ITL: gaps between streamed chunks after the first.
- TPOT: (end-to-end - TTFT) / (output tokens - 1), per request.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import multiprocessing
import os
import random
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

_WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "a",
    "lazy",
    "dog",
    "while",
    "seven",
    "wizards",
    "quietly",
    "mix",
    "potions",
    "near",
    "an",
    "old",
    "stone",
    "bridge",
    "under",
    "pale",
    "morning",
    "light",
]


@dataclass
class RequestResult:
    ok: bool
    ttft: float = 0.0
    e2e: float = 0.0
    output_tokens: int = 0
    itl: list[float] = field(default_factory=list)
    error: str = ""
    end: float = 0.0
    """When the request ended (monotonic clock, shared by the client processes)."""


def _at_least_one(kind: type) -> Any:
    """A flag's type: a number of ``kind`` (int or float) above zero."""

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            value = 0
        if not value > 0:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number above 0")
        return value

    parse.__name__ = kind.__name__
    return parse


def add_bench_serve_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--base-url", default="http://127.0.0.1:8000", help="(default: %(default)s)"
    )
    parser.add_argument("--model", default=None, help="Model name (default: the server's first).")
    parser.add_argument("--api-key", default=None)
    parser.add_argument(
        "--num-prompts", type=_at_least_one(int), default=50, help="(default: %(default)s)"
    )
    parser.add_argument(
        "--request-rate",
        type=_at_least_one(float),
        default=float("inf"),
        help="Requests per second, Poisson arrivals; inf sends all at once (default: %(default)s).",
    )
    parser.add_argument(
        "--input-len",
        type=_at_least_one(int),
        default=32,
        help="Prompt length in words (default: %(default)s).",
    )
    parser.add_argument(
        "--output-len",
        type=_at_least_one(int),
        default=32,
        help="Tokens per request (default: %(default)s).",
    )
    parser.add_argument(
        "--max-concurrency",
        type=_at_least_one(int),
        default=None,
        help="At most this many requests in flight at once (default: no limit).",
    )
    parser.add_argument(
        "--client-processes",
        type=_at_least_one(int),
        default=None,
        help="Client processes sharing the load (default: 1 up to 64 prompts, else up to 4, "
        "a quarter of the cores).",
    )
    parser.add_argument("--seed", type=int, default=0, help="(default: %(default)s)")
    parser.add_argument("--result-json", default=None, help="Also write the summary here.")


def prompt_texts(rng: random.Random, num_prompts: int, input_len: int) -> list[str]:
    """The benchmark's prompts: ``input_len`` words drawn from a fixed list, by ``rng``."""
    return [" ".join(rng.choice(_WORDS) for _ in range(input_len)) for _ in range(num_prompts)]


async def _one_request(client: Any, url: str, body: dict) -> RequestResult:
    start = time.monotonic()
    chunk_times: list[float] = []
    tokens = 0
    events = 0
    finish_reason = None
    try:
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                await response.aread()
                return RequestResult(
                    False,
                    error=f"{response.status_code}: {response.text[:200]}",
                    end=time.monotonic(),
                )
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                events += 1
                if "error" in chunk:
                    return RequestResult(
                        False, error=chunk["error"]["message"], end=time.monotonic()
                    )
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
                choices = chunk.get("choices", [])
                if any(choice.get("text") for choice in choices):
                    chunk_times.append(time.monotonic())
                for choice in choices:
                    finish_reason = choice.get("finish_reason") or finish_reason
    except Exception as error:  # connection refused/reset: report, keep benchmarking
        return RequestResult(False, error=repr(error), end=time.monotonic())
    end = time.monotonic()
    if not chunk_times:
        # Say what the stream did carry, so a failure seen once on a GPU run can be traced.
        error = f"no output ({events} events, {tokens} tokens in usage, finish {finish_reason})"
        return RequestResult(False, error=error, end=end)
    itl = [b - a for a, b in itertools.pairwise(chunk_times)]
    return RequestResult(True, chunk_times[0] - start, end - start, tokens, itl, end=end)


def _summary(values_s: list[float]) -> dict[str, float]:
    if not values_s:
        return {"mean_ms": float("nan"), "p50_ms": float("nan"), "p99_ms": float("nan")}
    ordered = sorted(values_s)

    def percentile(p: float) -> float:
        return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))] * 1000

    return {
        "mean_ms": statistics.fmean(ordered) * 1000,
        "p50_ms": percentile(50),
        "p99_ms": percentile(99),
    }


def client_processes(requested: int | None, num_prompts: int) -> int:
    """How many client processes share the load: one parses ~10k streamed events/s, less
    than a fast server sends, so big runs spread over up to four (a core each, leaving
    the rest to the server)."""
    if requested is not None:
        return max(1, requested)
    if num_prompts <= 64:
        return 1
    return max(1, min(4, (os.cpu_count() or 1) // 4))


async def _send_all(
    base: str,
    headers: dict[str, str],
    bodies: list[dict],
    offsets: list[float],
    start: float,
    max_concurrency: int | None,
) -> list[RequestResult]:
    """Send ``bodies[i]`` at ``start + offsets[i]`` (monotonic clock) and collect results."""
    import httpx

    # httpx's default pool holds 100 connections: a burst of more would queue in the
    # client, and its waits would count as the server's time to first token.
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    # With a concurrency limit a request's clock starts once it may be sent (as vLLM's).
    gate = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    url = f"{base}/v1/completions"
    async with httpx.AsyncClient(headers=headers, timeout=None, limits=limits) as client:

        async def send(body: dict, offset: float) -> RequestResult:
            delay = start + offset - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            if gate is None:
                return await _one_request(client, url, body)
            async with gate:
                return await _one_request(client, url, body)

        return await asyncio.gather(*(send(b, o) for b, o in zip(bodies, offsets)))


def _client_process(share, headers, max_concurrency, barrier, start_time, results) -> None:
    base, bodies, offsets = share
    barrier.wait()  # every client is up ...
    barrier.wait()  # ... and the start time is set
    results.put(
        asyncio.run(_send_all(base, headers, bodies, offsets, start_time.value, max_concurrency))
    )


def _send_from_processes(
    base: str,
    headers: dict[str, str],
    bodies: list[dict],
    offsets: list[float],
    max_concurrency: int | None,
    num_processes: int,
) -> tuple[float, list[RequestResult]]:
    """(start time, results): request ``i`` goes from process ``i % num_processes``."""
    if num_processes == 1:
        start = time.monotonic()
        return start, asyncio.run(_send_all(base, headers, bodies, offsets, start, max_concurrency))
    context = multiprocessing.get_context("spawn")
    barrier = context.Barrier(num_processes + 1)
    start_time = context.Value("d", 0.0)
    results = context.Queue()
    share_limit = -(-max_concurrency // num_processes) if max_concurrency else None
    shares = [
        (base, bodies[i::num_processes], offsets[i::num_processes]) for i in range(num_processes)
    ]
    workers = [
        context.Process(
            target=_client_process,
            args=(share, headers, share_limit, barrier, start_time, results),
            daemon=True,
        )
        for share in shares
    ]
    for worker in workers:
        worker.start()
    try:
        barrier.wait(timeout=120)
        start_time.value = time.monotonic()
        barrier.wait(timeout=10)
        gathered = [result for _ in workers for result in results.get()]
    finally:
        for worker in workers:
            worker.join(timeout=10)
            if worker.is_alive():
                worker.kill()
    return start_time.value, gathered


def bench_serve(args: argparse.Namespace) -> dict[str, Any]:
    import httpx

    rng = random.Random(args.seed)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    base = args.base_url.rstrip("/")
    model = args.model
    if model is None:
        try:
            models = httpx.get(f"{base}/v1/models", headers=headers)
        except httpx.ConnectError as error:
            raise SystemExit(
                f"error: cannot connect to {base} ({error}); start `pagedlm serve` there "
                "first, or pass --base-url."
            ) from None
        model = models.json()["data"][0]["id"]
    bodies = [
        {
            "model": model,
            "prompt": prompt,
            "max_tokens": args.output_len,
            "ignore_eos": True,
            # Every token shows as text, so TTFT and ITL see every token: a random-weight
            # model may repeat a special token, whose text is otherwise skipped.
            "skip_special_tokens": False,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        for prompt in prompt_texts(rng, args.num_prompts, args.input_len)
    ]
    offsets = list(itertools.accumulate(
        (0.0 if args.request_rate == float("inf") else rng.expovariate(args.request_rate)
         for _ in bodies[1:]),
        initial=0.0,
    ))  # fmt: skip
    num_processes = client_processes(getattr(args, "client_processes", None), len(bodies))
    start, results = _send_from_processes(
        base, headers, bodies, offsets, args.max_concurrency, num_processes
    )
    duration = max((r.end for r in results), default=start) - start
    ok = [r for r in results if r.ok]
    output_tokens = sum(r.output_tokens for r in ok)
    return {
        "request_rate": args.request_rate,
        "num_prompts": args.num_prompts,
        "client_processes": num_processes,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": duration,
        "request_throughput": len(ok) / duration,
        "output_token_throughput": output_tokens / duration,
        "ttft": _summary([r.ttft for r in ok]),
        "tpot": _summary(
            [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
        ),
        "itl": _summary([gap for r in ok for gap in r.itl]),
        "e2e": _summary([r.e2e for r in ok]),
    }


def _print(summary: dict[str, Any]) -> None:
    print(f"{'request rate':<28}{summary['request_rate']}")
    print(f"{'completed / failed':<28}{summary['completed']} / {summary['failed']}")
    for error in summary["errors"]:
        print(f"  error: {error}")
    print(f"{'duration (s)':<28}{summary['duration_s']:.2f}")
    print(f"{'request throughput (req/s)':<28}{summary['request_throughput']:.2f}")
    print(f"{'output throughput (tok/s)':<28}{summary['output_token_throughput']:.1f}")
    for name in ("ttft", "tpot", "itl", "e2e"):
        s = summary[name]
        print(
            f"{name.upper() + ' (ms)':<28}mean {s['mean_ms']:.1f}  p50 {s['p50_ms']:.1f}  "
            f"p99 {s['p99_ms']:.1f}"
        )


def run_bench_serve(args: argparse.Namespace) -> dict[str, Any]:
    summary = bench_serve(args)
    _print(summary)
    if args.result_json:
        with open(args.result_json, "w") as file:
            json.dump(summary, file, indent=2)
    return summary
