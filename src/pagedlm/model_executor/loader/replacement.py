"""Whether a checkpoint can replace a running engine's weights (SGLang's
``update_weights_from_disk``, as reinforcement-learning loops call it between rollouts).

The engine keeps its configuration, KV cache size and tokenizer; only the weights change,
so a replacement checkpoint must have the model's shape and format. ``check_replacement``
says what differs before anything is unloaded.
"""

from __future__ import annotations

import os

from pagedlm.config import ArchConfig, ModelConfig

SHAPE_FIELDS = (
    "architecture",
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "tie_word_embeddings",
)


def _quant_method(arch: ArchConfig) -> str | None:
    quantization = arch.raw.get("quantization_config")
    return quantization.get("quant_method") if isinstance(quantization, dict) else None


def check_replacement(current: ModelConfig, model_path: str) -> None:
    """ValueError naming the difference unless ``model_path`` (a local Hugging Face
    directory or ``.gguf`` file) holds a checkpoint of ``current``'s shape and format."""
    if not os.path.exists(model_path):
        raise ValueError(
            f"model_path={model_path!r} does not exist; pass a local checkpoint directory "
            "(config.json + *.safetensors) or .gguf file."
        )
    is_gguf = model_path.endswith(".gguf")
    if is_gguf != current.is_gguf:
        kinds = ("a .gguf file", "a Hugging Face directory")
        raise ValueError(
            f"The model was loaded from {kinds[not current.is_gguf]}; update it from "
            f"{kinds[not current.is_gguf]} too, not {model_path!r}."
        )
    if is_gguf:
        from pagedlm.model_executor.loader.gguf_loader import gguf_arch_config

        new = gguf_arch_config(model_path)
    else:
        new = ArchConfig.from_directory(model_path)
    old = current.arch
    for field in SHAPE_FIELDS:
        before, after = getattr(old, field), getattr(new, field)
        if before != after:
            raise ValueError(
                f"{model_path} has {field}={after!r} where the served model has {before!r}; "
                "a weight update keeps the model's shape. Start a new engine for another "
                "model."
            )
    if _quant_method(old) != _quant_method(new):
        raise ValueError(
            f"{model_path} is quantized as {_quant_method(new)!r} where the served model is "
            f"{_quant_method(old)!r}; a weight update keeps the checkpoint's format."
        )
