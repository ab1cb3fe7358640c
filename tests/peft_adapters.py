"""Tiny random PEFT adapters for the LoRA tests, made with ``peft`` itself.

``make_adapter`` saves an adapter directory in PEFT's own layout and returns the base
model with that adapter merged in (``merge_and_unload``): the reference transformers
runs for parity.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tiny_checkpoints import load_hf_model

LLAMA_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PHI3_MODULES = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]


def make_adapter(
    base: Path,
    out: Path,
    target_modules: list[str],
    rank: int = 8,
    alpha: float = 16.0,
    use_rslora: bool = False,
    seed: int = 0,
    std: float = 0.15,
) -> torch.nn.Module:
    """Save a random LoRA adapter for the checkpoint in ``base`` into ``out``; returns the
    merged transformers model (fp32, eval)."""
    import peft

    model = load_hf_model(base)
    config = peft.LoraConfig(
        r=rank,
        lora_alpha=alpha,
        target_modules=target_modules,
        use_rslora=use_rslora,
        init_lora_weights=False,
        lora_dropout=0.0,
    )
    peft_model = peft.get_peft_model(model, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * std)
    peft_model.save_pretrained(out)
    assert (out / "adapter_model.safetensors").is_file()
    return peft_model.merge_and_unload().eval()


def edit_config(adapter: Path, **changes) -> None:
    """Change fields of a saved adapter's adapter_config.json."""
    path = adapter / "adapter_config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def rename_tensors(adapter: Path, old: str, new: str) -> None:
    """Replace ``old`` with ``new`` in the tensor names of a saved adapter."""
    from safetensors.torch import load_file, save_file

    path = adapter / "adapter_model.safetensors"
    tensors = load_file(str(path))
    save_file({name.replace(old, new): t for name, t in tensors.items()}, str(path))


def lora_llm(base: Path, **overrides):
    """An offline ``LLM`` on ``base`` serving adapters of rank 8 or less (no tokenizer, a
    small KV cache); ``overrides``: other engine arguments (``max_loras``, ...)."""
    from pagedlm import LLM

    args = {"enable_lora": True, "max_lora_rank": 8, "num_kv_blocks": 32} | overrides
    return LLM(str(base), skip_tokenizer_init=True, **args)
