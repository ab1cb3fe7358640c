"""What the throughput and latency benchmarks share: engine flags (``pagedlm serve``'s,
generated from ``EngineArgs``, with benchmark defaults), building the engine from a shape
name or directory, the speed-of-light line, a per-step profile, and a count of the Triton
kernels compiled inside a timed region."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import os
import time
from collections import defaultdict
from typing import Any

from pagedlm.benchmarks.shapes import BUILTIN_SHAPES, resolve_model
from pagedlm.benchmarks.speed_of_light import DEFAULT_BANDWIDTH, DEFAULT_FLOPS
from pagedlm.engine import cli_args

BENCH_ENGINE_DEFAULTS: dict[str, Any] = {
    "model": "qwen3-0.6b",
    "load_format": "dummy",
    "dtype": "bfloat16",
    "max_num_seqs": 256,
    "max_num_batched_tokens": 16384,
    "max_model_len": 4096,
    # Prompts are token ids and outputs are counted, never detokenized.
    "skip_tokenizer_init": True,
}
"""The benchmarks' own engine defaults, pinned whatever ``pagedlm serve``'s are: random
weights of a built-in shape, bf16, 256 sequences and a 16k-token budget per step (the
issue's measurement setup)."""


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Every engine flag of ``pagedlm serve`` (generated from ``EngineArgs``), with the
    benchmark defaults above, plus the flags that only the benchmarks have."""
    cli_args.add_engine_args(
        parser,
        defaults=BENCH_ENGINE_DEFAULTS,
        help_texts={
            "model": f"A built-in shape ({', '.join(BUILTIN_SHAPES)}; no download) or a model "
            "directory (config.json, plus weights unless --load-format dummy).",
            "load_format": "As for serve; dummy: random weights of the model's shapes.",
        },
    )
    group = parser.add_argument_group("benchmark arguments")
    group.add_argument(
        "--bandwidth",
        type=float,
        default=None,
        help="memory bandwidth in bytes/s for the speed-of-light line (default: the H200's "
        f"{DEFAULT_BANDWIDTH:.3g} on CUDA; elsewhere no line unless given)",
    )
    group.add_argument(
        "--flops",
        type=float,
        default=None,
        help=f"FLOP/s for the speed-of-light line (default: the H200's {DEFAULT_FLOPS:.3g} "
        "on CUDA; elsewhere no line unless given)",
    )
    group.add_argument(
        "--profile-steps",
        type=int,
        default=0,
        help="profile this many decode steps after the run (default: %(default)s)",
    )
    group.add_argument(
        "--profile-trace",
        default=None,
        metavar="FILE",
        help="with --profile-steps: also write the profiled steps as a Chrome trace "
        "(host calls and kernels on one timeline: what the device waited for)",
    )
    group.add_argument(
        "--compare-transformers",
        action="store_true",
        help="also time transformers on the same prompts (needs a GPU)",
    )


def add_latency_args(parser: argparse.ArgumentParser) -> None:
    """``bench latency``'s own sizes (beside the engine flags)."""
    parser.add_argument("--batch-size", type=int, default=1, help="(default: %(default)s)")
    parser.add_argument("--input-len", type=int, default=1024, help="(default: %(default)s)")
    parser.add_argument("--output-len", type=int, default=256, help="(default: %(default)s)")
    parser.add_argument("--num-iters", type=int, default=5, help="(default: %(default)s)")
    parser.add_argument("--num-iters-warmup", type=int, default=1, help="(default: %(default)s)")


def random_prompts(args: argparse.Namespace) -> list[list[int]]:
    """``--batch-size`` prompts of ``--input-len`` random ids (seeded)."""
    import random

    rng = random.Random(0)
    return [[rng.randint(0, 10000) for _ in range(args.input_len)] for _ in range(args.batch_size)]


def speed_of_light_line(args: argparse.Namespace, llm, prompt_lens, output_lens, seconds):
    """The run's share of the speed of light, or None where the ceilings are unknown: they
    were measured on the H200 (the CUDA platform's defaults); another device needs
    ``--bandwidth`` and ``--flops``."""
    from pagedlm.benchmarks.speed_of_light import speed_of_light

    config = llm.llm_engine.config
    on_cuda = config.platform == "cuda"
    if not on_cuda and args.bandwidth is None and args.flops is None:
        return None
    sol = speed_of_light(
        config.model.arch,
        prompt_lens,
        output_lens,
        bandwidth=args.bandwidth or DEFAULT_BANDWIDTH,
        flops=args.flops or DEFAULT_FLOPS,
    )
    return sol.describe(seconds)


def build_llm(args: argparse.Namespace):
    """The engine for a benchmark run: the engine flags with ``--model`` resolved from a
    shape name to a config directory. Returns ``(llm, model_dir)``."""
    from pagedlm import LLM

    # The engine's start-up log (memory, KV cache, graphs) where asked for, as the
    # engine's own processes read it.
    logging.basicConfig(level=os.environ.get("PAGEDLM_LOG_LEVEL", "WARNING").upper())
    engine_args = cli_args.engine_args_from_cli(args)
    model_dir = resolve_model(engine_args.model or BENCH_ENGINE_DEFAULTS["model"])
    engine_args = dataclasses.replace(engine_args, model=model_dir)
    start = time.perf_counter()
    llm = LLM(**dataclasses.asdict(engine_args))
    print(f"engine ready in {time.perf_counter() - start:.1f} s ({model_dir})", flush=True)
    return llm, model_dir


def profile_steps(
    llm, prompts: list[list[int]], params: list[Any], num_steps: int, trace: str | None = None
) -> str:
    """Run the requests, profile ``num_steps`` engine steps once every request is
    decoding, and group the device time by kind (attention, GEMM, sampler, other);
    ``trace``: a path to write the profile to as a Chrome trace too."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    engine = llm.llm_engine
    synchronize = torch.cuda.synchronize if torch.cuda.is_available() else lambda: None
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_processed_request(
            engine.process_request(f"prof-{i}", {"prompt_token_ids": p}, sp)
        )
    for _ in range(8):  # past the prefills
        engine.step()
    synchronize()
    scheduler = engine.engine_core.scheduler
    steps_before = scheduler.num_model_steps
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        for _ in range(num_steps):
            engine.step()
        synchronize()
        wall = time.perf_counter() - start
    model_steps = scheduler.num_model_steps - steps_before
    if trace:
        prof.export_chrome_trace(trace)
    engine.abort_request([f"prof-{i}" for i in range(len(prompts))])
    while engine.has_unfinished_requests():
        engine.step()
    groups: dict[str, float] = defaultdict(float)
    launches = 0
    for event in prof.key_averages():
        device_us = getattr(event, "self_device_time_total", 0) or getattr(
            event, "self_cuda_time_total", 0
        )
        # Kernels only: an operator's own "self" device time repeats its kernels'.
        if device_us <= 0 or event.device_type != DeviceType.CUDA:
            continue
        launches += event.count
        name = event.key.lower()
        if "decode" in name or "prefill" in name or "write_kv" in name:
            kind = "attention"
        elif any(k in name for k in ("gemm", "gemv", "nvjet", "cutlass", "matmul", "sm90", "xmma")):
            kind = "GEMM"
        elif any(
            k in name
            for k in ("sort", "topk", "softmax", "exponential", "argmax", "scan", "gumbel")
        ):
            kind = "sampler"
        elif any(k in name for k in ("rms_norm", "rotary", "silu")):
            kind = "norm/rope/act"
        else:
            kind = "other kernels"
        groups[kind] += device_us
    device_total = sum(groups.values()) / 1e6
    lines = [
        f"per-step breakdown over {model_steps} decode steps ({num_steps} engine steps, "
        f"{wall / model_steps * 1e3:.2f} ms/step, {launches / model_steps:.0f} kernels/step):"
    ]
    for kind, us in sorted(groups.items(), key=lambda kv: -kv[1]):
        lines.append(f"  {kind:14s} {us / model_steps / 1e3:8.3f} ms/step")
    idle = max(0.0, wall - device_total)
    lines.append(f"  {'GPU idle (CPU)':14s} {idle / model_steps * 1e3:8.3f} ms/step")
    lines += _timeline_lines(prof, model_steps)
    top = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=40)
    return "\n".join(lines) + "\n" + top


def _timeline_lines(prof, model_steps: int, rows: int = 30) -> list[str]:
    """The device's timeline split among its kernels by end time: each kernel is charged
    from the later of its start and the previous kernel's end to its own end, and a gap
    before a kernel's start is idle time. Under programmatic dependent launch a kernel
    starts before its predecessor ends and waits, so its own duration (the table) counts
    the wait; this split does not, and the charges plus the idle add up to the span."""
    from torch.autograd import DeviceType

    kernels = sorted(
        (e.time_range.end, e.time_range.start, e.name)
        for e in prof.events()
        if e.device_type == DeviceType.CUDA and e.time_range.end > e.time_range.start
    )
    if not kernels:
        return []
    charged: dict[str, list] = defaultdict(lambda: [0.0, 0])
    waited_for: dict[str, float] = defaultdict(float)  # idle, by the kernel that ended it
    idle, previous_end = 0.0, kernels[0][1]
    for end, start, name in kernels:
        gap = max(0.0, start - previous_end)
        idle += gap
        waited_for[name] += gap
        charged[name][0] += end - max(start, previous_end)
        charged[name][1] += 1
        previous_end = max(previous_end, end)
    span = previous_end - kernels[0][1]
    lines = [
        f"timeline over {span / model_steps / 1e3:.3f} ms/step (charged by end time; "
        f"idle {idle / model_steps / 1e3:.3f} ms/step):"
    ]
    for name, (us, count) in sorted(charged.items(), key=lambda kv: -kv[1][0])[:rows]:
        lines.append(
            f"  {us / model_steps:9.1f} us/step {count / model_steps:6.1f}/step  {name[:90]}"
        )
    lines.append("idle before (the kernel that ended the gap):")
    for name, us in sorted(waited_for.items(), key=lambda kv: -kv[1])[:8]:
        if us > 0:
            lines.append(f"  {us / model_steps:9.1f} us/step  {name[:90]}")
    return lines


@contextlib.contextmanager
def jit_compiles():
    """Yields a list that collects ``(name, signature)`` of every Triton kernel compiled
    (or loaded from the disk cache) inside the ``with`` block. A kernel specialized on
    something that varies in a run (a batch size as a constexpr, or an integer argument
    Triton specializes on 1 and multiples of 16) compiles inside the timing, and a
    server's first requests of each size wait for it. Empty without Triton."""
    names: list[tuple[str, str]] = []
    try:
        from triton import knobs
    except ImportError:
        yield names
        return
    previous = knobs.runtime.jit_post_compile_hook

    def hook(*, fn, **kwargs):
        names.append((fn.name, str(kwargs.get("repr", ""))))
        return previous(fn=fn, **kwargs) if previous else None

    knobs.runtime.jit_post_compile_hook = hook
    try:
        yield names
    finally:
        knobs.runtime.jit_post_compile_hook = previous


def jit_compiles_line(names: list[tuple[str, str]]) -> str | None:
    """The kernels ``jit_compiles`` saw, one line of names and counts and then each
    compiled signature (what to make a runtime argument); None if it saw none."""
    if not names:
        return None
    counts = defaultdict(int)
    for name, _ in names:
        counts[name] += 1
    listed = ", ".join(f"{name} x{n}" for name, n in sorted(counts.items()))
    signatures = "".join(f"\n  {signature}" for _, signature in names if signature)
    return f"{len(names)} Triton kernels compiled inside the timing: {listed}{signatures}"
