"""``pagedlm bench latency --speculative-config ... --spec-acceptance A``: speculative
decoding's machinery measured at a known acceptance rate.

Random weights make any real proposer's acceptance meaningless, so this runs the
benchmark's prompts twice in one process: first without speculation (timed, and its greedy
continuations kept), then with the benchmarks' "acceptance" proposer, which drafts those
continuations and corrupts each drafted token with probability ``1 - A``. Greedy
verification then accepts a run of drafts ending at the first corrupted one, so a step
yields ``(1 - A^(k+1)) / (1 - A)`` tokens on average (the ideal speedup, before the cost of
a verification step over a plain one, which is measured too).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import tempfile
import time
from typing import Any

from pagedlm.benchmarks.common import build_llm


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--spec-acceptance",
        type=float,
        default=None,
        help="with --speculative-config: draft the target's own greedy continuation, each "
        "drafted token wrong with probability 1 - A, and compare with no speculation "
        "(default: off)",
    )


def _timed_runs(llm, batches: list[list[dict]], params) -> tuple[list[float], list, int]:
    """(seconds per timed run, the outputs of every run, model steps of the timed runs)."""
    times, outputs = [], []
    scheduler = llm.llm_engine.engine_core.scheduler
    steps = 0
    for batch, timed in batches:
        before = scheduler.num_model_steps
        start = time.perf_counter()
        outputs.append(llm.generate(batch, params, use_tqdm=False))
        if timed:
            times.append(time.perf_counter() - start)
            steps += scheduler.num_model_steps - before
    return times, outputs, steps


def _release(llm) -> None:
    llm.llm_engine.shutdown()
    del llm
    gc.collect()
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except ImportError:  # pragma: no cover - torch is a dependency
        pass


def run(args: argparse.Namespace, batches: list[tuple[list[dict], bool]], params) -> dict[str, Any]:
    """``batches``: (prompts, timed?) per run, warm-up first; returns the figures."""
    spec = args.speculative_config
    if not spec:
        raise SystemExit("error: --spec-acceptance needs --speculative-config (for its k).")
    if isinstance(spec, str):
        spec = json.loads(spec)
    k = int(spec.get("num_speculative_tokens", 0))
    rate = args.spec_acceptance
    llm, _ = build_llm(argparse.Namespace(**{**vars(args), "speculative_config": None}))
    plain_times, outputs, plain_steps = _timed_runs(llm, batches, params)
    _release(llm)
    pairs = [
        [request["prompt_token_ids"], out.outputs[0].token_ids]
        for (batch, _), run_outputs in zip(batches, outputs)
        for request, out in zip(batch, run_outputs)
    ]
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as file:
        json.dump(pairs, file)
    try:
        config = {
            "method": "acceptance",
            "num_speculative_tokens": k,
            "acceptance_rate": rate,
            "reference_path": file.name,
            "disable_by_batch_size": None,
            "min_acceptance_rate": 0,  # measure the machinery at this rate, never off
        }
        llm, _ = build_llm(argparse.Namespace(**{**vars(args), "speculative_config": config}))
        spec_times, _, spec_steps = _timed_runs(llm, batches, params)
        stats = llm.llm_engine.engine_core.make_stats().spec_decoding
        _release(llm)
    finally:
        os.unlink(file.name)
    plain, speculative = statistics.mean(plain_times), statistics.mean(spec_times)
    step_cost = (speculative / spec_steps) / (plain / plain_steps)
    ideal = (k + 1) if rate == 1 else (1 - rate ** (k + 1)) / (1 - rate)
    figures = {
        "plain_s": plain,
        "spec_s": speculative,
        "speedup": plain / speculative,
        "mean_acceptance_length": stats.mean_acceptance_length if stats else 1.0,
        "verify_step_cost": step_cost,
        "ideal_speedup": ideal / step_cost,
    }
    figures["fraction_of_ideal"] = figures["speedup"] / figures["ideal_speedup"]
    print(
        f"speculative decoding at acceptance {rate} with k={k}: {figures['speedup']:.2f}x the "
        f"tokens/s without speculation ({plain:.3f} s -> {speculative:.3f} s per run); mean "
        f"acceptance length {figures['mean_acceptance_length']:.2f} (expected {ideal:.2f}); a "
        f"verification step costs {step_cost:.2f}x a plain one, so the ideal is "
        f"{figures['ideal_speedup']:.2f}x: {figures['fraction_of_ideal']:.0%} of it",
        flush=True,
    )
    return figures
