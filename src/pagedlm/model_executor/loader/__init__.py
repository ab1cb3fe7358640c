"""Building a model and filling it with a checkpoint's weights (safetensors, PyTorch .bin/.pt
files or GGUF)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch
from torch import nn

from pagedlm.config import INT_CHECKPOINT_METHODS, ModelConfig
from pagedlm.kv_cache import fp8
from pagedlm.model_executor.layers.attention import install_kv_scales
from pagedlm.model_executor.layers.linear_base import deferred_weights
from pagedlm.model_executor.loader.gguf_blocks import AffineBlocks

if TYPE_CHECKING:  # weight_offload imports the layers, whose weight loaders import this
    from pagedlm.model_executor.weight_offload import WeightOffload

logger = logging.getLogger(__name__)


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


LOAD_FORMATS = ("auto", "safetensors", "pt", "gguf", "dummy")
"""vLLM's names: "auto" (a .gguf file by its name; a directory's safetensors, else its
PyTorch .bin/.pt files), "safetensors", "pt" (PyTorch pickles, read with ``weights_only``),
"gguf", "dummy" (random weights)."""


def iter_model_weights(
    model_config: ModelConfig, select: Callable[[str], bool] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) pairs of the checkpoint: a .gguf file, or a directory's safetensors
    or PyTorch files (``weight_files.checkpoint_files`` says which); with ``select``, only
    the tensors whose names it accepts (safetensors files do not read the others)."""
    weights = _iter_model_weights(model_config, select)
    if select is None:
        return weights
    return ((name, tensor) for name, tensor in weights if select(name))


def _iter_model_weights(
    model_config: ModelConfig, select: Callable[[str], bool] | None
) -> Iterator[tuple[str, torch.Tensor]]:
    if model_config.load_format not in ("auto", "safetensors", "pt", "gguf"):
        raise ValueError(
            f"load_format={model_config.load_format!r} reads no weights; "
            f"use one of {', '.join(LOAD_FORMATS)}."
        )
    if model_config.is_gguf:
        from pagedlm.model_executor.loader.gguf_loader import iter_gguf_weights

        return iter_gguf_weights(model_config.model, model_config.arch)
    from pagedlm.model_executor.loader.weight_files import checkpoint_files

    files = checkpoint_files(model_config.model, model_config.load_format)
    if files.format == "pt":
        from pagedlm.model_executor.loader.torch_bin import iter_torch_bin_weights

        if files.fell_back:
            names = [path.name for path in files.files]
            logger.info(
                "%s has no safetensors weights; load_format='auto' falls back to its PyTorch "
                "files (%s), read with torch.load(weights_only=True).",
                model_config.model,
                ", ".join(names) if len(names) <= 3 else f"{names[0]} and {len(names) - 1} more",
            )
        # Plain tensors under tensor parallelism too: each rank's weight loaders narrow them.
        return iter_torch_bin_weights(files.files)
    # Tensor-parallel ranks read only the slices their layers keep; a pre-quantized
    # checkpoint's parts go to bitsandbytes, which takes plain tensors only.
    from pagedlm.distributed import get_tensor_model_parallel_world_size
    from pagedlm.model_executor.loader.safetensors_loader import iter_safetensors_weights

    quantized = "quantization_config" in model_config.arch.raw
    slices = get_tensor_model_parallel_world_size() > 1 and not quantized
    return iter_safetensors_weights(model_config.model, slices=slices, select=select)


def load_model(
    model_config: ModelConfig,
    device: torch.device,
    *,
    keep_weight_blocks: bool = False,
    gguf_groups_of_16: bool = False,
    weights: Iterable[tuple[str, torch.Tensor]] | None = None,
    offload: WeightOffload | None = None,
    model_class: type[nn.Module] | None = None,
) -> nn.Module:
    """The model of ``model_config``, in ``model_config.dtype`` on ``device``, in eval mode.

    Parameters are allocated once, directly on the device and uninitialized, then
    overwritten from the checkpoint tensor by tensor (or with random values for
    ``load_format="dummy"``). Every parameter must be filled. With
    ``quantization="bitsandbytes"`` or ``"fp8"`` the linear layers are then quantized one
    by one (an FP8 checkpoint's layers are loaded quantized).

    ``keep_weight_blocks`` (a model whose ``has_weight_blocks``: a GGUF file, a GPTQ or AWQ
    checkpoint): the float weights of the layers with quantized blocks are left unfilled
    (``block_routing.load_keeping_blocks``); the caller must then put every layer
    ``quantized_linear_blocks`` returns on a kernel over its blocks (GGUF Q6_K layers among
    them with ``gguf_groups_of_16``).

    ``weights``: ``(checkpoint name, tensor)`` pairs to load instead of the checkpoint's
    files (a trainer's new weights, ``update_weights_from_tensor``); every parameter must
    be among them. Not for models kept on quantized blocks or loaded from pre-quantized
    checkpoints, whose layers are not float tensors.

    ``offload``: parameters go to host memory as the model creates them, up to its budget
    (``WeightOffload.while_building``); the caller settles it once the model is final.

    ``model_class``: build this class instead of the architecture's (a draft head read
    from its target's checkpoint); a class with ``checkpoint_selector(arch)`` reads only
    the tensors that selector accepts.
    """
    from pagedlm.model_executor.models.registry import get_model_class

    if model_class is None:
        model_class = get_model_class(model_config.arch.architecture, model_config.model_impl)
    selector = getattr(model_class, "checkpoint_selector", None)
    select = selector(model_config.arch) if selector is not None else None
    keep_blocks = keep_weight_blocks and model_config.has_weight_blocks
    if weights is not None:
        _check_float_layers(model_config, keep_blocks)
    # Keeping blocks, linear weights start on the meta device: the loader allocates those
    # it fills, so a layer that a kernel over its blocks replaces never takes its size.
    deferred = deferred_weights() if keep_blocks else contextlib.nullcontext()
    building = offload.while_building() if offload is not None else contextlib.nullcontext()
    with _default_dtype(model_config.dtype), torch.device(device), deferred, building:
        model = model_class(model_config.arch, max_model_len=model_config.max_model_len)
    if model_config.load_format == "dummy" and weights is None:
        from pagedlm.model_executor.loader.dummy import fill_dummy_weights

        fill_dummy_weights(model, model_config.seed)
    elif keep_blocks:
        loaded = _load_keeping_blocks(model, model_config, device, gguf_groups_of_16)
        check_all_loaded(model, loaded, model_config)
    else:
        if weights is None:
            weights = iter_model_weights(model_config, select)
        kv_scales: dict[tuple[int, str], float] = {}
        weights = fp8.split_kv_scales(weights, kv_scales)  # the models have no parameter
        if "quantization_config" in model_config.arch.raw:
            weights = _prequantized_weights(model, model_config, weights, select)
        with torch.no_grad():
            loaded = model.load_weights(weights)
            install_kv_scales(model, kv_scales)
        check_all_loaded(model, loaded, model_config)
    if model_config.quantization == "bitsandbytes":
        from pagedlm.model_executor.loader.bitsandbytes import quantize_model

        quantize_model(model, model_config.bnb_quant_type)
    elif model_config.quantization == "fp8":
        from pagedlm.model_executor.quantization import fp8 as fp8_weights

        fp8_weights.quantize_model(model)  # leaves the layers a pre-quantized checkpoint filled
    elif model_config.quantization not in (None, *INT_CHECKPOINT_METHODS):
        raise ValueError(
            f"quantization={model_config.quantization!r} is not supported; use None, "
            "'bitsandbytes' or 'fp8'."
        )
    return model.eval()


def _check_float_layers(model_config: ModelConfig, keep_blocks: bool) -> None:
    """Weights given as tensors fill float layers only (``load_model``'s ``weights``)."""
    if keep_blocks or model_config.is_gguf:
        raise ValueError(
            f"{model_config.model} computes on a GGUF file's quantized blocks, which float "
            "tensors cannot replace; update the weights from a file of the same kind "
            "(update_weights_from_disk) instead."
        )
    if "quantization_config" in model_config.arch.raw:
        raise ValueError(
            f"{model_config.model} is a pre-quantized checkpoint, whose layers float tensors "
            "cannot replace; update the weights from a checkpoint of the same kind "
            "(update_weights_from_disk), or serve a float checkpoint (quantization='fp8' "
            "quantizes given tensors too)."
        )


def _load_keeping_blocks(
    model: nn.Module, model_config: ModelConfig, device: torch.device, groups_of_16: bool
) -> set[str]:
    if model_config.is_gguf:
        from pagedlm.model_executor.loader.gguf_quantized import load_gguf_keeping_blocks

        return load_gguf_keeping_blocks(model, model_config.model, groups_of_16, device)
    from pagedlm.model_executor.quantization.int_checkpoint import (
        load_int_checkpoint_keeping_blocks,
    )
    from pagedlm.model_executor.quantization.int_formats import int_checkpoint_scheme

    scheme = int_checkpoint_scheme(model_config.arch.raw)
    assert scheme is not None  # has_weight_blocks: an integer checkpoint
    return load_int_checkpoint_keeping_blocks(model, model_config.model, scheme, device)


def quantized_linear_blocks(
    model: nn.Module, model_config: ModelConfig, groups_of_16: bool = False
) -> dict[str, AffineBlocks]:
    """Module name -> the quantized blocks of that linear layer's weight, for a model of
    ``model_config`` (``has_weight_blocks``): those ``load_model(keep_weight_blocks=True)``
    kept, else a GGUF file's read again and checked against the loaded weights (a GPTQ or
    AWQ model loaded dequantized has none to give)."""
    from pagedlm.model_executor.loader.block_routing import take_kept_blocks

    kept = take_kept_blocks(model)
    if kept is not None:
        return kept
    if model_config.is_gguf:
        from pagedlm.model_executor.loader.gguf_quantized import gguf_linear_blocks

        return gguf_linear_blocks(model, model_config.model, groups_of_16)
    return {}


def _prequantized_weights(
    model: nn.Module,
    model_config: ModelConfig,
    weights: Iterator[tuple[str, torch.Tensor]],
    select: Callable[[str], bool] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """The weight stream of a bitsandbytes or int8 compressed-tensors checkpoint
    (dequantized) or an FP8 one (the model's quantized layers prepared to take its codes
    and scales). ``select``: the names ``weights`` was filtered by (a model read from part
    of a checkpoint); the FP8 layers are found among those tensors only."""
    from pagedlm.model_executor.loader import bitsandbytes
    from pagedlm.model_executor.quantization.fp8_checkpoint import (
        fp8_checkpoint_scheme,
        prepare_fp8_checkpoint,
    )

    raw = model_config.arch.raw
    if bitsandbytes.checkpoint_quant_type(raw):
        return bitsandbytes.dequantize_checkpoint(weights)
    if model_config.quantization in INT_CHECKPOINT_METHODS:
        from pagedlm.model_executor.quantization.int_checkpoint import dequantized_weights
        from pagedlm.model_executor.quantization.int_formats import int_checkpoint_scheme

        scheme = int_checkpoint_scheme(raw)
        assert scheme is not None  # quantization is set from the checkpoint's config
        return dequantized_weights(scheme, weights)
    from pagedlm.model_executor.quantization.int8_checkpoint import (
        dequantize_int8,
        int8_checkpoint_scheme,
    )

    int8_scheme = int8_checkpoint_scheme(raw)
    if int8_scheme is not None:
        return dequantize_int8(weights, int8_scheme)
    scheme = fp8_checkpoint_scheme(raw)
    if scheme is None or model_config.is_gguf:
        return weights
    if scheme.block_size is not None:  # float weights now; quantized per row after loading
        from pagedlm.model_executor.quantization.fp8_checkpoint import dequantize_blocks

        return dequantize_blocks(weights, scheme.block_size)
    from pagedlm.model_executor.loader.safetensors_loader import safetensors_shapes

    shapes = safetensors_shapes(model_config.model)
    if select is not None:
        shapes = {name: shape for name, shape in shapes.items() if select(name)}
    return prepare_fp8_checkpoint(model, scheme, shapes, weights)


def check_all_loaded(model: nn.Module, loaded: set[str], model_config: ModelConfig) -> None:
    """Every parameter of ``model`` was filled from the checkpoint (a clear error if not)."""
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


__all__ = [
    "LOAD_FORMATS",
    "check_all_loaded",
    "iter_model_weights",
    "load_model",
    "quantized_linear_blocks",
]
