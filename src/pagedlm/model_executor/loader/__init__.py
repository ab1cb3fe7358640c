"""Building a model and filling it with a checkpoint's weights (safetensors or GGUF)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from pagedlm.config import ModelConfig


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def iter_model_weights(model_config: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) pairs of the checkpoint: a .gguf file or a safetensors directory."""
    if model_config.is_gguf:
        from pagedlm.model_executor.loader.gguf_loader import iter_gguf_weights

        return iter_gguf_weights(model_config.model, model_config.arch)
    from pagedlm.model_executor.loader.safetensors_loader import iter_safetensors_weights

    return iter_safetensors_weights(model_config.model)


def load_model(model_config: ModelConfig, device: torch.device) -> nn.Module:
    """The model of ``model_config``, in ``model_config.dtype`` on ``device``, in eval mode.

    Parameters are allocated once, directly on the device and uninitialized, then
    overwritten from the checkpoint tensor by tensor. Every parameter must be filled.
    """
    from pagedlm.model_executor.models.registry import get_model_class

    model_class = get_model_class(model_config.arch.architecture)
    with _default_dtype(model_config.dtype), torch.device(device):
        model = model_class(model_config.arch, max_model_len=model_config.max_model_len)
    with torch.no_grad():
        loaded = model.load_weights(iter_model_weights(model_config))
    missing = sorted(name for name, _ in model.named_parameters() if name not in loaded)
    if missing:
        shown = ", ".join(missing[:8]) + (
            f" and {len(missing) - 8} more" if len(missing) > 8 else ""
        )
        raise ValueError(
            f"the checkpoint {model_config.model} has no tensor for {len(missing)} parameters "
            f"of {model_config.arch.architecture}: {shown}. The file is incomplete or does "
            "not match config.json (for a tied LM head set tie_word_embeddings: true)."
        )
    return model.eval()


__all__ = ["iter_model_weights", "load_model"]
