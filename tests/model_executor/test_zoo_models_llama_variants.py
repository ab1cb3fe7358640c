"""Gemma 1, Granite, OLMo 2/3, SmolLM3, Qwen2-MoE and ERNIE 4.5 against transformers.

Logits of tiny random checkpoints, fp32, through the paged CPU backend: one prefill step
for all prompts, then the same prompts as a prefix chunk followed by single-token decode
steps (which read the cache) — once through the modules, once with the CPU platform's
kernels installed (fused norms and rotary, whole-layer decode kernels), which must apply
only where they compute the same math. Each family's special feature gets a case: Granite's
multipliers, OLMo 3's 8-token windows (prompts reach 40) and rope per layer type,
SmolLM3's NoPE layers, Qwen2-MoE's shared expert beside a dense (``mlp_only``) layer,
ERNIE's interleaved rotary with biases.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from model_executor.test_tensor_parallel import assert_two_ranks_match_one
from model_utils import PagedRunner
from pagedlm.config import ArchConfig
from pagedlm.model_executor.loader import load_model
from pagedlm.model_executor.models import olmo2
from pagedlm.model_executor.models.gemma import gemma1_activation
from pagedlm.model_executor.models.smollm3 import rope_layers
from pagedlm_cpu.decode_layer import install_decode_kernels
from pagedlm_cpu.fused_layers import install_fused_kernels
from tiny_checkpoints import (
    PROMPT_LENS,
    hf_logits,
    model_config,
    random_prompts,
    save_random_model,
    save_with_reference_logits,
)

BLOCK_SIZE = 4
WINDOW = 8
TOKENS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
"""Special ids inside the tiny vocabulary (some configs default to ids past it)."""

# name -> (config class, overrides, decoder layers the CPU decode kernel may compute)
CASES: dict[str, tuple[str, dict[str, Any], int]] = {
    "gemma": ("GemmaConfig", {"head_dim": 16}, 0),
    "granite": (
        "GraniteConfig",
        {
            "embedding_multiplier": 3.0,
            "residual_multiplier": 0.4,
            "attention_multiplier": 0.1,
            "logits_scaling": 4.0,
            "tie_word_embeddings": True,
        },
        0,
    ),
    "olmo2": ("Olmo2Config", {**TOKENS, "attention_bias": True}, 0),
    "olmo3": (
        "Olmo3Config",
        {
            **TOKENS,
            "sliding_window": WINDOW,
            "layer_types": ["sliding_attention", "full_attention"],
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "rope_theta": 5e5, "factor": 2.0},
            },
        },
        0,
    ),
    # Layer 0 rotates (and keeps the decode kernel), layer 1 is NoPE.
    "smollm3": ("SmolLM3Config", {**TOKENS, "no_rope_layers": [1, 0]}, 1),
    # NoPE layer 0 slides over 8 tokens (transformers' default layer_types for this).
    "smollm3_window": (
        "SmolLM3Config",
        {**TOKENS, "no_rope_layers": [0, 1], "use_sliding_window": True, "sliding_window": WINDOW},
        1,
    ),
    # Layer 0 is MoE with a shared expert, layer 1 dense (the decode kernel's).
    "qwen2_moe": (
        "Qwen2MoeConfig",
        {
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 48,
            "mlp_only_layers": [1],
        },
        1,
    ),
    "qwen2_moe_normalized": (
        "Qwen2MoeConfig",
        {
            "num_experts": 6,
            "num_experts_per_tok": 3,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 32,
            "norm_topk_prob": True,
            "decoder_sparse_step": 2,
        },
        1,
    ),
    "ernie45": ("Ernie4_5Config", {**TOKENS, "head_dim": 16, "use_bias": True}, 0),
}


def paged_runner(model: torch.nn.Module) -> PagedRunner:
    return PagedRunner(model, len(PROMPT_LENS), max(PROMPT_LENS), BLOCK_SIZE)


@pytest.fixture(scope="module", params=list(CASES))
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    path = tmp_path_factory.mktemp(request.param)
    config_class, overrides, decodable = CASES[request.param]
    prompts, expected = save_with_reference_logits(path, config_class, overrides)
    model = load_model(model_config(path, 128), torch.device("cpu"))
    return model, prompts, expected, path, decodable


def test_prefill_matches_transformers(case) -> None:
    model, prompts, expected, _, _ = case
    got = paged_runner(model).step([(i, 0, p) for i, p in enumerate(prompts)])
    torch.testing.assert_close(torch.cat(got), torch.cat(expected), atol=1e-4, rtol=0)


def test_chunk_then_decodes_read_the_cache(case) -> None:
    """Each prompt: a first chunk, then its last (up to) 3 tokens as separate decode steps,
    all requests batched together in every step."""
    model, prompts, expected, _, _ = case
    got = paged_runner(model).chunk_then_decodes(prompts)
    torch.testing.assert_close(torch.cat(got), torch.cat(expected), atol=1e-4, rtol=0)


def test_cpu_kernels_apply_only_where_the_math_is_llamas(case) -> None:
    """A fresh load with the CPU platform's kernels: the whole-layer decode kernel takes
    exactly the plain Llama layers, and the decodes it then computes still match."""
    _, prompts, expected, path, decodable = case
    model = load_model(model_config(path, 128), torch.device("cpu"))
    install_fused_kernels(model)
    assert install_decode_kernels(model) == decodable
    got = paged_runner(model).chunk_then_decodes(prompts)
    torch.testing.assert_close(torch.cat(got), torch.cat(expected), atol=1e-4, rtol=0)


def test_gemma_legacy_gelu_means_the_tanh_approximation(tmp_path: Path) -> None:
    """The first Gemma releases wrote hidden_act="gelu"; transformers reads it as tanh GELU."""
    hf_model = save_random_model(tmp_path, "GemmaConfig", {"head_dim": 16})
    config_file = tmp_path / "config.json"
    raw = json.loads(config_file.read_text())
    raw["hidden_act"] = "gelu"
    config_file.write_text(json.dumps(raw))
    assert gemma1_activation(ArchConfig.from_hf_dict(raw)) == "gelu_pytorch_tanh"
    model = load_model(model_config(tmp_path, 128), torch.device("cpu"))
    prompts = random_prompts([5, 11])
    got = paged_runner(model).step([(i, 0, p) for i, p in enumerate(prompts)])
    want = [hf_logits(hf_model, p) for p in prompts]
    torch.testing.assert_close(torch.cat(got), torch.cat(want), atol=1e-4, rtol=0)


def test_smollm3_default_nope_layers_every_fourth() -> None:
    raw = {
        "architectures": ["SmolLM3ForCausalLM"],
        "vocab_size": 64,
        "hidden_size": 32,
        "num_hidden_layers": 8,
        "num_attention_heads": 2,
        "intermediate_size": 64,
    }
    assert rope_layers(ArchConfig.from_hf_dict(raw)) == [True, True, True, False] * 2
    raw["no_rope_layers"] = [1, 0]
    with pytest.raises(ValueError, match="no_rope_layers"):
        rope_layers(ArchConfig.from_hf_dict(raw))


TENSOR_PARALLEL_CASES: dict[str, tuple[str, dict[str, Any]]] = {
    # q's norm sums over the ranks' heads; k's one head is on both ranks, whole.
    "olmo2_mqa": ("Olmo2Config", {**TOKENS, "num_key_value_heads": 1}),
    "qwen2_moe": CASES["qwen2_moe"][:2],
}


@pytest.mark.slow
def test_two_ranks_match_one(tmp_path: Path) -> None:
    """OLMo 2's whole-projection q/k norms (summed over the ranks' heads) and Qwen2-MoE's
    shared expert under a real 2-process tensor-parallel run (gloo)."""
    model_dirs = []
    for name, (config_class, overrides) in TENSOR_PARALLEL_CASES.items():
        save_random_model(tmp_path / name, config_class, overrides)
        model_dirs.append(str(tmp_path / name))
    assert_two_ranks_match_one(model_dirs, tmp_path, atol=1e-5, rtol=0)


def test_projection_norm_counts_replicated_heads_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Four ranks, two kv heads of 16: each head sits on two ranks, so the sum of squares
    over the ranks counts every feature twice; the norm of rank 2's head must still be the
    whole projection's norm, sliced."""
    x = torch.randn(3, 32)
    heads = x.split(16, dim=-1)

    def all_reduce(sum_square: torch.Tensor) -> torch.Tensor:
        return 2 * sum(head.pow(2).sum(-1, keepdim=True) for head in heads)

    monkeypatch.setattr(olmo2, "tensor_model_parallel_all_reduce", all_reduce)
    weight = torch.rand(32) + 0.5
    norm = olmo2.ProjectionRMSNorm(32, 16, shard_index=1, replicas=2, eps=1e-6)
    norm.weight_loader(norm.weight, weight)
    want = weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(norm(heads[1]), want[:, 16:])
