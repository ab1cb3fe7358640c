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
import transformers

from model_utils import PagedRunner
from pagedlm.config import ArchConfig, ModelConfig
from pagedlm.model_executor.loader import load_model

BLOCK_SIZE = 4
PROMPT_LENS = [1, 7, 40, 13, 25, 2]
WINDOW = 8
SMALL = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)
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


def save_random_model(path: Path, config_class: str, overrides: dict[str, Any]) -> torch.nn.Module:
    torch.manual_seed(0)
    base = {} if config_class == "GPT2Config" else SMALL
    config = getattr(transformers, config_class)(**{**base, "vocab_size": 320, **overrides})
    # Eager attention is transformers' exact reference: its SDPA path drops Gemma 2's
    # attention soft-cap (the default in some versions, e.g. 5.17 on the GPU machine).
    model = transformers.AutoModelForCausalLM.from_config(
        config, dtype=torch.float32, attn_implementation="eager"
    )
    with torch.no_grad():
        for name, param in model.named_parameters():
            # Norm weights away from their identity value, so a missing or misread norm
            # shows; other weights large enough to move the logits visibly.
            if "norm" in name or ".ln_" in name:
                param.uniform_(0.5, 1.5)
            else:
                param.normal_(0.0, 0.08)
    model.save_pretrained(path)
    return model.eval()


def hf_logits(model: torch.nn.Module, prompt: list[int]) -> torch.Tensor:
    """[len(prompt), vocab] from one transformers forward."""
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0].float()


def paged_runner(model: torch.nn.Module, backend=None, device="cpu") -> PagedRunner:
    """A runner for the prompts of ``random_prompts``."""
    return PagedRunner(model, len(PROMPT_LENS), max(PROMPT_LENS), BLOCK_SIZE, backend, device)


@pytest.fixture(scope="module", params=list(CASES))
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    path = tmp_path_factory.mktemp(request.param)
    config_class, overrides = CASES[request.param]
    hf_model = save_random_model(path, config_class, overrides)
    prompts = random_prompts()
    expected = [hf_logits(hf_model, p) for p in prompts]
    return load_model(model_config(path, 128), torch.device("cpu")), prompts, expected


def random_prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(0, 320, (n,), generator=generator).tolist() for n in PROMPT_LENS]


def model_config(path: Path, max_model_len: int) -> ModelConfig:
    arch = ArchConfig.from_directory(path)
    return ModelConfig(str(path), None, arch, torch.float32, max_model_len=max_model_len)


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
    runner = paged_runner(model)
    split = [max(1, len(p) - 3) for p in prompts]
    got = runner.step([(i, 0, p[: split[i]]) for i, p in enumerate(prompts)])
    for offset in range(3):
        chunks = [
            (i, split[i] + offset, [p[split[i] + offset]])
            for i, p in enumerate(prompts)
            if split[i] + offset < len(p)
        ]
        if not chunks:
            break
        for (i, _, _), logits in zip(chunks, runner.step(chunks), strict=True):
            got[i] = torch.cat([got[i], logits])
    torch.testing.assert_close(torch.cat(got), torch.cat(expected), atol=1e-4, rtol=0)


def test_longrope_uses_short_factors_when_max_model_len_fits(tmp_path: Path) -> None:
    config_class, overrides = CASES["phi3_longrope"]
    hf_model = save_random_model(tmp_path, config_class, overrides)
    prompts = [p for p in random_prompts() if len(p) <= ORIGINAL_MAX]
    expected = [hf_logits(hf_model, p) for p in prompts]
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
        arch = ArchConfig.from_directory(tmp_path)
        config = ModelConfig(str(tmp_path), None, arch, dtype, max_model_len=128)
        model = load_model(config, torch.device("cpu"))
        assert {p.dtype for p in model.parameters()} == {dtype}
        runner = paged_runner(model)
        logits[dtype] = torch.cat(runner.step([(i, 0, p) for i, p in enumerate(prompts)]))
    assert logits[torch.bfloat16].dtype == torch.float32
    torch.testing.assert_close(logits[torch.bfloat16], logits[torch.float32], atol=0.2, rtol=0.05)
