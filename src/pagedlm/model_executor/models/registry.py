"""Which model class implements each HF ``architectures`` name (imported on first use)."""

from __future__ import annotations

import importlib

from torch import nn

_LLAMA = "pagedlm.model_executor.models.llama"

SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": f"{_LLAMA}:LlamaForCausalLM",
    "MistralForCausalLM": f"{_LLAMA}:MistralForCausalLM",
    "Qwen2ForCausalLM": f"{_LLAMA}:Qwen2ForCausalLM",
    "Qwen3ForCausalLM": f"{_LLAMA}:Qwen3ForCausalLM",
}
"""HF architecture name -> ``"module:Class"``."""


def get_model_class(architecture: str) -> type[nn.Module]:
    """The model class for config.json's ``architectures[0]``."""
    try:
        target = SUPPORTED_ARCHITECTURES[architecture]
    except KeyError:
        raise ValueError(
            f"Model architecture {architecture!r} is not supported; supported: "
            f"{', '.join(sorted(SUPPORTED_ARCHITECTURES))}."
        ) from None
    module_name, class_name = target.split(":")
    return getattr(importlib.import_module(module_name), class_name)
