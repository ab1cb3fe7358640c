"""W1 with an FP8 KV cache and in batch-invariant mode, each against the plain W1 of the
same call, plus the FP8 cache's teacher-forced logprob error on random weights.

H200 command (one call; every engine in a process of its own, spawned, so each gets the
whole device)::

    python -m pagedlm.benchmarks.w1_variants --output-json w1_variants.json

Targets (issue 19): ``fp8``: ``--kv-cache-dtype fp8`` W1 >= 1.35x the bf16-cache W1;
``batch_invariant``: the W1 cost of ``--batch-invariant`` (reported, no target);
``logprobs``: max and mean |logprob(fp8 cache) - logprob(bf16 cache)| of the prompt's own
tokens (``prompt_logprobs=0``) on the W1 model's shape with random weights (dummy load),
2 prompts of 1,000 tokens. Flags it does not know go to every engine (``--enforce-eager``,
...). ``--targets fp8`` runs one. Results are written after each target.
"""

from __future__ import annotations

import argparse
import json
import shlex
from typing import Any

from pagedlm.benchmarks.cli import bench_parser
from pagedlm.benchmarks.spec_acceptance import _call, _throughput

W1_ARGS = "--dataset nanovllm --model qwen3-0.6b"
VARIANTS = {
    "fp8": (["--kv-cache-dtype", "fp8"], "ratio >= 1.35", 1.35),
    "batch_invariant": (["--batch-invariant"], None, None),
}


def _variant_target(name: str, options: argparse.Namespace, extra: list[str]) -> dict[str, Any]:
    flags, target, bound = VARIANTS[name]
    base = shlex.split(options.w1_args) + extra
    plain = _call(options.in_process, _throughput, base)
    variant = _call(options.in_process, _throughput, [*base, *flags])
    ratio = variant["tok_per_s"] / plain["tok_per_s"]
    print(f"W1 {' '.join(flags)}: {ratio:.3f}x the tok/s without", flush=True)
    result: dict[str, Any] = {
        "args": options.w1_args,
        "flags": flags,
        "plain_tok_per_s": plain["tok_per_s"],
        "variant_tok_per_s": variant["tok_per_s"],
        "ratio": ratio,
    }
    if target is not None:
        result.update(target=target, met=ratio >= bound)
    return result


def _prompt_logprobs(argv: list[str], num_prompts: int, prompt_len: int) -> list[list[float]]:
    """Teacher-forced logprobs of random prompts' own tokens (a spawned engine)."""
    import random

    from pagedlm import SamplingParams
    from pagedlm.benchmarks.common import add_engine_args, build_llm

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    llm, _ = build_llm(parser.parse_args(argv))
    rng = random.Random(0)
    prompts = [[rng.randint(0, 10000) for _ in range(prompt_len)] for _ in range(num_prompts)]
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [[next(iter(d.values())).logprob for d in o.prompt_logprobs[1:]] for o in outs]


def _logprobs_target(options: argparse.Namespace, extra: list[str]) -> dict[str, Any]:
    base = ["--model", options.logprobs_model, "--load-format", "dummy", *extra]
    sizes = (options.logprobs_prompts, options.logprobs_len)
    plain = _call(options.in_process, _prompt_logprobs, base, *sizes)
    quant = _call(options.in_process, _prompt_logprobs, [*base, "--kv-cache-dtype", "fp8"], *sizes)
    diffs = [abs(a - b) for p, q in zip(plain, quant) for a, b in zip(p, q)]
    result = {
        "model": options.logprobs_model,
        "tokens": len(diffs),
        "max_abs_diff": max(diffs),
        "mean_abs_diff": sum(diffs) / len(diffs),
    }
    print(f"fp8 KV teacher-forced logprobs: {result}", flush=True)
    return result


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = bench_parser(__doc__)
    parser.add_argument("--output-json", required=True, help="where the figures go")
    parser.add_argument(
        "--targets", default="fp8,batch_invariant,logprobs", help="(default: %(default)s)"
    )
    parser.add_argument("--w1-args", default=W1_ARGS, help="throughput flags (%(default)s)")
    parser.add_argument("--logprobs-model", default="qwen3-0.6b")
    parser.add_argument("--logprobs-prompts", type=int, default=2)
    parser.add_argument("--logprobs-len", type=int, default=1000)
    parser.add_argument("--in-process", action="store_true", help="no process per engine")
    options, extra = parser.parse_known_args(argv)
    results: dict[str, Any] = {}
    for name in options.targets.split(","):
        if name == "logprobs":
            results[name] = _logprobs_target(options, extra)
        else:
            results[name] = _variant_target(name, options, extra)
        with open(options.output_json, "w") as file:  # after each target: partial runs count
            json.dump(results, file, indent=2)
    return results


if __name__ == "__main__":
    main()
