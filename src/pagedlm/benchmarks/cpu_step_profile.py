"""Where a CPU decode step's time goes: GEMMs, attention, sampling, host bookkeeping.

    python -m pagedlm.benchmarks.cpu_step_profile --batch-sizes 1 32 --threads 1

Runs ``LLM.generate`` on the embedded model (or ``--model``) with timers wrapped around the
engine's methods, and prints, per batch size, the mean exclusive time of each part over the
pure decode steps (every request scheduling one token): a nested timer's time is taken out
of the one around it, so the rows add up to the whole step. The timers cost about a
microsecond each (~0.5 ms per step at SmolLM2's 121 linear calls + 30 attention calls).

With one thread (the default) the clock is that thread's CPU time, which is all of a
step's work and none of other processes' on a shared machine (their cache and memory
traffic still counts); ``--clock wall`` for several threads, whose pool this clock misses.
"""

from __future__ import annotations

import argparse
import inspect
import os
import random
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch

from pagedlm import LLM, SamplingParams

# (module, class, method, row of the table)
TIMED = [
    ("pagedlm.engine.llm_engine", "LLMEngine", "step", "engine step (rest)"),
    ("pagedlm.core.scheduler", "OneBudgetScheduler", "schedule", "scheduler.schedule"),
    ("pagedlm.core.scheduler", "OneBudgetScheduler", "update_from_output", "scheduler.update"),
    ("pagedlm.engine.output_processor", "OutputProcessor", "process_outputs", "output processor"),
    ("pagedlm.worker.model_runner", "ModelRunner", "execute_model", "runner: inputs, bookkeeping"),
    ("pagedlm.worker.model_runner", "ModelRunner", "sample_tokens", "runner: inputs, bookkeeping"),
    ("pagedlm_cpu.attention", "CpuSdpaBackend", "build_metadata", "attention metadata"),
    ("pagedlm.model_executor.models.causal_lm", "CausalLM", "forward", "model: norms, rope, act, ..."),
    ("pagedlm_cpu.attention", "CpuSdpaBackend", "forward", "attention (paged, SDPA)"),
    # A decode step's layers in one function each (decode_layer.py): its GEMMs and SDPA
    # bypass the rows above and below, so they count here.
    ("pagedlm_cpu.decode_layer", "DecodeLayerKernel", "__call__", "decoder layers (one function)"),
    # The LM head before LinearBase: its own wrapper then shadows the base class's one.
    ("pagedlm.model_executor.layers.vocab_embedding", "ParallelLMHead", "apply_linear", "LM head GEMM"),
    ("pagedlm.model_executor.layers.linear_base", "LinearBase", "apply_linear", "linear layers (GEMMs)"),
    ("pagedlm.model_executor.models.causal_lm", "CausalLM", "compute_logits", "logits (rest)"),
    ("pagedlm.sample.metadata", "SamplingMetadata", "build", "sampling metadata"),
    ("pagedlm.sample.sampler", "Sampler", "__call__", "sampler"),
]  # fmt: skip


class StepTimer:
    """Exclusive time per row, per engine step, on ``clock`` (nanoseconds): wall time, or
    the calling thread's CPU time (``time.thread_time_ns``), which on a shared machine leaves
    other processes' time out; with one torch thread it is all of a step's work."""

    def __init__(self, clock: Callable[[], int] = time.perf_counter_ns) -> None:
        self.clock = clock
        self.stack: list[list[int]] = []  # [start, time of children]
        self.current: dict[str, int] = defaultdict(int)
        self.steps: list[dict[str, int]] = []

    def wrap(self, owner: type, method: str, row: str) -> None:
        original = inspect.getattr_static(owner, method)
        is_static = isinstance(original, staticmethod | classmethod)
        function = original.__func__ if is_static else original

        def timed(*args: Any, **kwargs: Any) -> Any:
            frame = [self.clock(), 0]
            self.stack.append(frame)
            try:
                return function(*args, **kwargs)
            finally:
                elapsed = self.clock() - frame[0]
                self.stack.pop()
                self.current[row] += elapsed - frame[1]
                if self.stack:
                    self.stack[-1][1] += elapsed
                elif row == "engine step (rest)":
                    self.steps.append(dict(self.current))
                    self.current.clear()

        wrapped: Callable[..., Any] = timed
        if isinstance(original, classmethod):
            wrapped = classmethod(timed)  # type: ignore[assignment]
        setattr(owner, method, wrapped)


def install(timer: StepTimer) -> None:
    import importlib

    for module, cls, method, row in TIMED:
        timer.wrap(getattr(importlib.import_module(module), cls), method, row)


def profile(llm: LLM, timer: StepTimer, batch_size: int, prompt_len: int, output_len: int):
    rng = random.Random(batch_size)
    vocab = llm.llm_engine.config.model.arch.vocab_size
    prompts = [
        {"prompt_token_ids": [rng.randrange(100, vocab - 100) for _ in range(prompt_len)]}
        for _ in range(batch_size)
    ]
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    timer.steps.clear()
    llm.generate(prompts, params, use_tqdm=False)
    # Pure decode steps: after the prefill, before requests start finishing.
    return timer.steps[1:-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument(
        "--clock",
        choices=["thread", "wall"],
        default=None,
        help="thread CPU time (the default with one thread) or wall time (with more)",
    )
    args = parser.parse_args()
    clock_name = args.clock or ("thread" if args.threads == 1 else "wall")
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    torch.set_num_threads(args.threads)
    llm = LLM(args.model, dtype=args.dtype)
    timer = StepTimer(time.thread_time_ns if clock_name == "thread" else time.perf_counter_ns)
    install(timer)
    profile(llm, timer, 1, 8, 4)  # warm-up
    rows = list(dict.fromkeys(row for *_, row in TIMED))  # a row may time several methods
    tables = {}
    for batch_size in args.batch_sizes:
        steps = profile(llm, timer, batch_size, args.prompt_len, args.output_len)
        tables[batch_size] = {
            row: sum(s.get(row, 0) for s in steps) / len(steps) / 1e6 for row in rows
        }
    header = " | ".join(f"batch {b}: ms/step (%)" for b in args.batch_sizes)
    print(
        f"load {os.getloadavg()[0]:.1f}, {args.threads} thread(s), {clock_name} time, "
        "decode steps only\n"
    )
    print(f"| part | {header} |")
    print("| --- |" + " --- |" * len(args.batch_sizes))
    for row in rows:
        cells = []
        for b in args.batch_sizes:
            total = sum(tables[b].values())
            cells.append(f"{tables[b][row]:.2f} ({100 * tables[b][row] / total:.0f}%)")
        print(f"| {row} | " + " | ".join(cells) + " |")
    totals = " | ".join(f"**{sum(tables[b].values()):.2f}**" for b in args.batch_sizes)
    print(f"| whole step | {totals} |")


if __name__ == "__main__":
    main()
