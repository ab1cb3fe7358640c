"""Gemma 2/3, Phi-3, Mixtral, Qwen3-MoE, GPT-2 and windowed Mistral/Qwen2 against transformers.

Logits of tiny random checkpoints, fp32, through the paged CPU backend: one prefill step
for all prompts, then the same prompts as a prefix chunk followed by single-token decode
steps (which read the cache). Windows are 8 tokens and prompts reach 40, so every sliding
layer drops keys.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from model_utils import PagedRunner
from pagedlm.model_executor.loader import load_model
from tiny_checkpoints import (
    PROMPT_LENS,
    hf_logits,  # noqa: F401 (the Triton model tests import it from this module)
    model_config,
    random_prompts,
    save_random_model,
    save_with_reference_logits,
)

BLOCK_SIZE = 4
WINDOW = 8
LONGROPE = {
    "rope_type": "longrope",
    "rope_theta": 10000.0,
    # head_dim 16 -> 8 frequencies; long factors stretch the slow ones.
    "short_factor": [1.0, 1.0, 1.1, 1.2, 1.3, 1.5, 1.8, 2.0],
    "long_factor": [1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0],
}
ORIGINAL_MAX = 16

# name -> (config class, overrides, transformers' own hidden_act key if not hidden_act)
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "gemma2": (
        "Gemma2Config",
        {
            "head_dim": 16,
            "sliding_window": WINDOW,
            "query_pre_attn_scalar": 24,
            "attn_logit_softcapping": 3.0,
            "final_logit_softcapping": 5.0,
        },
    ),
    "gemma3": (
        "Gemma3TextConfig",
        {
            "head_dim": 16,
            "sliding_window": WINDOW,
            "layer_types": ["sliding_attention", "full_attention"],
            "query_pre_attn_scalar": 24,
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "rope_theta": 1e6, "factor": 4.0},
            },
        },
    ),
    "phi3_longrope": (
        "Phi3Config",
        {
            "rope_parameters": LONGROPE,
            "original_max_position_embeddings": ORIGINAL_MAX,
            "pad_token_id": 0,
            "eos_token_id": 2,
            "bos_token_id": 1,
        },
    ),
    "phi3_window": (
        "Phi3Config",
        {"sliding_window": WINDOW, "pad_token_id": 0, "eos_token_id": 2, "bos_token_id": 1},
    ),
    "mixtral": ("MixtralConfig", {"num_local_experts": 4, "sliding_window": WINDOW}),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        {
            "head_dim": 16,
            "num_experts": 6,
            "num_experts_per_tok": 3,
            "moe_intermediate_size": 32,
            "norm_topk_prob": True,
            "mlp_only_layers": [1],
        },
    ),
    "qwen3_moe_unnormalized": (
        "Qwen3MoeConfig",
        {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 48},
    ),
    "gpt2": ("GPT2Config", {"n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 128}),
    "mistral_window": ("MistralConfig", {"sliding_window": WINDOW}),
    "qwen2_window": (
        "Qwen2Config",
        {"sliding_window": WINDOW, "use_sliding_window": True, "max_window_layers": 1},
    ),
}


def paged_runner(model: torch.nn.Module, backend=None, device="cpu") -> PagedRunner:
    """A runner for the prompts of ``random_prompts``."""
    return PagedRunner(model, len(PROMPT_LENS), max(PROMPT_LENS), BLOCK_SIZE, backend, device)


@pytest.fixture(scope="module", params=list(CASES))
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    path = tmp_path_factory.mktemp(request.param)
    prompts, expected = save_with_reference_logits(path, *CASES[request.param])
    return load_model(model_config(path, 128), torch.device("cpu")), prompts, expected


def _longrope_long_only(
    model: torch.nn.Module, prompts: list[list[int]], expected: list[torch.Tensor]
) -> tuple[list[list[int]], list[torch.Tensor]]:
    """With max_model_len past the pretraining length pagedlm rotates every position with
    the long factors; transformers does so for sequences longer than it (only those)."""
    arch = model.arch
    if not arch.rope_scaling or arch.rope_scaling.get("rope_type") != "longrope":
        return prompts, expected
    keep = [i for i, p in enumerate(prompts) if len(p) > ORIGINAL_MAX]
    assert keep
    return [prompts[i] for i in keep], [expected[i] for i in keep]


def test_prefill_matches_transformers(case) -> None:
    model, prompts, expected = case
    prompts, expected = _longrope_long_only(model, prompts, expected)
    runner = paged_runner(model)
    got = runner.step([(i, 0, p) for i, p in enumerate(prompts)])
    torch.testing.assert_close(torch.cat(got), torch.cat(expected), atol=1e-4, rtol=0)


def test_chunk_then_decodes_read_the_cache(case) -> None:
    """Each prompt: a first chunk, then its last (up to) 3 tokens as separate decode steps,
    all requests batched together in every step."""
    model, prompts, expected = case
    prompts, expected = _longrope_long_only(model, prompts, expected)
    got = paged_runner(model).chunk_then_decodes(prompts)
    torch.testing.assert_close(torch.cat(got), torch.cat(expected), atol=1e-4, rtol=0)


def test_longrope_uses_short_factors_when_max_model_len_fits(tmp_path: Path) -> None:
    prompts, expected = save_with_reference_logits(tmp_path, *CASES["phi3_longrope"])
    fits = [i for i, p in enumerate(prompts) if len(p) <= ORIGINAL_MAX]
    prompts, expected = [prompts[i] for i in fits], [expected[i] for i in fits]
    model = load_model(model_config(tmp_path, ORIGINAL_MAX), torch.device("cpu"))
    got = paged_runner(model).step([(i, 0, p) for i, p in enumerate(prompts)])
    torch.testing.assert_close(torch.cat(got), torch.cat(expected), atol=1e-4, rtol=0)
    long_model = load_model(model_config(tmp_path, ORIGINAL_MAX + 1), torch.device("cpu"))
    got_long = paged_runner(long_model).step([(i, 0, p) for i, p in enumerate(prompts)])
    assert not torch.allclose(torch.cat(got_long), torch.cat(expected), atol=1e-2)


@pytest.mark.parametrize("name", ["gemma2", "qwen3_moe", "gpt2"])
def test_bfloat16_stays_close_to_float32(tmp_path: Path, name: str) -> None:
    config_class, overrides = CASES[name]
    save_random_model(tmp_path, config_class, overrides)
    prompts = random_prompts()
    logits = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = load_model(model_config(tmp_path, dtype=dtype), torch.device("cpu"))
        assert {p.dtype for p in model.parameters()} == {dtype}
        runner = paged_runner(model)
        logits[dtype] = torch.cat(runner.step([(i, 0, p) for i, p in enumerate(prompts)]))
    assert logits[torch.bfloat16].dtype == torch.float32
    torch.testing.assert_close(logits[torch.bfloat16], logits[torch.float32], atol=0.2, rtol=0.05)
