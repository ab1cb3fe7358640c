"""GPT-NeoX, StableLM, Phi, Starcoder2 and Cohere 1/2 on the Triton backend with the CUDA
platform's kernels installed, against transformers' logits, and (GPU) through the engine
with CUDA graphs on and off. GPU only (``-m cuda``).

The cases, checkpoints and step pattern are ``tests/model_executor/
test_zoo_models_layernorm_families.py``'s. With the kernels installed, Cohere's
interleaved rotation (``is_neox_style=False``) runs inside the attention kernels and
Starcoder2's neox one in the rotary kernel; the partial rotations keep the torch code.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from triton_env import DEVICE, ON_GPU, rel_error

from model_executor.test_zoo_models_layernorm_families import (
    BLOCK_SIZE,
    CASES,
    PROMPT_LENS,
)
from model_utils import PagedRunner
from pagedlm.model_executor.layers.rotary_embedding import RotaryEmbedding
from pagedlm.model_executor.loader import load_model
from pagedlm_cuda.attention import TritonAttentionBackend
from pagedlm_cuda.fused_layers import install_fused_kernels
from tiny_checkpoints import (
    hf_logits,
    model_config,
    random_prompts,
    save_random_model,
)

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not ON_GPU, reason="needs a GPU")]
TOLERANCE = 1e-2  # float32 on the GPU runs the kernels' dots in tf32


def triton_runner(model: torch.nn.Module) -> PagedRunner:
    backend = TritonAttentionBackend(DEVICE)
    return PagedRunner(model, len(PROMPT_LENS), max(PROMPT_LENS), BLOCK_SIZE, backend, DEVICE)


@pytest.fixture(scope="module", params=list(CASES))
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    path = tmp_path_factory.mktemp(request.param)
    hf_model = save_random_model(path, *CASES[request.param])
    prompts = random_prompts()
    expected = [hf_logits(hf_model, p) for p in prompts]
    model = load_model(model_config(path, 128), DEVICE)
    install_fused_kernels(model)
    return request.param, model, prompts, expected


def test_prefill_matches_transformers(case) -> None:
    _, model, prompts, expected = case
    got = triton_runner(model).step([(i, 0, p) for i, p in enumerate(prompts)])
    assert rel_error(torch.cat(got), torch.cat(expected)) < TOLERANCE


def test_chunk_then_decodes_match_transformers(case) -> None:
    name, model, prompts, expected = case
    if name.startswith("cohere"):
        rotary = next(m for m in model.modules() if isinstance(m, RotaryEmbedding))
        assert rotary.kernel is not None and not rotary.is_neox_style
    got = triton_runner(model).chunk_then_decodes(prompts)
    assert rel_error(torch.cat(got), torch.cat(expected)) < TOLERANCE


@pytest.mark.parametrize("name", ["phi", "cohere2"])
def test_engine_cuda_graphs_on_and_off_identical(name: str, tmp_path: Path, monkeypatch) -> None:
    """Greedy tokens through LLM on the GPU, decode steps from graphs vs eager."""
    from pagedlm import LLM, SamplingParams

    save_random_model(tmp_path, *CASES[name])
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
