"""Sleep mode on the GPU: device memory before and after ``sleep(level)``, and the sleep and
wake-up times, for a model shape with random weights (the engine core's own calls, as
``POST /sleep`` and ``/wake_up`` make them through the engine-core process).

On the H200 (the 8B shape, bf16, the default flags)::

    python -m pagedlm.benchmarks.sleep_mode --model llama-3-8b --output-json sleep_mode.json

For each level (1: weights to pinned host memory, KV cache freed; 2: weights and KV
cache dropped, the weights rebuilt on wake-up) it records ``torch.cuda.mem_get_info`` free
bytes awake, asleep and awake again, the seconds ``sleep`` and ``wake_up`` took, and
whether a greedy generation after waking equals the one before (dummy weights are seeded,
so level 2 rebuilds the same weights). Elsewhere than CUDA the memory figures are null.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from typing import Any

from pagedlm.benchmarks.shapes import BUILTIN_SHAPES, resolve_model


def _free_bytes() -> int | None:
    import torch

    if not torch.cuda.is_available():
        return None
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


def measure_level(llm: Any, level: int, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    from pagedlm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    core = llm.llm_engine.engine_core

    def generate() -> list[int]:
        # Both generations prefill from scratch: wake-up resets the prefix cache, and a
        # prompt served from cached blocks (it ran at the level before) takes other
        # kernels, whose rounding can flip near-ties of random weights.
        core.reset_prefix_cache()
        return (
            llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
            .outputs[0]
            .token_ids
        )

    before_tokens = generate()
    free_awake = _free_bytes()
    started = time.perf_counter()
    core.sleep(level)
    sleep_s = time.perf_counter() - started
    free_asleep = _free_bytes()
    started = time.perf_counter()
    core.wake_up()
    wake_s = time.perf_counter() - started
    free_woken = _free_bytes()
    result = {
        "level": level,
        "free_bytes_awake": free_awake,
        "free_bytes_asleep": free_asleep,
        "free_bytes_woken": free_woken,
        "released_gib": None
        if free_awake is None
        else round((free_asleep - free_awake) / 2**30, 3),
        "sleep_s": round(sleep_s, 3),
        "wake_up_s": round(wake_s, 3),
        "same_tokens_after_wake_up": generate() == before_tokens,
    }
    print(json.dumps(result), flush=True)
    return result


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model",
        default="llama-3-8b",
        help=f"a built-in shape ({', '.join(BUILTIN_SHAPES)}) or a model directory "
        "(default: %(default)s)",
    )
    parser.add_argument("--levels", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--output-json", default=None, help="where the figures go")
    args = parser.parse_args(argv)

    from pagedlm import LLM

    llm = LLM(
        resolve_model(args.model),
        load_format="dummy",
        dtype="bfloat16",
        skip_tokenizer_init=True,
        max_model_len=args.max_model_len,
        enable_sleep_mode=True,
    )
    config = llm.llm_engine.config
    figures = {
        "model": args.model,
        "platform": config.platform,
        "num_kv_blocks": llm.llm_engine.engine_core.num_kv_blocks,
        "cache": dataclasses.asdict(config.cache),
        "levels": [
            measure_level(llm, level, list(range(1, 129)), args.max_tokens) for level in args.levels
        ],
    }
    if args.output_json:
        with open(args.output_json, "w") as file:
            json.dump(figures, file, indent=1)
    return figures


if __name__ == "__main__":
    main()
