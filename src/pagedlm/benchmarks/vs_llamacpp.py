"""CPU decoding of pagedlm against llama.cpp and transformers: same file, threads, prompts.

    python -m pagedlm.benchmarks.vs_llamacpp --llama-cpp-python VENV/bin/python \\
        --threads 1 --batch-sizes 1 32 --prompt-len 64 --output-len 128 --repeats 3

The engines run interleaved (pagedlm, its dequantized-weights path, transformers,
llama.cpp, then again), each ``--repeats`` times per batch size, and the table reports
medians with the 1-minute load average seen around the runs (the machine may be shared).
Every engine gets the same token-id prompts of exactly ``--prompt-len`` tokens, greedy
decoding of exactly ``--output-len`` tokens (EOS ignored), and is timed on wall time with
prefill included: output tokens / seconds. Each repeat draws new prompts (the same for
every engine), so pagedlm's prefix cache never skips a prefill it did in an earlier run.

- pagedlm: ``LLM(model)`` with its CPU defaults (GGUF layers on the int4 kernel);
  ``pagedlm-dequant``: the same with ``PAGEDLM_CPU_DEQUANTIZE_GGUF=1``.
- transformers: ``LlamaForCausalLM.generate`` on pagedlm's dequantized weights (left-padded
  static batch; ``vs_transformers``).
- llama.cpp: llama-cpp-python, built from source in its own venv (never a pagedlm
  dependency), driven by ``llamacpp_worker.py`` in that interpreter: one sequence per
  prompt, all decoded together. ``--llama-cpp-no-repack`` loads it without its extra weight
  buffers: on CPUs with AMX its AMX buffer segfaults (ggml-org/llama.cpp#20824).

``--mixed N`` adds the serving-like workload: N prompts of 100-500 tokens, 64 new tokens
each, pagedlm against transformers in static batches of ``--hf-batch`` prompts sorted by
length, one run each.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from pagedlm import LLM
from pagedlm.benchmarks.vs_transformers import run_pagedlm, run_transformers, transformers_model

_WORKER = Path(__file__).with_name("llamacpp_worker.py")


def random_prompts(vocab_size: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    """Token-id prompts of the given lengths, ids away from the special tokens at the ends."""
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab_size - 100) for _ in range(n)] for n in lengths]


class LlamaCpp:
    """A llama.cpp worker process (``llamacpp_worker.py`` in ``python``), kept for all runs."""

    def __init__(
        self, python: str, model: str, threads: int, max_seqs: int, n_ctx: int, repack: bool = True
    ) -> None:
        command = [python, str(_WORKER), "--model", model, "--threads", str(threads),
                   "--max-seqs", str(max_seqs), "--n-ctx", str(n_ctx)]  # fmt: skip
        if not repack:
            command.append("--no-repack")
        # llama.cpp logs a lot on stderr: into a file, named if the worker fails.
        self.log = tempfile.NamedTemporaryFile(  # noqa: SIM115 - open as long as the worker
            "w", prefix="llamacpp-", suffix=".log", delete=False
        )
        self.process = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True
        )
        self.version = self._answer()["version"]

    def _answer(self) -> dict:
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(
                f"the llama.cpp worker exited ({self.process.wait()}); see {self.log.name}"
            )
        return json.loads(line)

    def run(self, prompts: list[list[int]], output_len: int) -> float:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps({"prompts": prompts, "output_len": output_len}))
        self.process.stdin.write("\n")
        self.process.stdin.flush()
        answer = self._answer()
        assert answer["output_tokens"] == len(prompts) * output_len
        return answer["output_tokens"] / answer["seconds"]

    def close(self) -> None:
        if self.process.stdin is not None:
            self.process.stdin.close()
        self.process.wait(timeout=60)
        self.log.close()


def _dequantized_llm(model: str | None, dtype: str) -> LLM:
    previous = os.environ.get("PAGEDLM_CPU_DEQUANTIZE_GGUF")
    os.environ["PAGEDLM_CPU_DEQUANTIZE_GGUF"] = "1"
    try:
        return LLM(model, dtype=dtype)
    finally:
        if previous is None:
            del os.environ["PAGEDLM_CPU_DEQUANTIZE_GGUF"]
        else:
            os.environ["PAGEDLM_CPU_DEQUANTIZE_GGUF"] = previous


def _timed(run: Callable[[], float]) -> tuple[float, float]:
    """(tok/s, the 1-minute load average at the end of the run)."""
    rate = run()
    return rate, os.getloadavg()[0]


def interleaved(
    engines: dict[str, Callable[[list[list[int]]], float]],
    prompts: Callable[[int], list[list[int]]],
    repeats: int,
) -> dict[str, tuple[float, list[float], list[float]]]:
    """engine -> (median tok/s, every run's tok/s, load averages), runs interleaved.

    Repeat ``i`` gives every engine the prompts ``prompts(i)``: the same for all engines
    within a repeat, new in each, so that no engine's run reuses an earlier run's work (a
    prefix cache would skip the prefill of prompts it has seen)."""
    rates: dict[str, list[float]] = {name: [] for name in engines}
    loads: dict[str, list[float]] = {name: [] for name in engines}
    for repeat in range(repeats):
        batch = prompts(repeat)
        for name, run in engines.items():
            rate, load = _timed(lambda run=run, batch=batch: run(batch))
            rates[name].append(rate)
            loads[name].append(load)
    return {name: (statistics.median(rates[name]), rates[name], loads[name]) for name in engines}


def _mixed(llm: LLM, hf, args, vocab_size: int, pad_id: int) -> None:
    rng = random.Random(1)
    lengths = [rng.randint(100, 500) for _ in range(args.mixed)]
    prompts = random_prompts(vocab_size, lengths, seed=2)
    ours = run_pagedlm(llm, prompts, 64)
    order = sorted(range(len(prompts)), key=lambda i: lengths[i])
    start = time.perf_counter()
    for first in range(0, len(order), args.hf_batch):
        batch = [prompts[i] for i in order[first : first + args.hf_batch]]
        run_transformers(hf, batch, 64, pad_id)
    theirs = len(prompts) * 64 / (time.perf_counter() - start)
    print(
        f"\nmixed: {args.mixed} prompts of 100-500 tokens (mean {statistics.mean(lengths):.0f}), "
        f"64 new tokens: pagedlm {ours:.1f} tok/s, transformers (static batches of "
        f"{args.hf_batch}, sorted by length) {theirs:.1f} tok/s: {ours / theirs:.2f}x; "
        f"load {os.getloadavg()[0]:.1f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a .gguf file; default: the embedded one")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--llama-cpp-python", default=None, help="python with llama_cpp")
    parser.add_argument(
        "--llama-cpp-no-repack",
        action="store_true",
        help="llama.cpp without its extra weight buffers (llama-cli's --no-repack): on CPUs "
        "with AMX its AMX buffer crashes in the first matmul (ggml-org/llama.cpp#20824)",
    )
    parser.add_argument("--skip", nargs="*", default=[], help="engines to leave out")
    parser.add_argument("--mixed", type=int, default=0, help="prompts of the mixed workload")
    parser.add_argument("--hf-batch", type=int, default=32)
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))  # pagedlm keeps the count
    llm = LLM(args.model, dtype=args.dtype)
    model_path = llm.llm_engine.config.model.model
    vocab_size = llm.llm_engine.config.model.arch.vocab_size
    tokenizer = llm.get_tokenizer()
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    hf = transformers_model(llm)
    engines: dict[str, Callable[[list[list[int]]], float]] = {
        "pagedlm": lambda p: run_pagedlm(llm, p, args.output_len),
    }
    if "pagedlm-dequant" not in args.skip:
        dequantized = _dequantized_llm(args.model, args.dtype)
        engines["pagedlm-dequant"] = lambda p: run_pagedlm(dequantized, p, args.output_len)
    if "transformers" not in args.skip:
        engines["transformers"] = lambda p: run_transformers(hf, p, args.output_len, pad_id)
    llama = None
    if args.llama_cpp_python and "llama.cpp" not in args.skip:
        context = args.prompt_len + args.output_len + 16
        llama = LlamaCpp(
            args.llama_cpp_python,
            model_path,
            args.threads,
            max(args.batch_sizes),
            context,
            repack=not args.llama_cpp_no_repack,
        )
        engines["llama.cpp"] = lambda p: llama.run(p, args.output_len)
    for run in engines.values():  # warm-up: first-call costs stay out of the timings
        run(random_prompts(vocab_size, [args.prompt_len], seed=99))
    print(
        f"model {Path(model_path).name}, dtype {llm.llm_engine.config.model.dtype}, "
        f"{args.threads} thread(s), prompts of {args.prompt_len} tokens, {args.output_len} new, "
        f"medians of {args.repeats}, interleaved"
        + (f"; llama-cpp-python {llama.version}" if llama else "")
    )
    print(
        "batch  engine           tok/s (median)  runs                      load  vs llama.cpp  vs transformers"
    )
    for batch_size in args.batch_sizes:
        lengths = [args.prompt_len] * batch_size
        results = interleaved(
            engines,
            lambda repeat, lengths=lengths: random_prompts(
                vocab_size, lengths, seed=1000 * len(lengths) + repeat
            ),
            args.repeats,
        )
        for name, (median, rates, loads) in results.items():
            versus = [
                f"{median / results[other][0]:11.2f}x" if other in results else f"{'-':>12}"
                for other in ("llama.cpp", "transformers")
            ]
            runs = " ".join(f"{rate:.1f}" for rate in rates)
            print(
                f"{batch_size:5d}  {name:15s}  {median:14.1f}  {runs:24s}  "
                f"{statistics.mean(loads):4.1f}  {versus[0]}  {versus[1]}"
            )
    if args.mixed:
        _mixed(llm, hf, args, vocab_size, pad_id)
    if llama is not None:
        llama.close()


if __name__ == "__main__":
    sys.exit(main())
