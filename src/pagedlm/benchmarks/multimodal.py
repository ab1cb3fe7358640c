"""``python -m pagedlm.benchmarks.multimodal``: image requests end to end, pagedlm next to
transformers in the same process, random weights of a real vision-language shape.

``--num-requests`` requests, each one random ``--image-width`` x ``--image-height`` image
and a short question, ``--output-len`` tokens each (EOS ignored):

1. pagedlm (``LLM.generate``, bf16, CUDA graphs for decode; each image encoded inside the
   step under the encoder budget): images/s and output tok/s, wall time including the
   front end's preprocessing;
2. the vision encoder's time per image (tower + projector, one image per call, after a
   warm-up), in pagedlm and in transformers;
3. transformers' ``generate`` on the same requests in one padded batch (SDPA), images/s
   and output tok/s; the speed-up of (1) over it (the issue's target: >= 3x).

Shapes (``multimodal_shapes.py``): ``llava-1.5-7b`` (CLIP ViT-L/14 at 336 px, 576 image
tokens, Llama-2-7B decoder; the default), ``qwen2.5-vl-7b`` (Qwen2.5-VL-7B-Instruct's: the
window-attention ViT at the image's own size, 999 tokens for 1024x768, Qwen2-7B decoder
with M-RoPE), and ``tiny`` / ``qwen2.5-vl-tiny`` (smoke tests; they also run on CPU). The
tokenizer is a generated word-level one with the shape's vocabulary and special-token ids
(no download); the image processor is transformers' own. pagedlm takes
``--gpu-memory-utilization`` (default 0.45) so that transformers' copy of the weights and
its cache fit beside it.

The H200 commands::

    python -m pagedlm.benchmarks.multimodal --shape llava-1.5-7b --num-requests 64 \\
        --image-width 1024 --image-height 768 --output-len 128 \\
        --output-json multimodal.json
    python -m pagedlm.benchmarks.multimodal --shape qwen2.5-vl-7b --num-requests 64 \\
        --image-width 1024 --image-height 768 --output-len 128 \\
        --output-json multimodal_qwen2_5_vl.json
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from pagedlm.benchmarks.cli import parse_bench_args
from pagedlm.benchmarks.multimodal_shapes import FAMILIES, SHAPES


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llava-1.5-7b")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--image-width", type=int, default=1024)
    parser.add_argument("--image-height", type=int, default=768)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.45)
    parser.add_argument("--encoder-iters", type=int, default=20)
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--output-json", type=Path, default=None)


def write_shape(directory: Path, shape: dict[str, Any]) -> None:
    """The shape's checkpoint directory without weights (``load_format="dummy"``)."""
    FAMILIES[shape["family"]].write(directory, shape)


def _images(args: argparse.Namespace) -> list:
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    shape = (args.image_height, args.image_width, 3)
    return [
        Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8))
        for _ in range(args.num_requests)
    ]


def _device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _synchronize() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _time_per_call(fn, iters: int) -> float:
    fn()
    _synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    _synchronize()
    return (time.perf_counter() - start) / iters


def run_pagedlm(directory: Path, args: argparse.Namespace, images: list) -> dict[str, float]:
    import torch

    from pagedlm import LLM, SamplingParams
    from pagedlm.multimodal.processing import MultiModalProcessor
    from pagedlm.multimodal.tensors import from_tensor_data

    shape = SHAPES[args.shape]
    question = FAMILIES[shape["family"]].question
    llm = LLM(
        str(directory),
        load_format="dummy",
        dtype="bfloat16",
        max_model_len=min(2048, shape["text"]["max_position_embeddings"]),
        gpu_memory_utilization=args.gpu_memory_utilization,
    )
    params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    prompts = [{"prompt": question, "multi_modal_data": {"image": [i]}} for i in images]
    llm.generate(prompts[:2], params, use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    num_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    runner = llm.llm_engine.engine_core.executor.worker.model_runner
    processor = MultiModalProcessor(llm.llm_engine.config.model)
    _, features = processor.process(question, images[:1])
    pixels = {k: from_tensor_data(v, _device()) for k, v in features[0].tensors.items()}
    with torch.inference_mode():
        encoder_s = _time_per_call(
            lambda: runner.model.embed_multimodal(pixels), args.encoder_iters
        )
    return {
        "seconds": seconds,
        "images_per_s": len(images) / seconds,
        "output_tok_per_s": num_tokens / seconds,
        "encoder_ms_per_image": encoder_s * 1e3,
    }


def run_transformers(directory: Path, args: argparse.Namespace, images: list) -> dict[str, float]:
    import torch
    from transformers import AutoConfig

    family = FAMILIES[SHAPES[args.shape]["family"]]
    device = _device()
    config = AutoConfig.from_pretrained(directory)
    with torch.device(device):
        model = (
            family.hf_model()
            ._from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")
            .eval()
        )
    processor = family.hf_processor(directory)
    processor.tokenizer.padding_side = "left"
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None

    def inputs_for(batch: list):
        inputs = processor(
            text=[family.question] * len(batch), images=batch, return_tensors="pt", padding=True
        ).to(device)
        inputs["pixel_values"] = inputs["pixel_values"].to(torch.bfloat16)
        return inputs

    def generate(batch: list) -> int:
        inputs = inputs_for(batch)
        out = model.generate(
            **inputs,
            max_new_tokens=args.output_len,
            min_new_tokens=args.output_len,
            do_sample=False,
        )
        return (out.shape[1] - inputs["input_ids"].shape[1]) * len(batch)

    with torch.inference_mode():
        generate(images[:2])  # warm-up
        _synchronize()
        start = time.perf_counter()
        num_tokens = generate(images)
        _synchronize()
        seconds = time.perf_counter() - start
        one = inputs_for(images[:1])
        encoder_s = _time_per_call(lambda: family.hf_encode(model, one), args.encoder_iters)
    return {
        "seconds": seconds,
        "images_per_s": len(images) / seconds,
        "output_tok_per_s": num_tokens / seconds,
        "encoder_ms_per_image": encoder_s * 1e3,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    images = _images(args)
    with tempfile.TemporaryDirectory() as root:
        directory = Path(root)
        write_shape(directory, SHAPES[args.shape])
        results: dict[str, Any] = {
            "shape": args.shape,
            "num_requests": args.num_requests,
            "image_size": [args.image_width, args.image_height],
            "output_len": args.output_len,
            "pagedlm": run_pagedlm(directory, args, images),
        }
        gc.collect()  # pagedlm's engine and weights, before transformers' copy loads
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        if not args.skip_transformers:
            results["transformers"] = run_transformers(directory, args, images)
            results["speedup_images_per_s"] = (
                results["pagedlm"]["images_per_s"] / results["transformers"]["images_per_s"]
            )
    print(json.dumps(results, indent=1), flush=True)
    if args.output_json is not None:
        args.output_json.write_text(json.dumps(results, indent=1))
    return results


def main(argv: list[str] | None = None) -> None:
    run(parse_bench_args(__doc__, add_args, argv))


if __name__ == "__main__":
    main()
