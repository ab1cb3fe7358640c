"""Serving against offline, side by side: ``pagedlm serve`` loaded by ``pagedlm bench serve``
(a burst, then Poisson arrivals), and the offline engine on the same token ids.

The server runs in a subprocess with the engine flags given after ``--`` (plus
``--model``'s config directory, resolved from a built-in shape name like the other
benchmarks), so what it measures is what ``pagedlm serve`` users get. The offline run
tokenizes the burst's prompts with the same tokenizer and generates the same number of
tokens (``ignore_eos``, greedy) through :class:`pagedlm.LLM` with the same engine flags;
``burst / offline`` is the share of the engine's speed the HTTP path keeps.

    python -m pagedlm.benchmarks.serving --model qwen3-0.6b --tokenizer DIR \\
        --result-json out.json -- --load-format dummy
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

from pagedlm.benchmarks.shapes import resolve_model
from pagedlm.entrypoints.cli.bench import prompt_texts, run_bench_serve


def _wait_ready(base_url: str, server: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"the server exited with {server.returncode} before it was ready")
        with (
            contextlib.suppress(OSError),
            urllib.request.urlopen(f"{base_url}/v1/models", timeout=2) as response,
        ):
            if response.status == 200:
                return
        time.sleep(1.0)
    raise TimeoutError(f"the server was not ready within {timeout_s:.0f} s")


@contextlib.contextmanager
def running_server(
    model_dir: str, tokenizer: str, port: int, engine_flags: list[str], profile: str | None = None
) -> Iterator[str]:
    """``pagedlm serve`` in a subprocess (under cProfile, writing ``profile``, if given);
    yields its base URL and stops it on exit."""
    profiler = ["-m", "cProfile", "-o", profile] if profile else []
    command = [sys.executable, *profiler, "-m", "pagedlm.entrypoints.cli.main", "serve"]
    command += [model_dir, "--tokenizer", tokenizer, "--port", str(port), *engine_flags]
    server = subprocess.Popen(command)
    base_url = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(base_url, server, timeout_s=600)
        yield base_url
    finally:
        server.terminate()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def _bench_args(
    base_url: str, num_prompts: int, rate: float, input_len: int, output_len: int, seed: int
) -> argparse.Namespace:
    return argparse.Namespace(
        base_url=base_url,
        model=None,
        api_key=None,
        num_prompts=num_prompts,
        request_rate=rate,
        max_concurrency=None,
        client_processes=None,
        input_len=input_len,
        output_len=output_len,
        seed=seed,
        result_json=None,
    )


def _engine_args(model_dir: str, tokenizer: str, engine_flags: list[str]) -> Any:
    """``EngineArgs`` from the same flags the server got."""
    from pagedlm.engine import cli_args

    parser = argparse.ArgumentParser()
    cli_args.add_engine_args(parser)
    args = parser.parse_args(["--model", model_dir, "--tokenizer", tokenizer, *engine_flags])
    return cli_args.engine_args_from_cli(args)


def offline_throughput(
    model_dir: str, tokenizer: str, engine_flags: list[str], prompts: list[str], output_len: int
) -> dict[str, Any]:
    """Output tok/s of :class:`pagedlm.LLM` on the burst's prompts as token ids."""
    import dataclasses

    from pagedlm import LLM, SamplingParams

    llm = LLM(**dataclasses.asdict(_engine_args(model_dir, tokenizer, engine_flags)))
    token_ids = [llm.get_tokenizer().encode(p) for p in prompts]
    params = SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0.0)
    llm.generate([{"prompt_token_ids": token_ids[0]}], params, use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": t} for t in token_ids], params, use_tqdm=False)
    duration = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {
        "output_token_throughput": tokens / duration,
        "duration_s": duration,
        "mean_prompt_tokens": sum(map(len, token_ids)) / len(token_ids),
    }


def async_engine_burst(
    model_dir: str, tokenizer: str, engine_flags: list[str], prompts: list[str], output_len: int
) -> dict[str, Any]:
    """The burst through :class:`pagedlm.AsyncLLM` alone (no HTTP): what the front end's
    output path costs, apart from the server's."""
    import asyncio

    from pagedlm import SamplingParams
    from pagedlm.engine.async_llm import AsyncLLM
    from pagedlm.entrypoints.cli.bench import _summary
    from pagedlm.sampling_params import RequestOutputKind

    engine = AsyncLLM.from_engine_args(_engine_args(model_dir, tokenizer, engine_flags))
    params = SamplingParams(
        max_tokens=output_len,
        ignore_eos=True,
        temperature=0.0,
        output_kind=RequestOutputKind.DELTA,
    )

    async def one(request_id: str, prompt: str) -> tuple[float, int]:
        start = time.perf_counter()
        first = None
        tokens = 0
        async for output in engine.generate(prompt, params, request_id):
            tokens += len(output.outputs[0].token_ids)
            if first is None and tokens:
                first = time.perf_counter() - start
        return first or 0.0, tokens

    async def burst(tag: str, batch: list[str]) -> tuple[float, list[tuple[float, int]]]:
        start = time.perf_counter()
        results = await asyncio.gather(*(one(f"{tag}-{i}", p) for i, p in enumerate(batch)))
        return time.perf_counter() - start, results

    async def run() -> dict[str, Any]:
        await burst("warmup", prompts[:16])
        duration, results = await burst("burst", prompts)
        return {
            "output_token_throughput": sum(t for _, t in results) / duration,
            "duration_s": duration,
            "ttft": _summary([ttft for ttft, _ in results]),
        }

    try:
        return asyncio.run(run())
    finally:
        engine.shutdown()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen3-0.6b", help="built-in shape or directory")
    parser.add_argument("--tokenizer", required=True, help="tokenizer directory")
    parser.add_argument("--port", type=int, default=8123)
    parser.add_argument("--burst-prompts", type=int, default=256)
    parser.add_argument("--burst-output-len", type=int, default=512)
    parser.add_argument("--poisson-rate", type=float, default=20.0)
    parser.add_argument("--poisson-prompts", type=int, default=400)
    parser.add_argument("--poisson-output-len", type=int, default=256)
    parser.add_argument("--input-len", type=int, default=400, help="prompt words")
    parser.add_argument("--warmup-prompts", type=int, default=16)
    parser.add_argument("--skip-offline", action="store_true")
    parser.add_argument(
        "--async-engine", action="store_true", help="also run the burst on AsyncLLM alone"
    )
    parser.add_argument("--profile-server", default=None, help="cProfile the server into this file")
    parser.add_argument("--result-json", default=None)
    args = parser.parse_args(argv[:split])
    engine_flags = argv[split + 1 :]
    model_dir = resolve_model(args.model)
    seed = 0
    results: dict[str, Any] = {"engine_flags": engine_flags}
    server = running_server(model_dir, args.tokenizer, args.port, engine_flags, args.profile_server)
    with server as base_url:
        # Warm-up: first-use kernel compiles are not what a serving figure measures.
        run_bench_serve(
            _bench_args(base_url, args.warmup_prompts, float("inf"), args.input_len, 32, seed + 1)
        )
        results["burst"] = run_bench_serve(
            _bench_args(
                base_url,
                args.burst_prompts,
                float("inf"),
                args.input_len,
                args.burst_output_len,
                seed,
            )
        )
        results["poisson"] = run_bench_serve(
            _bench_args(
                base_url,
                args.poisson_prompts,
                args.poisson_rate,
                args.input_len,
                args.poisson_output_len,
                seed + 2,
            )
        )
    prompts = prompt_texts(random.Random(seed), args.burst_prompts, args.input_len)
    if args.async_engine:
        results["async_engine"] = async_engine_burst(
            model_dir, args.tokenizer, engine_flags, prompts, args.burst_output_len
        )
        print("AsyncLLM burst:", json.dumps(results["async_engine"]), flush=True)
    if not args.skip_offline:
        offline = offline_throughput(
            model_dir, args.tokenizer, engine_flags, prompts, args.burst_output_len
        )
        results["offline"] = offline
        results["burst_over_offline"] = (
            results["burst"]["output_token_throughput"] / offline["output_token_throughput"]
        )
        print(
            f"offline {offline['output_token_throughput']:.1f} tok/s; burst/offline "
            f"{results['burst_over_offline']:.3f}",
            flush=True,
        )
    if args.result_json:
        os.makedirs(os.path.dirname(os.path.abspath(args.result_json)), exist_ok=True)
        with open(args.result_json, "w") as file:
            json.dump(results, file, indent=2)
    return results


if __name__ == "__main__":
    main()
