"""``pagedlm bench throughput``: offline generation throughput in output tokens per second.

Wall time includes prefill; the run's % of speed-of-light is printed, and optionally a
transformers ``generate_batch`` comparison on the same prompts.

``--dataset nanovllm`` is nano-vllm's benchmark exactly: ``random.seed(0)``; 256 prompts of
``randint(100, 1024)`` ids each ``randint(0, 10000)``; then 256 output lengths
``randint(100, 1024)``; temperature 0.6, ``ignore_eos``; one warm-up request first.
"""

from __future__ import annotations

import argparse
import random
import sys
import time

from pagedlm.benchmarks.cli import parse_bench_args
from pagedlm.benchmarks.common import (
    add_engine_args,
    build_llm,
    jit_compiles,
    jit_compiles_line,
    profile_steps,
    speed_of_light_line,
)
from pagedlm.benchmarks.host_overhead import add_phases_arg, instrument, phases_report


def nanovllm_dataset() -> tuple[list[list[int]], list[int]]:
    random.seed(0)
    num_seqs, max_input_len, max_output_len = 256, 1024, 1024
    prompts = [
        [random.randint(0, 10000) for _ in range(random.randint(100, max_input_len))]
        for _ in range(num_seqs)
    ]
    output_lens = [random.randint(100, max_output_len) for _ in range(num_seqs)]
    return prompts, output_lens


def random_dataset(
    num_prompts: int, input_len: int, output_len: int, range_ratio: float, seed: int = 0
) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(seed)

    def length(center: int) -> int:
        low = max(1, int(center * (1 - range_ratio)))
        return rng.randint(low, max(low, int(center * (1 + range_ratio))))

    prompts = [
        [rng.randint(0, 10000) for _ in range(length(input_len))] for _ in range(num_prompts)
    ]
    return prompts, [length(output_len) for _ in range(num_prompts)]


RANDOM_DATASET_DEFAULTS = {
    "input_len": 512,
    "output_len": 256,
    "num_prompts": 256,
    "range_ratio": 0.0,
}


def add_args(parser: argparse.ArgumentParser) -> None:
    add_engine_args(parser)
    parser.add_argument(
        "--dataset",
        choices=["random", "nanovllm"],
        default=None,
        help="nano-vllm's benchmark (fixed sizes), or random prompts of the sizes below "
        "(default: random if any size flag is given, else nanovllm)",
    )
    for flag, default in RANDOM_DATASET_DEFAULTS.items():
        parser.add_argument(
            f"--{flag.replace('_', '-')}",
            type=type(default),
            default=None,
            help=f"random dataset (default: {default})",
        )
    parser.add_argument("--temperature", type=float, default=0.6, help="(default: %(default)s)")
    add_phases_arg(parser)
    parser.add_argument(
        "--hf-num-prompts", type=int, default=64, help="with --compare-transformers (default: 64)"
    )
    parser.add_argument(
        "--hf-max-new-tokens",
        type=int,
        default=256,
        help="with --compare-transformers (default: 256)",
    )


def resolve_dataset(args: argparse.Namespace) -> None:
    """Fill in ``--dataset`` and the random dataset's sizes: a size flag alone means the
    random dataset; sizes given with ``--dataset nanovllm`` are an error, not ignored."""
    given = [flag for flag in RANDOM_DATASET_DEFAULTS if getattr(args, flag) is not None]
    if args.dataset is None:
        args.dataset = "random" if given else "nanovllm"
    if args.dataset == "nanovllm" and given:
        flags = ", ".join("--" + flag.replace("_", "-") for flag in given)
        raise SystemExit(
            f"{flags} size the random dataset; nano-vllm's has fixed sizes. Drop them, or "
            "pass --dataset random."
        )
    for flag, default in RANDOM_DATASET_DEFAULTS.items():
        if getattr(args, flag) is None:
            setattr(args, flag, default)


def transformers_generate_batch(
    model_dir: str, prompts: list[list[int]], max_new_tokens: int, temperature: float
) -> float:
    """Output tok/s of transformers' continuous batching (``generate_batch``) on the same
    prompts, random weights of the same shape, every output ``max_new_tokens`` long."""
    import torch
    import transformers

    config = transformers.AutoConfig.from_pretrained(model_dir)
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.eval()
    gen = transformers.GenerationConfig(
        max_new_tokens=max_new_tokens,
        do_sample=True,
        temperature=temperature,
        eos_token_id=-1,
        pad_token_id=0,
    )
    model.generate_batch(inputs=prompts[:2], generation_config=gen)  # warm-up
    torch.cuda.synchronize()
    start = time.perf_counter()
    results = model.generate_batch(inputs=prompts, generation_config=gen)
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    produced = sum(len(r.generated_tokens) for r in results.values())
    print(f"transformers generate_batch: {len(prompts)} prompts, {produced} output tokens "
          f"in {elapsed:.2f} s = {produced / elapsed:.1f} tok/s", flush=True)  # fmt: skip
    del model
    torch.cuda.empty_cache()
    return produced / elapsed


def run(args: argparse.Namespace) -> dict[str, float]:
    from pagedlm import SamplingParams

    resolve_dataset(args)
    if args.dataset == "nanovllm":
        prompts, output_lens = nanovllm_dataset()
    else:
        prompts, output_lens = random_dataset(
            args.num_prompts, args.input_len, args.output_len, args.range_ratio
        )
    llm, model_dir = build_llm(args)
    params = [
        SamplingParams(temperature=args.temperature, ignore_eos=True, max_tokens=n)
        for n in output_lens
    ]
    # The warm-up samples like the run, so no kernel variant compiles inside the timing.
    warm_up = SamplingParams(temperature=args.temperature, ignore_eos=True, max_tokens=8)
    llm.generate([{"prompt_token_ids": [1, 2, 3, 4]}], warm_up, use_tqdm=False)
    phases = instrument(llm) if args.host_phases else None
    scheduler = llm.llm_engine.engine_core.scheduler
    steps_before = getattr(scheduler, "num_model_steps", 0)
    with jit_compiles() as compiled:
        start = time.perf_counter()
        # A progress bar where someone watches; none in logs, where it would only cost time.
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=sys.stderr.isatty()
        )
        elapsed = time.perf_counter() - start
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    result = {"output_tokens": produced, "seconds": elapsed, "tok_per_s": produced / elapsed}
    print(
        f"throughput [{args.dataset}, {args.model}]: {len(prompts)} requests, {produced} output "
        f"tokens in {elapsed:.2f} s = {produced / elapsed:.1f} output tok/s "
        f"({sum(len(p) for p in prompts) + produced} total tokens)",
        flush=True,
    )
    if (compiled_line := jit_compiles_line(compiled)) is not None:
        print(compiled_line, flush=True)
    if phases is not None:
        steps = getattr(scheduler, "num_model_steps", 0) - steps_before
        print(phases_report(phases, steps, elapsed), flush=True)
    line = speed_of_light_line(args, llm, [len(p) for p in prompts], output_lens, elapsed)
    if line is not None:
        print(line, flush=True)
    if args.profile_steps:
        print(
            profile_steps(llm, prompts, params, args.profile_steps, args.profile_trace), flush=True
        )
    if args.compare_transformers:
        del llm
        import gc

        import torch

        gc.collect()
        torch.cuda.empty_cache()
        hf = transformers_generate_batch(
            model_dir, prompts[: args.hf_num_prompts], args.hf_max_new_tokens, args.temperature
        )
        result["transformers_tok_per_s"] = hf
        print(f"pagedlm / transformers: {result['tok_per_s'] / hf:.1f}x", flush=True)
    return result


def main(argv: list[str] | None = None) -> None:
    run(parse_bench_args(__doc__, add_args, argv))


if __name__ == "__main__":
    main()
