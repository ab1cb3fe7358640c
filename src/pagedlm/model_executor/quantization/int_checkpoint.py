"""Loading integer weight-only checkpoints (GPTQ, AWQ, compressed-tensors "pack-quantized";
their layouts are ``int_formats``'): every quantized layer's parts joined as they stream
past, then either dequantized (platforms without kernels for them) or kept as blocks.

A layer whose groups are runs of whole 32-column blocks becomes ``AffineBlocks``: codes,
and per 32 columns the scale and the minimum ``-s * z``, so the GGUF kernels of every
platform compute on it (``loader.block_routing``). That form is exact: ``q * s`` and
``s * z`` are exact in float32 (a scale of at most 11 significant bits times a code of at
most 8 bits) and so is their difference, ``(q - z) * s``. An act-order layer whose groups
interleave, or a group size that is not a multiple of 32, has no such form; its weight is
dequantized.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from pagedlm.model_executor.loader.gguf_blocks import AffineBlocks
from pagedlm.model_executor.quantization.int_formats import (
    IntCheckpointScheme,
    IntLayer,
    decode_layer,
)


def iter_int_layers(
    scheme: IntCheckpointScheme, weights: Iterable[tuple[str, torch.Tensor]]
) -> Iterator[tuple[str, IntLayer | torch.Tensor]]:
    """The checkpoint stream with each quantized layer's parts joined: (``<layer>.weight``,
    its ``IntLayer``) once its parts have all come (``required_parts``; a GPTQ layer
    saved without ``g_idx`` at the stream's end), every other tensor as it is."""
    required = scheme.required_parts()
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        split = scheme.split_part(name)
        if split is None:
            yield name, tensor
            continue
        layer, part = split
        parts = pending.setdefault(layer, {})
        parts[part] = tensor
        if required <= parts.keys():
            del pending[layer]
            yield f"{layer}.weight", decode_layer(scheme, parts, layer)
    optional = {"g_idx"}
    incomplete = [
        layer for layer, parts in pending.items() if not required - optional <= parts.keys()
    ]
    if incomplete:
        raise ValueError(
            f"the checkpoint lacks part of {len(incomplete)} quantized layers (e.g. "
            f"{incomplete[0]}: it has {sorted(pending[incomplete[0]])}); it is incomplete."
        )
    for layer, parts in pending.items():
        yield f"{layer}.weight", decode_layer(scheme, parts, layer)


def dequantized_weights(
    scheme: IntCheckpointScheme, weights: Iterable[tuple[str, torch.Tensor]]
) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint stream with every quantized layer as its float32 weight [out, in]."""
    for name, value in iter_int_layers(scheme, weights):
        yield name, value.dequantize() if isinstance(value, IntLayer) else value


def load_int_checkpoint_keeping_blocks(
    model: torch.nn.Module,
    directory: str,
    scheme: IntCheckpointScheme,
    device: torch.device | None = None,
) -> set[str]:
    """Fill ``model`` from the integer checkpoint in ``directory``, keeping each
    quantized layer that has an affine form as blocks (``block_routing.load_keeping_blocks``:
    its float weight is never made; the caller gives it a kernel on them); the others are
    dequantized. Returns the names of the parameters filled."""
    from pagedlm.model_executor.loader.block_routing import load_keeping_blocks
    from pagedlm.model_executor.loader.safetensors_loader import iter_safetensors_weights

    def is_part(name: str) -> bool:
        return scheme.split_part(name) is not None

    blocks_by_tensor: dict[str, AffineBlocks] = {}
    dense: dict[str, IntLayer] = {}
    for name, layer in iter_int_layers(scheme, iter_safetensors_weights(directory, select=is_part)):
        assert isinstance(layer, IntLayer)  # only quantized parts were read
        blocks = layer.affine_blocks()
        if blocks is None:
            dense[name] = layer
        else:
            blocks_by_tensor[name] = blocks

    def other_weights() -> Iterator[tuple[str, torch.Tensor]]:
        for name, layer in dense.items():
            yield name, layer.dequantize()
        yield from iter_safetensors_weights(directory, select=lambda name: not is_part(name))

    return load_keeping_blocks(model, blocks_by_tensor, other_weights, device)


__all__ = ["dequantized_weights", "iter_int_layers", "load_int_checkpoint_keeping_blocks"]
