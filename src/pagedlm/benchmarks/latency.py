"""``pagedlm bench latency``: time to generate ``--output-len`` tokens for a batch of
``--batch-size`` prompts of ``--input-len`` tokens (prefill included); mean and
percentiles over ``--num-iters`` runs, the run split into its time to the first token
and its time per later token (from the requests' own timestamps, so a difference in the
run time shows as prefill or per-step cost), the % of speed-of-light, and optionally
transformers' eager ``generate`` on the same prompt. With ``--spec-acceptance A`` (and
``--speculative-config``) it compares speculative decoding at a known acceptance rate with
no speculation instead (``spec_acceptance.py``)."""

from __future__ import annotations

import argparse
import statistics
import time

from pagedlm.benchmarks import spec_acceptance
from pagedlm.benchmarks.cli import parse_bench_args
from pagedlm.benchmarks.common import (
    add_engine_args,
    add_latency_args,
    build_llm,
    profile_steps,
    random_prompts,
    speed_of_light_line,
)
from pagedlm.benchmarks.host_overhead import add_phases_arg, instrument, phases_report


def add_args(parser: argparse.ArgumentParser) -> None:
    add_engine_args(parser)
    add_latency_args(parser)
    add_phases_arg(parser)
    spec_acceptance.add_args(parser)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    k = (len(ordered) - 1) * q / 100
    low, high = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (k - low)


def transformers_latency(model_dir: str, prompt: list[int], batch: int, output_len: int) -> float:
    """Seconds for transformers' eager ``generate`` (greedy, no early stop)."""
    import torch
    import transformers

    config = transformers.AutoConfig.from_pretrained(model_dir)
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.eval()
    ids = torch.tensor([prompt] * batch, device="cuda")
    kwargs = dict(
        attention_mask=torch.ones_like(ids),
        max_new_tokens=output_len,
        min_new_tokens=output_len,
        do_sample=False,
        pad_token_id=0,
    )
    with torch.inference_mode():
        model.generate(ids, **{**kwargs, "max_new_tokens": 8, "min_new_tokens": 8})
        torch.cuda.synchronize()
        start = time.perf_counter()
        model.generate(ids, **kwargs)
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    del model
    torch.cuda.empty_cache()
    return elapsed


def first_token_split(outputs: list, output_len: int) -> tuple[float, float]:
    """``(time to first token, seconds per later token)`` of a run, averaged over its
    requests, from the timestamps the output processor keeps (``RequestOutput.metrics``)."""
    ttfts, per_token = [], []
    for output in outputs:
        metrics = output.metrics
        ttfts.append(metrics["time_to_first_token"])
        decode = metrics["last_token_time"] - metrics["first_token_time"]
        per_token.append(decode / max(1, output_len - 1))
    return statistics.mean(ttfts), statistics.mean(per_token)


def run(args: argparse.Namespace) -> dict[str, float]:
    from pagedlm import SamplingParams

    prompts = random_prompts(args)
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=args.output_len)
    if args.spec_acceptance is not None:
        return spec_acceptance.run(args, prompts, params)
    llm, model_dir = build_llm(args)
    # Prefix caching would turn every timed run after the first into a cache hit, so
    # each run changes the prompts' first token.
    times: list[float] = []
    splits: list[tuple[float, float]] = []
    phases: dict[str, float] | None = None
    scheduler = llm.llm_engine.engine_core.scheduler
    for i in range(args.num_iters_warmup + args.num_iters):
        if i == args.num_iters_warmup and args.host_phases:  # the timed runs only
            phases, steps_before = instrument(llm), scheduler.num_model_steps
        start = time.perf_counter()
        outputs = llm.generate(
            [{"prompt_token_ids": [i] + p[1:]} for p in prompts], params, use_tqdm=False
        )
        if i >= args.num_iters_warmup:
            times.append(time.perf_counter() - start)
            splits.append(first_token_split(outputs, args.output_len))
    mean = statistics.mean(times)
    tokens = args.batch_size * args.output_len
    print(
        f"latency [{args.model}, batch {args.batch_size}, in {args.input_len}, out "
        f"{args.output_len}]: mean {mean:.3f} s, p50 {percentile(times, 50):.3f}, "
        f"p90 {percentile(times, 90):.3f}, p99 {percentile(times, 99):.3f} "
        f"({tokens / mean:.1f} output tok/s, {mean / args.output_len * 1e3:.2f} ms/token)",
        flush=True,
    )
    ttft = statistics.mean(s[0] for s in splits)
    per_token = statistics.mean(s[1] for s in splits)
    rest = mean - ttft - per_token * max(0, args.output_len - 1)
    print(
        f"  time to first token {ttft * 1e3:.2f} ms (from the request's arrival), then "
        f"{per_token * 1e3:.4f} ms per token; the rest of a run {rest * 1e3:.2f} ms",
        flush=True,
    )
    line = speed_of_light_line(
        args, llm, [args.input_len] * args.batch_size, [args.output_len] * args.batch_size, mean
    )
    if line is not None:
        print(line, flush=True)
    if phases is not None:
        steps = scheduler.num_model_steps - steps_before
        print(phases_report(phases, steps, sum(times)), flush=True)
    result = {"mean_s": mean, "tok_per_s": tokens / mean, "ttft_s": ttft,
              "decode_s_per_token": per_token}  # fmt: skip
    if args.profile_steps:
        print(
            profile_steps(
                llm, prompts, [params] * len(prompts), args.profile_steps, args.profile_trace
            ),
            flush=True,
        )
    if args.compare_transformers:
        del llm
        import gc

        gc.collect()
        hf = transformers_latency(model_dir, prompts[0], args.batch_size, args.output_len)
        result["transformers_tok_per_s"] = tokens / hf
        print(f"transformers eager generate: {hf:.3f} s = {tokens / hf:.1f} tok/s; "
              f"pagedlm is {hf / mean:.1f}x faster", flush=True)  # fmt: skip
    return result


def main(argv: list[str] | None = None) -> None:
    run(parse_bench_args(__doc__, add_args, argv))


if __name__ == "__main__":
    main()
