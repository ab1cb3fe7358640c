"""Tiny random checkpoints for speculative decoding: a Llama target, a draft model, and EAGLE
heads written the way the EAGLE authors publish them (``yuhuili/EAGLE-LLaMA3.1-Instruct-8B``:
``config.json`` with ``LlamaForCausalLM`` and ``pytorch_model.bin``; ``yuhuili/EAGLE3-
LLaMA3.1-Instruct-8B``: ``LlamaForCausalLMEagle3`` with a draft vocabulary and ``d2t``/``t2d``)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers
from safetensors.torch import save_file

VOCAB = 96
HIDDEN = 32
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 8
INTERMEDIATE = 64
MAX_POSITIONS = 512


def _llama_config(num_layers: int, **extra) -> transformers.LlamaConfig:
    return transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
        num_hidden_layers=num_layers, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
        max_position_embeddings=MAX_POSITIONS, initializer_range=0.3, **extra,
    )  # fmt: skip


def write_llama(path: Path, num_layers: int, seed: int) -> Path:
    """A random Llama (fp32) saved with transformers."""
    torch.manual_seed(seed)
    transformers.LlamaForCausalLM(_llama_config(num_layers)).save_pretrained(path)
    return path


def _head_config(path: Path, architecture: str, **extra) -> None:
    config = _llama_config(1).to_dict()
    config.update(architectures=[architecture], torch_dtype="float32", **extra)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))


def _layer(prefix: str, attention_in: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) * 0.3

    return {
        f"{prefix}self_attn.q_proj.weight": rand(HEADS * HEAD_DIM, attention_in),
        f"{prefix}self_attn.k_proj.weight": rand(KV_HEADS * HEAD_DIM, attention_in),
        f"{prefix}self_attn.v_proj.weight": rand(KV_HEADS * HEAD_DIM, attention_in),
        f"{prefix}self_attn.o_proj.weight": rand(HIDDEN, HEADS * HEAD_DIM),
        f"{prefix}mlp.gate_proj.weight": rand(INTERMEDIATE, HIDDEN),
        f"{prefix}mlp.up_proj.weight": rand(INTERMEDIATE, HIDDEN),
        f"{prefix}mlp.down_proj.weight": rand(HIDDEN, INTERMEDIATE),
        f"{prefix}post_attention_layernorm.weight": 1 + rand(HIDDEN),
    }


def write_eagle(path: Path, seed: int = 1) -> Path:
    """EAGLE-1: ``fc`` with a bias, one layer without ``input_layernorm``, and its own
    ``embed_tokens`` (the authors save their frozen copy of the target's; it is loaded)."""
    generator = torch.Generator().manual_seed(seed)
    _head_config(path, "LlamaForCausalLM", bias=True)
    weights = _layer("layers.0.", HIDDEN, generator)
    weights["fc.weight"] = torch.randn(HIDDEN, 2 * HIDDEN, generator=generator) * 0.3
    weights["fc.bias"] = torch.randn(HIDDEN, generator=generator) * 0.1
    weights["embed_tokens.weight"] = torch.randn(VOCAB, HIDDEN, generator=generator)
    torch.save(weights, path / "pytorch_model.bin")
    return path


def write_eagle3(path: Path, aux_layers: list[int], seed: int = 2) -> Path:
    """EAGLE-3: ``midlayer`` over ``[2 hidden]``, ``fc`` over three target layers, its own
    LM head over half the vocabulary, ``d2t`` offsets to target ids (and ``t2d``); no
    embedding (the target's is shared)."""
    generator = torch.Generator().manual_seed(seed)
    draft_vocab = VOCAB // 2
    _head_config(
        path,
        "LlamaForCausalLMEagle3",
        draft_vocab_size=draft_vocab,
        target_hidden_size=HIDDEN,
        eagle_config={"eagle_aux_hidden_state_layer_ids": aux_layers},
    )
    weights = _layer("midlayer.", 2 * HIDDEN, generator)
    weights["midlayer.input_layernorm.weight"] = torch.ones(HIDDEN)
    weights["midlayer.hidden_norm.weight"] = torch.ones(HIDDEN)
    weights["fc.weight"] = torch.randn(HIDDEN, 3 * HIDDEN, generator=generator) * 0.3
    weights["norm.weight"] = torch.ones(HIDDEN)
    weights["lm_head.weight"] = torch.randn(draft_vocab, HIDDEN, generator=generator)
    draft_to_target = torch.arange(0, VOCAB, 2)  # the even token ids
    weights["d2t"] = draft_to_target - torch.arange(draft_vocab)
    t2d = torch.zeros(VOCAB, dtype=torch.bool)
    t2d[draft_to_target] = True
    weights["t2d"] = t2d
    save_file(weights, str(path / "model.safetensors"))
    return path
