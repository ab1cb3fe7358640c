"""The host's work per engine step, measured on a model too small to cost anything.

    python -m pagedlm.benchmarks.host_overhead --num-requests 256 --output-len 64

A one-layer random Llama (hidden size 64) decodes ``--num-requests`` requests at once, so a
step's wall time is what the host spends on it: scheduling, building the step's inputs,
sampling bookkeeping, collecting the tokens, stops and outputs. On a GPU that time must stay
below the device's step time for asynchronous scheduling to keep the device busy (nano-vllm's
benchmark runs ~5.5 ms decode steps at 256 requests on an H200). The per-phase table wraps
the engine's own methods with timers; ``--profile`` adds cProfile's view.
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import gc
import json
import pstats
import random
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch

from pagedlm import LLM, SamplingParams
from pagedlm.benchmarks.cli import parse_bench_args


def tiny_model(path: str, vocab_size: int) -> None:
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=4096,
    )
    transformers.LlamaForCausalLM(config).save_pretrained(path)


CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "cpu": time.thread_time}
"""``cpu``: this thread's CPU time, which other processes on a busy machine disturb far less
than wall time (with one torch thread, the thread does all of a step's work on a CPU)."""


def _timed(phases: dict[str, float], name: str, method: Callable, clock: Callable) -> Callable:
    @functools.wraps(method)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = clock()
        try:
            return method(*args, **kwargs)
        finally:
            phases[name] += clock() - start

    return wrapper


class CollectorTimer:
    """Time spent in the cyclic garbage collector's passes while ``active`` (its callbacks
    bracket every pass), per generation."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.active = False
        self.seconds: dict[int, float] = defaultdict(float)
        self.passes: dict[int, int] = defaultdict(int)
        self._start = 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._start = self.clock()
        elif self.active:
            self.seconds[info["generation"]] += self.clock() - self._start
            self.passes[info["generation"]] += 1

    def close(self) -> None:
        gc.callbacks.remove(self._callback)


def instrument(llm: LLM, clock: Callable[[], float] = time.perf_counter) -> dict[str, float]:
    """Time the engine's phases (instance attributes shadow the methods; nothing else
    changes). ``whole engine step`` against the run's time per step is what
    ``LLM.generate``'s own loop adds. ``collect`` minus its ``update_from_output`` is
    the one wait for the device (plus listing the tokens): near zero where the host is
    the bottleneck, and then the phases add up to the step."""
    phases: dict[str, float] = defaultdict(float)
    engine = llm.llm_engine
    core = engine.engine_core
    targets = [
        ("whole engine step", engine, "step"),
        ("engine metrics", engine.metrics, "record_outputs"),
        ("schedule", core.scheduler, "schedule"),
        ("collect (the device wait, then update_from_output)", core, "_collect"),
        ("  of which update_from_output", core.scheduler, "update_from_output"),
        ("execute_model (inputs, forward launch)", core.executor, "execute_model"),
        ("sample_tokens (metadata, sampling launch)", core.executor, "sample_tokens"),
        ("output processor", engine.output_processor, "process_outputs"),
    ]
    runner = getattr(getattr(core.executor, "worker", None), "model_runner", None)
    if runner is not None:  # the in-process executor: its runner's parts too
        targets += [
            ("  of which step inputs", getattr(runner, "step_inputs", None), "build"),
            ("  of which forward (device work on a CPU)", runner, "_forward"),
            ("  of which sampler (device work on a CPU)", runner, "sampler"),
        ]
    for name, owner, attribute in targets:
        if hasattr(owner, attribute):  # earlier versions of the engine lack some phases
            setattr(owner, attribute, _timed(phases, name, getattr(owner, attribute), clock))
    return phases


def add_phases_arg(parser: argparse.ArgumentParser) -> None:
    """``--host-phases`` for a benchmark that reports ``phases_report`` of its timed runs."""
    parser.add_argument(
        "--host-phases",
        action="store_true",
        help="time the engine's host phases during the run and print them per step "
        "(pagedlm.benchmarks.host_overhead's table for this workload)",
    )


def phases_report(phases: dict[str, float], steps: int, seconds: float) -> str:
    """``instrument``'s phases as milliseconds per model step, next to the whole step."""
    steps = max(1, steps)
    table = {name: round(1e3 * total / steps, 3) for name, total in phases.items()}
    table = {"steps": steps, "ms_per_step": round(1e3 * seconds / steps, 3), **table}
    return "host phases, ms per step: " + json.dumps(table, indent=1)


def run(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="pagedlm-host-bench-") as path:
        tiny_model(path, args.vocab_size)
        engine_args = json.loads(args.engine_args)
        llm = LLM(
            path,
            skip_tokenizer_init=True,
            max_num_seqs=max(args.num_requests, 1),
            max_model_len=args.input_len + args.output_len + 8,
            **engine_args,
        )
        rng = random.Random(0)
        prompts = [
            {"prompt_token_ids": [rng.randrange(args.vocab_size) for _ in range(args.input_len)]}
            for _ in range(args.num_requests)
        ]
        params = SamplingParams(
            temperature=args.temperature, max_tokens=args.output_len, ignore_eos=True
        )
        llm.generate(prompts[:8], params, use_tqdm=False)  # warm-up
        scheduler = llm.llm_engine.engine_core.scheduler
        clock = CLOCKS[args.clock]
        phases = instrument(llm, clock)
        steps_before = scheduler.num_model_steps
        profiler = cProfile.Profile() if args.profile else None
        collector = CollectorTimer(clock)
        collector.active = True
        start = clock()
        if profiler is not None:
            profiler.enable()
        llm.generate(prompts, params, use_tqdm=False)
        if profiler is not None:
            profiler.disable()
        wall = clock() - start
        collector.active = False
        collector.close()
        steps = scheduler.num_model_steps - steps_before
    result = {
        "engine_args": engine_args,
        "async_scheduling": getattr(llm.llm_engine.config.scheduler, "async_scheduling", None),
        "requests": args.num_requests,
        "steps": steps,
        "clock": args.clock,
        "ms_per_step": 1e3 * wall / steps,
        "phases_ms_per_step": {k: round(1e3 * v / steps, 3) for k, v in phases.items()},
        "garbage_collector_ms_per_step": round(1e3 * sum(collector.seconds.values()) / steps, 3),
        "garbage_collector_passes": {f"gen{g}": n for g, n in sorted(collector.passes.items())},
    }
    print(json.dumps(result, indent=1), flush=True)
    if profiler is not None:
        pstats.Stats(profiler).sort_stats("tottime").print_stats(args.profile)
    return result


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--vocab-size", type=int, default=1024)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument(
        "--engine-args",
        default="{}",
        help="engine arguments as JSON, e.g. '{\"async_scheduling\": true}'",
    )
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="wall")
    parser.add_argument(
        "--profile", type=int, default=0, help="print cProfile's top N functions (default: off)"
    )


def main(argv: list[str] | None = None) -> None:
    run(parse_bench_args(__doc__, add_args, argv))


if __name__ == "__main__":
    main()
