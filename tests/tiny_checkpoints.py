"""Tiny random transformers checkpoints for the parity tests, and transformers' answers on them.

The reference side of every "pagedlm equals transformers" test: a random model saved as
safetensors, random prompts, its logits (one forward) and its greedy continuations
(``generate``), plus the ``ModelConfig`` pagedlm loads the checkpoint with.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import transformers

from pagedlm.config import ArchConfig, ModelConfig

SMALL: dict[str, Any] = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)
"""Sizes of a Llama-shaped tiny model (GPT-2 spells its own and takes only the vocabulary)."""
PROMPT_LENS = [1, 7, 40, 13, 25, 2]
"""Mixed prompt lengths for the model-level tests: single tokens, a few blocks, one long."""


def save_random_model(path: Path, config_class: str, overrides: dict[str, Any]) -> torch.nn.Module:
    """A random ``transformers.<config_class>`` model (``SMALL`` sizes, then ``overrides``)
    saved as safetensors in ``path``; returned in eval mode, fp32, eager attention."""
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


def random_prompts(
    lens: list[int] = PROMPT_LENS, vocab_size: int = 320, seed: int = 1
) -> list[list[int]]:
    """One prompt of random token ids per length in ``lens``, the same for the same seed."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=generator).tolist() for n in lens]


def model_config(
    path: Path, max_model_len: int = 128, dtype: torch.dtype = torch.float32
) -> ModelConfig:
    """How pagedlm loads the checkpoint in ``path`` (no tokenizer)."""
    arch = ArchConfig.from_directory(path)
    return ModelConfig(str(path), None, arch, dtype, max_model_len=max_model_len)


def hf_logits(model: torch.nn.Module, prompt: list[int]) -> torch.Tensor:
    """float32 logits [len(prompt), vocab] from one transformers forward."""
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0].float()


def hf_greedy(model: torch.nn.Module, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """transformers' greedy continuation of each prompt: exactly ``new_tokens`` ids (EOS
    does not stop it, and token 0 is data, not padding)."""
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    continuations = []
    with torch.no_grad():
        for ids in prompts:
            input_ids = torch.tensor([ids])
            generated = model.generate(
                input_ids,
                attention_mask=torch.ones_like(input_ids),
                max_new_tokens=new_tokens,
                do_sample=False,
            )
            continuations.append(generated[0, len(ids) :].tolist())
    return continuations


def save_with_reference_logits(
    path: Path, config_class: str, overrides: dict[str, Any]
) -> tuple[list[list[int]], list[torch.Tensor]]:
    """``save_random_model`` in ``path``; then ``random_prompts()`` and transformers' logits
    [len(prompt), vocab] for each, the expected side of a logits comparison."""
    hf_model = save_random_model(path, config_class, overrides)
    prompts = random_prompts()
    return prompts, [hf_logits(hf_model, p) for p in prompts]


def load_hf_model(path: Path | str) -> torch.nn.Module:
    """transformers' own fp32 load of the checkpoint in ``path``."""
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
