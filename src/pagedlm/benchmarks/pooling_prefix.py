"""Reranking with a decoder cross-encoder, the prefix cache on (the default for last-token
pooling over causal attention) and off: one query against many documents, each pair one
prompt whose query part is shared.

The model is a built-in shape made a one-label ``*ForSequenceClassification`` with random
weights (``load_format="dummy"``), or a classifier directory. Both settings classify the
same pairs after a warm-up of two pairs, and their logits are compared::

    python -m pagedlm.benchmarks.pooling_prefix --model qwen3-0.6b --query-len 400 \\
        --num-docs 64 --doc-len 50
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import time
from typing import Any

from pagedlm.benchmarks.shapes import BUILTIN_SHAPES, resolve_model


def classifier_dir(model: str) -> tuple[str, int]:
    """A config directory for ``model`` as a one-label sequence classifier, and its
    vocabulary size."""
    path = resolve_model(model)
    config_file = os.path.join(path, "config.json")
    with open(config_file) as file:
        config = json.load(file)
    architecture = config["architectures"][0]
    if architecture.endswith("ForCausalLM"):
        name = architecture.removesuffix("ForCausalLM") + "ForSequenceClassification"
        config["architectures"] = [name]
        config["num_labels"] = 1
        path = tempfile.mkdtemp(prefix="pagedlm-classifier-")
        with open(os.path.join(path, "config.json"), "w") as file:
            json.dump(config, file)
    return path, int(config["vocab_size"])


def run(
    path: str, prompts: list[dict[str, Any]], caching: bool, args: argparse.Namespace
) -> dict[str, Any]:
    from pagedlm import LLM

    llm = LLM(
        path,
        load_format="dummy" if args.model in BUILTIN_SHAPES else "auto",
        skip_tokenizer_init=True,
        enable_prefix_caching=caching,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
    )
    try:
        llm.classify(prompts[:2], use_tqdm=False)  # warm-up; with the cache, the query's blocks
        started = time.perf_counter()
        outputs = llm.classify(prompts, use_tqdm=False)
        seconds = time.perf_counter() - started
    finally:
        llm.llm_engine.shutdown()
    return {
        "prefix_caching": caching,
        "seconds": round(seconds, 3),
        "pairs_per_s": round(len(prompts) / seconds, 2),
        "logits": [output.outputs.probs[0] for output in outputs],
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model",
        default="qwen3-0.6b",
        help=f"a built-in shape ({', '.join(BUILTIN_SHAPES)}) or a classifier directory "
        "(default: %(default)s)",
    )
    parser.add_argument("--query-len", type=int, default=400)
    parser.add_argument("--num-docs", type=int, default=64)
    parser.add_argument("--doc-len", type=int, default=50)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--output-json", default=None, help="where the figures go")
    args = parser.parse_args(argv)

    path, vocab_size = classifier_dir(args.model)
    rng = random.Random(0)

    def tokens(count: int) -> list[int]:
        return [rng.randrange(vocab_size) for _ in range(count)]

    query = tokens(args.query_len)
    prompts = [{"prompt_token_ids": query + tokens(args.doc_len)} for _ in range(args.num_docs)]
    cached, plain = (run(path, prompts, caching, args) for caching in (True, False))
    figures = {
        "model": args.model,
        "query_len": args.query_len,
        "num_docs": args.num_docs,
        "doc_len": args.doc_len,
        "with_prefix_cache_s": cached["seconds"],
        "without_s": plain["seconds"],
        "speedup": round(plain["seconds"] / cached["seconds"], 2),
        "max_abs_logit_difference": max(
            abs(a - b) for a, b in zip(cached["logits"], plain["logits"], strict=True)
        ),
    }
    print(json.dumps(figures), flush=True)
    if args.output_json:
        with open(args.output_json, "w") as file:
            json.dump(figures, file, indent=1)
    return figures


if __name__ == "__main__":
    main()
