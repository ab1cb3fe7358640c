"""What rounding every linear layer's input to int8 per 32 columns costs in accuracy: the
numerics of ``pagedlm_cuda``'s int8 GGUF GEMV (``gguf_gemv_int8``), and of llama.cpp's and
vLLM's GGUF matmuls, emulated on CPU with real weights.

    python -m pagedlm.benchmarks.int8_activations [--model M.gguf] [PROMPT ...]

Runs the embedded SmolLM2 (or ``--model``) in float32 with its GGUF blocks dequantized
(``PAGEDLM_CPU_DEQUANTIZE_GGUF=1``), three ways: as is; with each linear layer's input
rounded as the kernel rounds it (``d = max|x| / 127`` per 32 columns, round half to even);
and as a bfloat16 model, the yardstick. For each it prints the largest and mean absolute
difference of the prompts' teacher-forced logprobs from the float32 run, and how many
greedy continuations (48 tokens) equal it.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext

import torch

PROMPTS = [
    "The lighthouse stood on the northern cliff for two hundred years. Every night its keeper "
    "climbed the ninety steps, trimmed the wick and wound the clockwork that turned the lens.",
    "Photosynthesis is the process by which green plants and some other organisms use sunlight "
    "to synthesize foods from carbon dioxide and water. It generally involves the green "
    "pigment chlorophyll and generates oxygen as a byproduct.",
    "In 1969, the Apollo 11 mission landed the first humans on the Moon. Neil Armstrong and "
    "Buzz Aldrin spent about two and a quarter hours together outside the spacecraft.",
    "import numpy as np\n\ndef moving_average(values, window):\n    kernel = np.ones(window) / "
    "window\n    return np.convolve(values, kernel, mode='valid')",
]


def round_to_int8_groups(x: torch.Tensor) -> torch.Tensor:
    """x with each run of 32 columns rounded to int8 steps of ``max|x| / 127``."""
    groups = x.float().reshape(-1, 32)
    amax = groups.abs().amax(dim=1, keepdim=True)
    q = torch.round(groups * (torch.full_like(amax, 127.0) / amax.clamp_min(1e-30)))
    return (q * (amax * (1.0 / 127.0))).reshape(x.shape).to(x.dtype)


@contextmanager
def int8_inputs() -> Iterator[None]:
    """Every ``LinearBase`` (the LM head included) sees its input rounded while inside."""
    from pagedlm.model_executor.layers.linear_base import LinearBase

    original = LinearBase.apply_linear

    def rounded(self, x: torch.Tensor) -> torch.Tensor:
        return original(self, round_to_int8_groups(x) if x.shape[-1] % 32 == 0 else x)

    LinearBase.apply_linear = rounded
    try:
        yield
    finally:
        LinearBase.apply_linear = original


def compare(reference: list, other: list) -> tuple[float, float, int]:
    """(max, mean) absolute prompt-logprob difference and the equal greedy outputs."""
    diffs = []
    for ref, out in zip(reference, other, strict=True):
        for ref_lp, out_lp, token in zip(
            ref.prompt_logprobs[1:], out.prompt_logprobs[1:], ref.prompt_token_ids[1:]
        ):
            diffs.append(abs(ref_lp[token].logprob - out_lp[token].logprob))
    same = sum(a.outputs[0].token_ids == b.outputs[0].token_ids for a, b in zip(reference, other))
    return max(diffs), statistics.mean(diffs), same


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a .gguf file; default: the embedded one")
    parser.add_argument("prompts", nargs="*", default=PROMPTS)
    args = parser.parse_args(argv)
    os.environ["PAGEDLM_CPU_DEQUANTIZE_GGUF"] = "1"
    from pagedlm import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=48, prompt_logprobs=0)
    model = {} if args.model is None else {"model": args.model}

    def run(dtype: str, rounded: bool = False) -> list:
        llm = LLM(dtype=dtype, **model)
        with int8_inputs() if rounded else nullcontext():
            outputs = llm.generate(args.prompts, params, use_tqdm=False)
        llm.llm_engine.shutdown()
        del llm
        gc.collect()
        return outputs

    reference = run("float32")
    tokens = sum(len(o.prompt_token_ids) - 1 for o in reference)
    print(f"{len(args.prompts)} prompts, {tokens} teacher-forced tokens, 48 greedy tokens each")
    for label, outputs in (
        ("x rounded to int8 per 32 columns", run("float32", rounded=True)),
        ("bfloat16 model (the yardstick)", run("bfloat16")),
    ):
        worst, mean, same = compare(reference, outputs)
        print(
            f"{label:34s} max |dlogprob| {worst:.4f}  mean {mean:.4f}  "
            f"greedy outputs equal {same}/{len(reference)}"
        )


if __name__ == "__main__":
    main()
