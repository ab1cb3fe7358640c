"""``pagedlm bench serve``: load a running server and report throughput and latencies.

Requests go to ``/v1/completions`` with ``stream=true``, ``ignore_eos`` and a fixed
``max_tokens``, so every request produces the same number of tokens. Arrivals are
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


def add_bench_serve_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--base-url", default="http://127.0.0.1:8000", help="(default: %(default)s)"
    )
    parser.add_argument("--model", default=None, help="Model name (default: the server's first).")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--num-prompts", type=int, default=50, help="(default: %(default)s)")
    parser.add_argument(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="Requests per second, Poisson arrivals; inf sends all at once (default: %(default)s).",
    )
    parser.add_argument(
        "--input-len", type=int, default=32, help="Prompt length in words (default: %(default)s)."
    )
    parser.add_argument(
        "--output-len", type=int, default=32, help="Tokens per request (default: %(default)s)."
    )
    parser.add_argument("--seed", type=int, default=0, help="(default: %(default)s)")
    parser.add_argument("--result-json", default=None, help="Also write the summary here.")


async def _one_request(client: Any, url: str, body: dict) -> RequestResult:
    start = time.perf_counter()
    chunk_times: list[float] = []
    tokens = 0
    try:
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                await response.aread()
                return RequestResult(False, error=f"{response.status_code}: {response.text[:200]}")
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return RequestResult(False, error=chunk["error"]["message"])
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
                if any(choice.get("text") for choice in chunk.get("choices", [])):
                    chunk_times.append(time.perf_counter())
    except Exception as error:  # connection refused/reset: report, keep benchmarking
        return RequestResult(False, error=repr(error))
    end = time.perf_counter()
    if not chunk_times:
        return RequestResult(False, error="no output")
    itl = [b - a for a, b in itertools.pairwise(chunk_times)]
    return RequestResult(True, chunk_times[0] - start, end - start, tokens, itl)


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


async def bench_serve(args: argparse.Namespace) -> dict[str, Any]:
    import httpx

    rng = random.Random(args.seed)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    base = args.base_url.rstrip("/")
    async with httpx.AsyncClient(headers=headers, timeout=None) as client:
        model = args.model
        if model is None:
            model = (await client.get(f"{base}/v1/models")).json()["data"][0]["id"]
        bodies = [
            {
                "model": model,
                "prompt": " ".join(rng.choice(_WORDS) for _ in range(args.input_len)),
                "max_tokens": args.output_len,
                "ignore_eos": True,
                "temperature": 0.0,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            for _ in range(args.num_prompts)
        ]
        tasks = []
        start = time.perf_counter()
        for body in bodies:
            tasks.append(
                asyncio.ensure_future(_one_request(client, f"{base}/v1/completions", body))
            )
            if args.request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(args.request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    ok = [r for r in results if r.ok]
    output_tokens = sum(r.output_tokens for r in ok)
    return {
        "request_rate": args.request_rate,
        "num_prompts": args.num_prompts,
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
    summary = asyncio.run(bench_serve(args))
    _print(summary)
    if args.result_json:
        with open(args.result_json, "w") as file:
            json.dump(summary, file, indent=2)
    return summary
