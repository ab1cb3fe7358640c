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

Shapes: ``llava-1.5-7b`` (CLIP ViT-L/14 at 336 px, 576 image tokens, Llama-2-7B decoder;
the default) and ``tiny`` (the smoke test's). The tokenizer is a generated word-level one
with the shape's vocabulary size (no download); the image processor is transformers'
CLIP one. pagedlm takes ``--gpu-memory-utilization`` (default 0.45) so that transformers'
copy of the weights and its cache fit beside it.

The H200 command::

    python -m pagedlm.benchmarks.multimodal --shape llava-1.5-7b --num-requests 64 \\
        --image-width 1024 --image-height 768 --output-len 128 \\
        --output-json multimodal.json
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
import time
from pathlib import Path
from typing import Any

QUESTION = "USER: <image>\nDescribe the image in detail. ASSISTANT:"

SHAPES: dict[str, dict[str, Any]] = {
    "llava-1.5-7b": {
        "text": dict(
            vocab_size=32064,
            hidden_size=4096,
            intermediate_size=11008,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=32,
            max_position_embeddings=4096,
            rms_norm_eps=1e-5,
        ),
        "vision": dict(
            image_size=336,
            patch_size=14,
            hidden_size=1024,
            intermediate_size=4096,
            num_hidden_layers=24,
            num_attention_heads=16,
            projection_dim=768,
        ),
    },
    "tiny": {
        "text": dict(
            vocab_size=32064,
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=1024,
        ),
        "vision": dict(
            image_size=56,
            patch_size=14,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=2,
            projection_dim=64,
        ),
    },
}
IMAGE_TOKEN_ID = 32000


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
    """config.json, a word-level tokenizer of the shape's vocabulary and a LlavaProcessor
    (CLIP image processor at the tower's size) in ``directory``; no weights (dummy)."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
    from transformers import (
        CLIPImageProcessor,
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaProcessor,
        PreTrainedTokenizerFast,
    )

    text, vision = shape["text"], shape["vision"]
    words = ["<unk>", "<s>", "</s>", *QUESTION.replace("<image>", "").split()]
    vocab = {w: i for i, w in enumerate(words)}
    vocab.update({f"w{i}": i for i in range(len(vocab), text["vocab_size"])})
    vocab = {w: i for w, i in vocab.items() if i != IMAGE_TOKEN_ID}
    vocab["<image>"] = IMAGE_TOKEN_ID  # LLaVA-1.5's id, an added special token
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.add_special_tokens([AddedToken("<image>", special=True, normalized=False)])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        extra_special_tokens={"image_token": "<image>"},
    )
    if tokenizer.convert_tokens_to_ids("<image>") != IMAGE_TOKEN_ID:
        raise RuntimeError("the generated tokenizer put <image> at the wrong id")
    size = vision["image_size"]
    processor = LlavaProcessor(
        image_processor=CLIPImageProcessor(
            size={"shortest_edge": size}, crop_size={"height": size, "width": size}
        ),
        tokenizer=tokenizer,
        patch_size=vision["patch_size"],
        num_additional_image_tokens=1,
        vision_feature_select_strategy="default",
    )
    config = LlavaConfig(
        text_config=LlamaConfig(**text, bos_token_id=1, eos_token_id=2),
        vision_config=CLIPVisionConfig(**vision),
        image_token_index=IMAGE_TOKEN_ID,
    )
    config.architectures = ["LlavaForConditionalGeneration"]
    config.dtype = "bfloat16"
    config.save_pretrained(directory)
    processor.save_pretrained(directory)


def _images(args: argparse.Namespace) -> list:
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    shape = (args.image_height, args.image_width, 3)
    return [
        Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8))
        for _ in range(args.num_requests)
    ]


def _time_per_call(fn, iters: int) -> float:
    import torch

    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters


def run_pagedlm(directory: Path, args: argparse.Namespace, images: list) -> dict[str, float]:
    import torch

    from pagedlm import LLM, SamplingParams
    from pagedlm.multimodal.processing import MultiModalProcessor
    from pagedlm.multimodal.tensors import from_tensor_data

    llm = LLM(
        str(directory),
        load_format="dummy",
        dtype="bfloat16",
        max_model_len=2048,
        gpu_memory_utilization=args.gpu_memory_utilization,
    )
    params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    prompts = [{"prompt": QUESTION, "multi_modal_data": {"image": [i]}} for i in images]
    llm.generate(prompts[:2], params, use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    num_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    runner = llm.llm_engine.engine_core.executor.worker.model_runner
    processor = MultiModalProcessor(llm.llm_engine.config.model)
    _, features = processor.process(QUESTION, images[:1])
    pixels = {k: from_tensor_data(v, "cuda") for k, v in features[0].tensors.items()}
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
    from transformers import AutoConfig, AutoProcessor, LlavaForConditionalGeneration

    config = AutoConfig.from_pretrained(directory)
    with torch.device("cuda"):
        model = LlavaForConditionalGeneration._from_config(
            config, dtype=torch.bfloat16, attn_implementation="sdpa"
        ).eval()
    processor = AutoProcessor.from_pretrained(directory)
    processor.tokenizer.padding_side = "left"
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None

    def generate(batch: list) -> int:
        inputs = processor(
            text=[QUESTION] * len(batch), images=batch, return_tensors="pt", padding=True
        ).to("cuda", torch.bfloat16)
        out = model.generate(
            **inputs,
            max_new_tokens=args.output_len,
            min_new_tokens=args.output_len,
            do_sample=False,
        )
        return (out.shape[1] - inputs["input_ids"].shape[1]) * len(batch)

    with torch.inference_mode():
        generate(images[:2])  # warm-up
        torch.cuda.synchronize()
        start = time.perf_counter()
        num_tokens = generate(images)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        pixels = processor(text=QUESTION, images=images[:1], return_tensors="pt")
        pixel_values = pixels["pixel_values"].to("cuda", torch.bfloat16)
        encoder_s = _time_per_call(
            lambda: model.model.get_image_features(pixel_values=pixel_values), args.encoder_iters
        )
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
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    add_args(parser)
    run(parser.parse_args(argv))


if __name__ == "__main__":
    main()
