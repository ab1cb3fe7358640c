"""Measure the cost of structured outputs: ``python -m pagedlm.structured_output.benchmark``.

1. Decode throughput at batch ``--batch`` (default 32), unconstrained vs constrained by a
   JSON schema, same prompts, ``--tokens`` output tokens each (every request runs to the
   length limit, so both sides decode the same number of tokens).
2. Compile time of a large JSON schema per backend: cold (first compile, backend already
   built) and cached (a second request with the same schema).
"""

from __future__ import annotations

import argparse
import time

from pagedlm.sampling_params import SamplingParams, StructuredOutputsParams

LONG_TEXT_SCHEMA = {
    "type": "object",
    "properties": {"story": {"type": "string", "minLength": 2000}},
    "required": ["story"],
}


def large_schema(num_properties: int = 60) -> dict:
    """Nested objects, arrays, enums, bounded numbers and patterns, ``num_properties`` wide."""
    kinds = [
        {"type": "string", "maxLength": 40},
        {"type": "integer", "minimum": 0, "maximum": 999},
        {"enum": ["alpha", "beta", "gamma", "delta"]},
        {"type": "array", "items": {"type": "number"}, "maxItems": 8},
        {
            "type": "object",
            "properties": {
                "id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                "tags": {"type": "array", "items": {"type": "string"}},
                "active": {"type": "boolean"},
            },
            "required": ["id", "active"],
        },
    ]
    properties = {f"field_{i}": kinds[i % len(kinds)] for i in range(num_properties)}
    return {"type": "object", "properties": properties, "required": list(properties)[::2]}


def _decode_step_times(llm, prompts: list[str], params: SamplingParams) -> list[float]:
    """Run one batch step by step; the durations of the steps where every row decodes."""
    engine = llm.llm_engine
    for index, prompt in enumerate(prompts):
        engine.add_request(f"bench-{time.monotonic_ns()}-{index}", prompt, params)
    times = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        outputs = engine.step()
        times.append((time.perf_counter() - start, len(outputs)))
    # Step 0 is the prefill; the last few may run with fewer rows.
    return [t for t, rows in times[1:] if rows == len(prompts)]


def bench_decode(model: str | None, batch: int, tokens: int, repeats: int = 3) -> dict[str, float]:
    """Decode tok/s at ``batch`` rows: ``batch / step time``, from the fastest and the
    median decode step of each side (interleaved repeats; a shared CPU only adds noise,
    so the fastest step is the cleanest figure)."""
    from pagedlm import LLM

    llm = LLM(model, max_model_len=512)
    prompts = [f"Story number {i}: once upon a time" for i in range(batch)]
    free = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    constrained = SamplingParams(
        temperature=0.0,
        max_tokens=tokens,
        structured_outputs=StructuredOutputsParams(json=LONG_TEXT_SCHEMA),
    )
    # Warm up: compile the grammar (cached afterwards) and the kernels.
    llm.generate(prompts[:2], [free, constrained], use_tqdm=False)
    steps: dict[str, list[float]] = {"unconstrained": [], "json_schema": []}
    for _ in range(repeats):
        for name, params in (("unconstrained", free), ("json_schema", constrained)):
            steps[name].extend(_decode_step_times(llm, prompts, params))
    result = {}
    for name, times in steps.items():
        times.sort()
        best, median = times[0], times[len(times) // 2]
        result[name] = batch / best
        print(
            f"{name:>14}: {len(times)} decode steps, fastest {best * 1e3:.1f} ms "
            f"({batch / best:.1f} tok/s), median {median * 1e3:.1f} ms ({batch / median:.1f} tok/s)"
        )
    slowdown = 1 - result["json_schema"] / result["unconstrained"]
    print(f"fastest steps: constrained decode is {100 * slowdown:.1f} % slower")
    llm.llm_engine.shutdown()
    return result


def bench_compile(model: str | None, backends: list[str]) -> None:
    import json

    from pagedlm.engine.arg_utils import EngineArgs
    from pagedlm.structured_output.backend import GrammarSpec, backend_class
    from pagedlm.structured_output.compiler import GrammarCompiler
    from pagedlm.tokenizer import get_tokenizer

    path = EngineArgs(model=model).resolve_model()
    tokenizer = get_tokenizer(path, None)
    spec = GrammarSpec("json", json.dumps(large_schema()))
    for name in backends:
        start = time.perf_counter()
        backend = backend_class(name)(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
        built = time.perf_counter() - start
        compiler = GrammarCompiler(lambda backend=backend: backend)
        start = time.perf_counter()
        compiler.compile_now(spec)
        cold = time.perf_counter() - start
        start = time.perf_counter()
        compiler.compile_now(GrammarSpec(spec.kind, spec.spec))
        cached = time.perf_counter() - start
        compiler.shutdown()
        print(
            f"{name:>9}: backend setup {built * 1e3:.0f} ms, large schema cold "
            f"{cold * 1e3:.1f} ms, cached {cached * 1e6:.0f} us"
        )


def bench_step_overhead(model: str | None, batch: int, iterations: int = 20) -> float:
    """Seconds per decode step that constraining adds at ``batch`` rows (best iteration):
    the scheduler fills the bitmask and advances the matchers, the sampler applies it."""
    import json

    import numpy as np
    import torch

    from pagedlm.engine.arg_utils import EngineArgs
    from pagedlm.structured_output.backend import GrammarSpec, backend_class, bitmask_width
    from pagedlm.structured_output.bitmask import apply_token_bitmask
    from pagedlm.tokenizer import get_tokenizer

    tokenizer = get_tokenizer(EngineArgs(model=model).resolve_model(), None)
    vocab_size = len(tokenizer)
    backend = backend_class("xgrammar")(tokenizer, vocab_size, [tokenizer.eos_token_id])
    compiled = backend.compile(GrammarSpec("json", json.dumps(LONG_TEXT_SCHEMA)))
    matchers = [backend.make_matcher(compiled) for _ in range(batch)]
    prefix = tokenizer.encode('{"story": "Once upon a time', add_special_tokens=False)
    word = tokenizer.encode(" there", add_special_tokens=False)[0]
    for matcher in matchers:
        for token in prefix:
            matcher.accept_token(token)
    logits = torch.randn(batch, vocab_size)
    best = float("inf")
    for _ in range(iterations):
        start = time.perf_counter()
        bitmask = np.full((batch, bitmask_width(vocab_size)), -1, dtype=np.int32)
        for row, matcher in enumerate(matchers):
            matcher.fill_bitmask(bitmask, row)
        apply_token_bitmask(logits, torch.from_numpy(bitmask)).argmax(dim=-1)
        for matcher in matchers:
            matcher.accept_token(word)
        best = min(best, time.perf_counter() - start)
    print(f"constraining adds {best * 1e3:.2f} ms per decode step at batch {batch}")
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip-decode", action="store_true")
    parser.add_argument("--backends", nargs="+", default=["xgrammar", "outlines"])
    args = parser.parse_args()
    bench_compile(args.model, args.backends)
    bench_step_overhead(args.model, args.batch)
    if not args.skip_decode:
        bench_decode(args.model, args.batch, args.tokens, args.repeats)


if __name__ == "__main__":
    main()
