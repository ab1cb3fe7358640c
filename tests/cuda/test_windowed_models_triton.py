"""Sliding-window and soft-capped models (Gemma 2/3, Phi-3, Mistral, Qwen2 windows) on the
Triton backend against transformers' logits, and (GPU) through the engine with CUDA graphs
on and off. GPU only (``-m cuda``): under the Triton interpreter one model takes ~20 s, so
the default suite covers windows and soft-caps at the attention layer instead
(``test_triton_backend.py``).

The tiny checkpoints, prompts and step pattern are those of
``tests/model_executor/test_zoo_models.py``: windows of 8 tokens, prompts up to 40, one
prefill step for all prompts, then a prefix chunk followed by single-token decode steps.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from triton_env import DEVICE, ON_GPU, rel_error

from model_executor.test_zoo_models import (
    CASES,
    hf_logits,
    model_config,
    paged_runner,
    random_prompts,
    save_random_model,
)
from pagedlm.model_executor.loader import load_model
from pagedlm_cuda.attention import TritonAttentionBackend

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not ON_GPU, reason="needs a GPU")]
WINDOWED = ["gemma2", "gemma3", "phi3_window", "mistral_window", "qwen2_window", "mixtral"]
TOLERANCE = 1e-2  # float32 on the GPU runs the kernels' dots in tf32


def triton_runner(model: torch.nn.Module):
    """Steps a model through the Triton backend as the model runner does."""
    return paged_runner(model, TritonAttentionBackend(DEVICE), DEVICE)


@pytest.fixture(scope="module", params=WINDOWED)
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    path = tmp_path_factory.mktemp(request.param)
    config_class, overrides = CASES[request.param]
    hf_model = save_random_model(path, config_class, overrides)
    prompts = random_prompts()
    expected = [hf_logits(hf_model, p) for p in prompts]
    model = load_model(model_config(path, 128), DEVICE)
    return path, model, prompts, expected


def test_prefill_matches_transformers(case) -> None:
    _, model, prompts, expected = case
    got = triton_runner(model).step([(i, 0, p) for i, p in enumerate(prompts)])
    assert rel_error(torch.cat(got), torch.cat(expected)) < TOLERANCE


def test_chunk_then_decodes_match_transformers(case) -> None:
    _, model, prompts, expected = case
    runner = triton_runner(model)
    split = [max(1, len(p) - 3) for p in prompts]
    got = runner.step([(i, 0, p[: split[i]]) for i, p in enumerate(prompts)])
    for offset in range(3):
        chunks = [
            (i, split[i] + offset, [p[split[i] + offset]])
            for i, p in enumerate(prompts)
            if split[i] + offset < len(p)
        ]
        for (i, _, _), logits in zip(chunks, runner.step(chunks), strict=True):
            got[i] = torch.cat([got[i], logits])
    assert rel_error(torch.cat(got), torch.cat(expected)) < TOLERANCE


@pytest.mark.parametrize("name", ["gemma2", "mistral_window"])
def test_engine_cuda_graphs_on_and_off_identical(name: str, tmp_path: Path, monkeypatch) -> None:
    """Greedy tokens through LLM on the GPU, decode steps from graphs vs eager, windows
    exceeded (prompts up to 40 tokens + 24 generated, window 8)."""
    from pagedlm import LLM, SamplingParams

    config_class, overrides = CASES[name]
    save_random_model(tmp_path, config_class, overrides)
    requests = [{"prompt_token_ids": p} for p in random_prompts()]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)

    def generate() -> list[list[int]]:
        llm = LLM(str(tmp_path), dtype="bfloat16", skip_tokenizer_init=True, max_model_len=128)
        outs = llm.generate(requests, params, use_tqdm=False)
        del llm
        torch.cuda.empty_cache()
        return [list(o.outputs[0].token_ids) for o in outs]

    with_graphs = generate()
    monkeypatch.setenv("PAGEDLM_ENFORCE_EAGER", "1")
    assert generate() == with_graphs
