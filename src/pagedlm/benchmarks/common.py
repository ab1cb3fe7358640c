"""What the throughput and latency benchmarks share: engine flags, building the engine
from a shape name or directory, the speed-of-light line, and a per-step profile."""

from __future__ import annotations

import argparse
import time
from collections import defaultdict
from typing import Any

from pagedlm.benchmarks.shapes import resolve_model
from pagedlm.benchmarks.speed_of_light import DEFAULT_BANDWIDTH, DEFAULT_FLOPS


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default="qwen3-0.6b",
        help="built-in shape (qwen3-0.6b, llama-3.2-1b, llama-3-8b) or a model directory",
    )
    parser.add_argument("--load-format", default="dummy", help="dummy: random weights")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=16384)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    parser.add_argument("--bandwidth", type=float, default=DEFAULT_BANDWIDTH, help="bytes/s")
    parser.add_argument("--flops", type=float, default=DEFAULT_FLOPS, help="FLOP/s")
    parser.add_argument(
        "--profile-steps", type=int, default=0, help="profile this many steps after the run"
    )
    parser.add_argument("--compare-transformers", action="store_true")


def build_llm(args: argparse.Namespace):
    import os

    from pagedlm import LLM

    if args.enforce_eager:
        os.environ["PAGEDLM_ENFORCE_EAGER"] = "1"
    model_dir = resolve_model(args.model)
    start = time.perf_counter()
    llm = LLM(
        model_dir,
        dtype=args.dtype,
        load_format=args.load_format,
        skip_tokenizer_init=True,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=args.block_size,
    )
    print(f"engine ready in {time.perf_counter() - start:.1f} s ({model_dir})", flush=True)
    return llm, model_dir


def profile_steps(llm, prompts: list[list[int]], params: list[Any], num_steps: int) -> str:
    """Run the requests, profile ``num_steps`` engine steps once every request is
    decoding, and group the device time by kind (attention, GEMM, sampler, other)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    engine = llm.llm_engine
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_processed_request(
            engine.process_request(f"prof-{i}", {"prompt_token_ids": p}, sp)
        )
    for _ in range(8):  # past the prefills
        engine.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        for _ in range(num_steps):
            engine.step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    engine.abort_request([f"prof-{i}" for i in range(len(prompts))])
    while engine.has_unfinished_requests():
        engine.step()
    groups: dict[str, float] = defaultdict(float)
    for event in prof.key_averages():
        device_us = getattr(event, "self_device_time_total", 0) or getattr(
            event, "self_cuda_time_total", 0
        )
        if device_us <= 0:
            continue
        name = event.key.lower()
        if "decode" in name or "prefill" in name or "write_kv" in name:
            kind = "attention"
        elif any(k in name for k in ("gemm", "nvjet", "cutlass", "matmul", "sm90", "xmma")):
            kind = "GEMM"
        elif any(k in name for k in ("sort", "topk", "softmax", "exponential", "argmax", "scan")):
            kind = "sampler"
        elif any(k in name for k in ("rms_norm", "rotary", "silu")):
            kind = "norm/rope/act"
        else:
            kind = "other kernels"
        groups[kind] += device_us
    device_total = sum(groups.values()) / 1e6
    lines = [
        f"per-step breakdown over {num_steps} decode steps ({wall / num_steps * 1e3:.2f} ms/step):"
    ]
    for kind, us in sorted(groups.items(), key=lambda kv: -kv[1]):
        lines.append(f"  {kind:14s} {us / num_steps / 1e3:8.3f} ms/step")
    idle = max(0.0, wall - device_total)
    lines.append(f"  {'GPU idle (CPU)':14s} {idle / num_steps * 1e3:8.3f} ms/step")
    top = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=15)
    return "\n".join(lines) + "\n" + top
