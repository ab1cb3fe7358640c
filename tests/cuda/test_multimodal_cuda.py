"""LLaVA and Qwen2.5-VL on the GPU: parity with transformers (fp32) through the triton
backend, decode still replayed from CUDA graphs, and the multimodal benchmark's smoke runs
(tiny shapes).
Run on the lent GPU: ``python -m pytest -q -m cuda tests/cuda/test_multimodal_cuda.py``."""

from __future__ import annotations

import argparse

import pytest
import torch

from multimodal.tiny_llava import hf_greedy, random_image, save_tiny_llava
from pagedlm import LLM, SamplingParams

pytestmark = pytest.mark.cuda


def test_llava_greedy_matches_transformers_on_cuda(tmp_path):
    model = save_tiny_llava(tmp_path)
    text = "USER: <image>\n<image>\ndescribe the picture. ASSISTANT:"
    images = [random_image(40, 50, 1), random_image(64, 32, 2)]
    expected = hf_greedy(model, tmp_path, text, images, 8)
    llm = LLM(str(tmp_path), dtype="float32", max_model_len=256, num_kv_blocks=64)
    runner = llm.llm_engine.engine_core.executor.worker.model_runner
    assert runner.graph_runner is not None  # decode steps keep their graphs
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    prompts = [{"prompt": text, "multi_modal_data": {"image": images}}, "USER: hello"]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert list(outputs[0].outputs[0].token_ids) == expected
    assert runner.encoder.num_encoded == 2


def test_multimodal_benchmark_smoke(tmp_path):
    from pagedlm.benchmarks.multimodal import add_args, run

    parser = argparse.ArgumentParser()
    add_args(parser)
    args = parser.parse_args(
        ["--shape", "tiny", "--num-requests", "4", "--output-len", "8", "--encoder-iters", "2"]
        + ["--output-json", str(tmp_path / "out.json")]
    )
    results = run(args)
    for side in ("pagedlm", "transformers"):
        assert results[side]["images_per_s"] > 0
        assert results[side]["encoder_ms_per_image"] > 0
    assert (tmp_path / "out.json").is_file()
    torch.cuda.empty_cache()


def test_qwen2_5_vl_greedy_matches_transformers_on_cuda(tmp_path):
    """M-RoPE through the triton backend: image steps eager with [3, T] positions, decode
    replayed from graphs with [T] positions; the vision tower's SDPA on the GPU."""
    from multimodal.tiny_qwen2_5_vl import IMAGE, processor, save_tiny_qwen2_5_vl

    model = save_tiny_qwen2_5_vl(tmp_path)
    turn = "<|im_start|>user\n{}describe the picture.<|im_end|>\n<|im_start|>assistant\n"
    text = turn.format(f"{IMAGE} and {IMAGE}")
    images = [random_image(90, 130, 1), random_image(200, 60, 2)]
    expected = hf_greedy(model, tmp_path, text, images, 8, processor=processor(tmp_path))
    llm = LLM(str(tmp_path), dtype="float32", max_model_len=256, num_kv_blocks=64)
    runner = llm.llm_engine.engine_core.executor.worker.model_runner
    assert runner.graph_runner is not None  # decode steps keep their graphs
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    prompts = [{"prompt": text, "multi_modal_data": {"image": images}}, turn.format("hello. ")]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert list(outputs[0].outputs[0].token_ids) == expected
    assert runner.encoder.num_encoded == 2


def test_multimodal_benchmark_smoke_qwen2_5_vl(tmp_path):
    from pagedlm.benchmarks.multimodal import add_args, run

    parser = argparse.ArgumentParser()
    add_args(parser)
    args = parser.parse_args(
        ["--shape", "qwen2.5-vl-tiny", "--num-requests", "4", "--output-len", "8"]
        + ["--encoder-iters", "2"]
    )
    results = run(args)
    for side in ("pagedlm", "transformers"):
        assert results[side]["images_per_s"] > 0
    torch.cuda.empty_cache()
