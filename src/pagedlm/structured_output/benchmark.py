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


def bench_decode(model: str | None, batch: int, tokens: int, repeats: int = 3) -> dict[str, float]:
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
    # Interleaved repeats, best of each: the CPU may be shared, and noise only slows down.
    result = {"unconstrained": 0.0, "json_schema": 0.0}
    for _ in range(repeats):
        for name, params in (("unconstrained", free), ("json_schema", constrained)):
            start = time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=False)
            elapsed = time.perf_counter() - start
            produced = sum(len(o.outputs[0].token_ids) for o in outputs)
            print(
                f"{name:>14}: {produced} tokens in {elapsed:.2f} s = {produced / elapsed:.1f} tok/s"
            )
            result[name] = max(result[name], produced / elapsed)
    slowdown = 1 - result["json_schema"] / result["unconstrained"]
    print(f"best of {repeats}: constrained is {100 * slowdown:.1f} % slower")
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
    if not args.skip_decode:
        bench_decode(args.model, args.batch, args.tokens, args.repeats)


if __name__ == "__main__":
    main()
