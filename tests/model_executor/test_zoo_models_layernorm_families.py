"""GPT-NeoX, StableLM, Phi, Starcoder2 and Cohere 1/2 against transformers.

Logits of tiny random checkpoints, fp32, through the paged CPU backend: one prefill step
for all prompts, then the same prompts as a prefix chunk followed by single-token decode
steps (which read the cache). Each family's options that change the math get a case:
parallel and sequential residuals, partial rotary (GPT-NeoX, StableLM, Phi), q/k norms,
biases, interleaved rotary and a logit scale (Cohere). Windows are 8 tokens and prompts
reach 40, so every sliding layer drops keys.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from model_executor.test_tensor_parallel import assert_two_ranks_match_one
from model_utils import PagedRunner
from pagedlm.config import ArchConfig
from pagedlm.model_executor.layers.rotary_embedding import RotaryEmbedding
from pagedlm.model_executor.layers.rotary_scaled import TableRotaryEmbedding, get_rope
from pagedlm.model_executor.loader import load_model
from pagedlm.model_executor.models.gpt_neox import GPTNeoXForCausalLM
from tiny_checkpoints import (
    PROMPT_LENS,
    model_config,
    random_prompts,
    save_random_model,
    save_with_reference_logits,
)

BLOCK_SIZE = 4
WINDOW = 8

CASES: dict[str, tuple[str, dict[str, Any]]] = {
    # GPT-NeoX has no grouped-query attention: SMALL's num_key_value_heads is dropped.
    "gpt_neox_parallel": ("GPTNeoXConfig", {"num_key_value_heads": None}),
    "gpt_neox_sequential": (
        "GPTNeoXConfig",
        {
            "num_key_value_heads": None,
            "use_parallel_residual": False,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 500.0,
                "partial_rotary_factor": 0.5,
            },
            "hidden_act": "gelu_fast",
        },
    ),
    "stablelm_qk_layernorm": ("StableLmConfig", {"qk_layernorm": True}),
    "stablelm_parallel_qkv_bias": (
        "StableLmConfig",
        {"use_parallel_residual": True, "use_qkv_bias": True, "partial_rotary_factor": 0.5},
    ),
    # Phi-2's 0.4 leaves 6 of 16 features rotating.
    "phi": ("PhiConfig", {"partial_rotary_factor": 0.4}),
    "phi_qk_layernorm": ("PhiConfig", {"qk_layernorm": True, "num_key_value_heads": 4}),
    "starcoder2_window": ("Starcoder2Config", {"sliding_window": WINDOW}),
    "starcoder2_no_bias": (
        "Starcoder2Config",
        {"use_bias": False, "tie_word_embeddings": False, "hidden_act": "gelu"},
    ),
    "cohere_qk_norm": ("CohereConfig", {"use_qk_norm": True, "logit_scale": 0.25}),
    "cohere_bias": ("CohereConfig", {"attention_bias": True, "logit_scale": 2.0}),
    "cohere2": (
        "Cohere2Config",
        {
            "sliding_window": WINDOW,
            "layer_types": ["sliding_attention", "full_attention"],
            "logit_scale": 0.5,
        },
    ),
}


def paged_runner(model: torch.nn.Module) -> PagedRunner:
    return PagedRunner(model, len(PROMPT_LENS), max(PROMPT_LENS), BLOCK_SIZE)


@pytest.fixture(scope="module", params=list(CASES))
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    path = tmp_path_factory.mktemp(request.param)
    prompts, expected = save_with_reference_logits(path, *CASES[request.param])
    return load_model(model_config(path, 128), torch.device("cpu")), prompts, expected


def test_prefill_matches_transformers(case) -> None:
    model, prompts, expected = case
    got = paged_runner(model).step([(i, 0, p) for i, p in enumerate(prompts)])
    torch.testing.assert_close(torch.cat(got), torch.cat(expected), atol=1e-4, rtol=0)


def test_chunk_then_decodes_read_the_cache(case) -> None:
    """Each prompt: a first chunk, then its last (up to) 3 tokens as separate decode steps,
    all requests batched together in every step."""
    model, prompts, expected = case
    got = paged_runner(model).chunk_then_decodes(prompts)
    torch.testing.assert_close(torch.cat(got), torch.cat(expected), atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", ["gpt_neox_parallel", "stablelm_qk_layernorm", "cohere2"])
def test_bfloat16_stays_close_to_float32(tmp_path: Path, name: str) -> None:
    save_random_model(tmp_path, *CASES[name])
    prompts = random_prompts()
    logits = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = load_model(model_config(tmp_path, dtype=dtype), torch.device("cpu"))
        assert {p.dtype for p in model.parameters()} == {dtype}
        runner = paged_runner(model)
        logits[dtype] = torch.cat(runner.step([(i, 0, p) for i, p in enumerate(prompts)]))
    torch.testing.assert_close(logits[torch.bfloat16], logits[torch.float32], atol=0.2, rtol=0.05)


def test_interleaved_rotary_pairs_adjacent_features() -> None:
    """is_neox_style=False rotates (x[2i], x[2i + 1]) by pair i's angle, as Cohere does."""
    rotary = get_rope(8, 16, 100.0, is_neox_style=False)
    assert type(rotary) is RotaryEmbedding and not rotary.is_neox_style
    x = torch.randn(3, 2 * 8)
    positions = torch.tensor([0, 5, 11])
    got, _ = rotary(positions, x, x.clone())
    angles = positions[:, None].float() * rotary_inv_freq(8, 100.0)
    cos, sin = angles.cos()[:, None], angles.sin()[:, None]  # [T, 1, 4]
    pairs = x.view(3, 2, 4, 2)
    first, second = pairs[..., 0], pairs[..., 1]
    want = torch.stack([first * cos - second * sin, second * cos + first * sin], -1)
    torch.testing.assert_close(got, want.view(3, 16))


def rotary_inv_freq(head_dim: int, base: float) -> torch.Tensor:
    return 1.0 / base ** (torch.arange(0, head_dim, 2).float() / head_dim)


def test_interleaved_rotary_refuses_partial_rotation() -> None:
    with pytest.raises(ValueError, match="whole heads"):
        get_rope(16, 32, 100.0, rotary_dim=8, is_neox_style=False)


def test_gpt_neox_reads_older_config_keys(tmp_path: Path) -> None:
    """Pythia's config.json: ``rotary_pct`` and ``rotary_emb_base``, no rope_parameters."""
    raw = {
        "architectures": ["GPTNeoXForCausalLM"],
        "vocab_size": 64,
        "hidden_size": 32,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "intermediate_size": 64,
        "rotary_pct": 0.5,
        "rotary_emb_base": 1000,
    }
    model = GPTNeoXForCausalLM(ArchConfig.from_hf_dict(raw))
    rotary = model.model.layers[0].self_attn.rotary_emb
    assert isinstance(rotary, TableRotaryEmbedding) and rotary.rotary_dim == 8
    angle = rotary.cos_sin_cache[1, 1].acos()  # position 1, the second pair's angle
    torch.testing.assert_close(angle, torch.tensor(1000.0 ** (-2 / 8)))
    raw["num_key_value_heads"] = 1
    with pytest.raises(ValueError, match="no grouped-query attention"):
        GPTNeoXForCausalLM(ArchConfig.from_hf_dict(raw))


# An odd vocabulary pads the last rank's LM-head shard (Phi's head bias included); one kv
# head for StableLM puts it on both ranks (its k norm too).
TENSOR_PARALLEL_CASES = {
    "gpt_neox_parallel": {"vocab_size": 251},
    "stablelm_qk_layernorm": {"num_key_value_heads": 1},
    "phi_qk_layernorm": {"vocab_size": 251},
    "cohere_qk_norm": {},
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(TENSOR_PARALLEL_CASES))
def test_two_ranks_match_one(tmp_path: Path, name: str) -> None:
    """Fused per-head q/k/v (GPT-NeoX), per-head q/k norms and the LM-head bias split
    across two gloo ranks give the single-process logits."""
    config_class, overrides = CASES[name]
    model_dir = tmp_path / "model"
    save_random_model(model_dir, config_class, {**overrides, **TENSOR_PARALLEL_CASES[name]})
    assert_two_ranks_match_one([str(model_dir)], tmp_path)
