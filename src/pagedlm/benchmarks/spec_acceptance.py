"""Speculative decoding's machinery measured at a known acceptance rate, against no
speculation, with random weights.

Random weights make any real proposer's acceptance meaningless, so each comparison runs
the prompts without speculation (timed), then with the benchmarks' "acceptance" proposer,
which drafts the target's greedy continuations and corrupts each drafted token with
probability ``1 - A``. Greedy verification accepts a run of drafts ending at the first
corrupted one, so a step yields ``(1 - A^(k+1)) / (1 - A)`` tokens on average.

The continuation drafted is the one verification steps compute, not the one decode steps
do: a verification runs other kernels (the verification attention, linear layers of
``1 + k`` rows where decoding at batch 1 runs a one-row GEMV), so in bf16 its argmax
parts ways with the decode steps' at the first near-tie, which random weights make frequent (about every 30 tokens on
the H200); from there a plain run's continuation is a wrong draft at every position.
Each ``k`` therefore first runs the acceptance proposer at ``A = 0`` (every step then
verifies ``1 + k`` tokens and emits its first row's argmax: each token a row of a step of
the same shape, which a step computes independently of the other rows), for ``k`` tokens
more than asked so that the room left under ``max_tokens`` never cuts a compared token's
step short, and drafts what that run emitted. ``greedy_identical`` compares with that run
(``reference_common_prefix``: the mean share of each output before the first difference
from it); ``plain_common_prefix`` is the mean share of each output that equals the run
without speculation before the first difference (1.0 where the kernels agree to the bit,
as on the CPU). The ideal speedup is that divided by the measured cost of a verification
step over a plain one (decode steps only: each engine also times the prompts' prefill
alone, ``max_tokens=1``, and that time and step are taken off).

Two entry points:

- ``pagedlm bench latency --speculative-config '{"num_speculative_tokens": 4}'
  --spec-acceptance 1.0``: one comparison on the latency benchmark's prompts;
- ``python -m pagedlm.benchmarks.spec_acceptance --output-json out.json``: every H200
  target of speculative decoding in one call, written to a JSON file after each target:
  ``acceptance`` (Llama-3-8B shape, bf16, batch 1, 1024 in / 256 out; A = 1.0 with k = 4,
  A = 0.7 with k = 3) and ``w1`` (the nano-vllm throughput run with n-gram speculation
  against without). Flags it does not know go to every engine (``--enforce-eager``, ...).

Every engine runs in a process of its own (spawned), so the next one gets all of the
device's memory; ``--in-process`` keeps them in this one (tests, CPU).
"""

from __future__ import annotations

import argparse
import atexit
import dataclasses
import json
import multiprocessing
import os
import shlex
import statistics
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from typing import Any

from pagedlm.benchmarks.cli import bench_parser
from pagedlm.benchmarks.common import build_llm, profile_steps

ACCEPTANCE_ARGS = (
    "--model llama-3-8b --batch-size 1 --input-len 1024 --output-len 256 --num-iters 3"
)
ACCEPTANCE_CASES = "1.0:4,0.7:3"
W1_ARGS = "--dataset nanovllm --model qwen3-0.6b"
W1_SPECULATIVE_CONFIG = '{"method": "ngram", "num_speculative_tokens": 4}'
PREFILL_OFFSET = 10000
"""The prefill-only runs' prompts start with ``PREFILL_OFFSET + i``, so no run of either
kind hits the prefix cache of another."""


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--spec-acceptance",
        type=float,
        default=None,
        help="with --speculative-config: draft the target's own greedy continuation, each "
        "drafted token wrong with probability 1 - A, and compare with no speculation "
        "(default: off)",
    )


def _measure(args: argparse.Namespace, prompts: list[list[int]], params: Any) -> dict[str, Any]:
    """One engine over ``args.num_iters_warmup + args.num_iters`` runs of ``prompts`` (run
    ``i`` starts each prompt with token ``i``), each timed run also as a prefill alone."""
    llm, _ = build_llm(args)
    engine = llm.llm_engine
    scheduler = engine.engine_core.scheduler
    prefill = dataclasses.replace(params, max_tokens=1)
    figures: dict[str, Any] = {"times": [], "steps": 0, "prefill_times": [], "prefill_steps": 0}
    pairs = []
    try:
        for i in range(args.num_iters_warmup + args.num_iters):
            for offset, run_params, key in ((0, params, ""), (PREFILL_OFFSET, prefill, "prefill_")):
                batch = [{"prompt_token_ids": [i + offset] + p[1:]} for p in prompts]
                before = scheduler.num_model_steps
                start = time.perf_counter()
                outputs = llm.generate(batch, run_params, use_tqdm=False)
                if i >= args.num_iters_warmup:
                    figures[key + "times"].append(time.perf_counter() - start)
                    figures[key + "steps"] += scheduler.num_model_steps - before
                if not offset:
                    pairs += [
                        [r["prompt_token_ids"], list(o.outputs[0].token_ids)]
                        for r, o in zip(batch, outputs)
                    ]
        stats = engine.engine_core.make_stats().spec_decoding
        if args.profile_steps:  # the first run's prompts: the acceptance proposer knows them
            batch = [[0] + p[1:] for p in prompts]
            figures["profile"] = profile_steps(
                llm, batch, [params] * len(batch), args.profile_steps, args.profile_trace
            )
            print(figures["profile"], flush=True)
    finally:
        engine.shutdown()
    figures["pairs"] = pairs
    figures["mean_acceptance_length"] = stats.mean_acceptance_length if stats else 1.0
    return figures


def _call(in_process: bool, fn: Callable[..., dict], *fn_args: Any) -> dict:
    """``fn(*fn_args)`` here, or in a fresh process whose exit frees the device."""
    if in_process:
        return fn(*fn_args)
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(fn, *fn_args).result()


def _decode_seconds_per_step(run: dict[str, Any]) -> float:
    decode = statistics.mean(run["times"]) - statistics.mean(run["prefill_times"])
    return decode / max(1, run["steps"] - run["prefill_steps"])


def compare(
    args: argparse.Namespace,
    prompts: list[list[int]],
    params: Any,
    cases: list[tuple[float, int]],
    in_process: bool = False,
) -> dict[str, Any]:
    """No speculation, then the acceptance proposer at each ``(A, k)`` of ``cases``."""
    plain = _call(in_process, _measure, _with(args, speculative_config=None), prompts, params)
    plain_s = statistics.mean(plain["times"])
    result: dict[str, Any] = {"plain_s": plain_s, "plain_steps": plain["steps"], "cases": []}
    references: dict[int, list] = {}
    for rate, k in cases:
        if k not in references:  # what verification steps of 1 + k tokens emit greedily
            reference_args = _acceptance_args(args, 0.0, k, plain["pairs"])
            # k tokens more than asked: near max_tokens a step verifies fewer drafts (the
            # room left), and its last token is a one-row step, which other kernels compute.
            longer = dataclasses.replace(params, max_tokens=params.max_tokens + k)
            pairs = _call(in_process, _measure, reference_args, prompts, longer)["pairs"]
            references[k] = [[prompt, out[: params.max_tokens]] for prompt, out in pairs]
        spec_args = _acceptance_args(args, rate, k, references[k])
        spec = _call(in_process, _measure, spec_args, prompts, params)
        result["cases"].append(_figures(plain, spec, references[k], rate, k))
    return result


def _acceptance_args(args: argparse.Namespace, rate: float, k: int, pairs: list) -> Any:
    """``args`` with the acceptance proposer at ``rate`` drafting ``pairs``' continuations
    (written to a file the spawned engine reads; deleted at exit)."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as file:
        json.dump(pairs, file)
    atexit.register(os.unlink, file.name)
    config = {
        "method": "acceptance",
        "num_speculative_tokens": k,
        "acceptance_rate": rate,
        "reference_path": file.name,
        "disable_by_batch_size": None,
        "min_acceptance_rate": 0,  # the machinery at this rate, never switched off
    }
    return _with(args, speculative_config=config)


def _common_prefix(a: list[int], b: list[int]) -> float:
    """The share of ``a`` before its first difference with ``b``."""
    same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return same / max(1, len(a))


def _figures(plain: dict, spec: dict, reference: list, rate: float, k: int) -> dict[str, Any]:
    plain_s, spec_s = statistics.mean(plain["times"]), statistics.mean(spec["times"])
    step_cost = _decode_seconds_per_step(spec) / _decode_seconds_per_step(plain)
    expected = (k + 1) if rate == 1 else (1 - rate ** (k + 1)) / (1 - rate)
    plain_decode = plain_s - statistics.mean(plain["prefill_times"])
    spec_decode = spec_s - statistics.mean(spec["prefill_times"])
    figures = {
        "acceptance_rate": rate,
        "num_speculative_tokens": k,
        "spec_s": spec_s,
        "spec_steps": spec["steps"],
        "speedup": plain_s / spec_s,
        "decode_speedup": plain_decode / spec_decode,
        "mean_acceptance_length": spec["mean_acceptance_length"],
        "expected_acceptance_length": expected,
        "verify_step_cost": step_cost,
        "ideal_speedup": expected / step_cost,
        "greedy_identical": spec["pairs"] == reference,
        "reference_common_prefix": statistics.mean(
            _common_prefix(s[1], r[1]) for s, r in zip(spec["pairs"], reference)
        ),
        "plain_common_prefix": statistics.mean(
            _common_prefix(s[1], p[1]) for s, p in zip(spec["pairs"], plain["pairs"])
        ),
    }
    figures["fraction_of_ideal"] = figures["decode_speedup"] / figures["ideal_speedup"]
    figures["fraction_of_ideal_end_to_end"] = figures["speedup"] / figures["ideal_speedup"]
    print(
        f"speculative decoding at acceptance {rate} with k={k}: {figures['speedup']:.2f}x the "
        f"tokens/s without speculation ({plain_s:.3f} s -> {spec_s:.3f} s per run; decode "
        f"alone {figures['decode_speedup']:.2f}x); mean acceptance length "
        f"{figures['mean_acceptance_length']:.2f} (expected {expected:.2f}); a verification "
        f"step costs {step_cost:.2f}x a plain one, so the ideal is "
        f"{figures['ideal_speedup']:.2f}x: {figures['fraction_of_ideal']:.0%} of it "
        f"({figures['fraction_of_ideal_end_to_end']:.0%} end to end); greedy identical: "
        f"{figures['greedy_identical']} (the same as the drafted run for "
        f"{figures['reference_common_prefix']:.1%} of each output, as without speculation "
        f"for {figures['plain_common_prefix']:.0%})",
        flush=True,
    )
    return figures


def _with(args: argparse.Namespace, **changes: Any) -> argparse.Namespace:
    return argparse.Namespace(**{**vars(args), **changes})


def run(args: argparse.Namespace, prompts: list[list[int]], params: Any) -> dict[str, Any]:
    """``pagedlm bench latency --spec-acceptance A``: one comparison at the configured k."""
    spec = args.speculative_config
    if not spec:
        raise SystemExit("error: --spec-acceptance needs --speculative-config (for its k).")
    if isinstance(spec, str):
        spec = json.loads(spec)
    k = int(spec.get("num_speculative_tokens", 0))
    result = compare(args, prompts, params, [(args.spec_acceptance, k)])
    return {**result["cases"][0], "plain_s": result["plain_s"]}


def _acceptance_target(options: argparse.Namespace, extra: list[str]) -> dict[str, Any]:
    from pagedlm import SamplingParams
    from pagedlm.benchmarks.common import add_engine_args, add_latency_args, random_prompts

    parser = argparse.ArgumentParser()  # bench latency's flags (that module imports this one)
    add_engine_args(parser)
    add_latency_args(parser)
    add_args(parser)
    args = parser.parse_args(shlex.split(options.acceptance_args) + extra)
    prompts = random_prompts(args)
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=args.output_len)
    cases = [(float(a), int(k)) for a, k in (c.split(":") for c in options.cases.split(","))]
    result = compare(args, prompts, params, cases, options.in_process)
    for case in result["cases"]:
        if case["acceptance_rate"] == 1.0 and case["num_speculative_tokens"] == 4:
            case["target"], case["met"] = "speedup >= 4.2", case["speedup"] >= 4.2
        elif case["acceptance_rate"] == 0.7 and case["num_speculative_tokens"] == 3:
            case["target"] = "fraction_of_ideal >= 0.85"
            case["met"] = case["fraction_of_ideal"] >= 0.85
    return {"args": options.acceptance_args, **result}


def _throughput(argv: list[str]) -> dict[str, Any]:
    from pagedlm.benchmarks import throughput

    parser = argparse.ArgumentParser()
    throughput.add_args(parser)
    return throughput.run(parser.parse_args(argv))


def _w1_target(options: argparse.Namespace, extra: list[str]) -> dict[str, Any]:
    base = shlex.split(options.w1_args) + extra
    plain = _call(options.in_process, _throughput, base)
    spec_argv = [*base, "--speculative-config", options.w1_speculative_config]
    spec = _call(options.in_process, _throughput, spec_argv)
    ratio = spec["tok_per_s"] / plain["tok_per_s"]
    print(f"W1 with speculation: {ratio:.1%} of the tokens/s without", flush=True)
    return {
        "args": options.w1_args,
        "speculative_config": json.loads(options.w1_speculative_config),
        "plain_tok_per_s": plain["tok_per_s"],
        "spec_tok_per_s": spec["tok_per_s"],
        "ratio": ratio,
        "target": "ratio >= 0.97",
        "met": ratio >= 0.97,
    }


TARGETS = {"acceptance": _acceptance_target, "w1": _w1_target}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = bench_parser(__doc__)
    parser.add_argument("--output-json", required=True, help="where the figures go")
    parser.add_argument("--targets", default="acceptance,w1", help="(default: %(default)s)")
    parser.add_argument("--acceptance-args", default=ACCEPTANCE_ARGS, help="latency flags")
    parser.add_argument("--cases", default=ACCEPTANCE_CASES, help="A:k,... (%(default)s)")
    parser.add_argument("--w1-args", default=W1_ARGS, help="throughput flags (%(default)s)")
    parser.add_argument("--w1-speculative-config", default=W1_SPECULATIVE_CONFIG)
    parser.add_argument("--in-process", action="store_true", help="no process per engine")
    options, extra = parser.parse_known_args(argv)
    results: dict[str, Any] = {}
    for name in options.targets.split(","):
        results[name] = TARGETS[name](options, extra)
        with open(options.output_json, "w") as file:  # after each target: partial runs count
            json.dump(results, file, indent=2)
    return results


if __name__ == "__main__":
    main()
