"""The GGUF file's own quantization of each linear layer, for kernels that compute on it.

A platform with a weight-only quantized matmul asks ``gguf_linear_blocks`` for the file's
blocks in affine form (``gguf_blocks.AffineBlocks``), laid out exactly like each layer's
weight; ``block_routing`` routes them through the model's own ``load_weights`` (llama's
q/k rows are un-permuted on the way by the GGUF entries' ``fix_rows``). A caller whose
kernels take a scale per 16 columns (``groups_of_16``: the CUDA platform) also gets the
blocks of Q2_K, Q3_K and Q6_K tensors: when the file has any, every tensor's scales are
routed at one column per 16, and only layers with such rows keep the finer groups (v_proj
in Q6_K next to q/k in Q4_K makes the whole qkv_proj so). A tensor without an affine form
(an IQ type or F16, or Q2_K, Q3_K or Q6_K for a caller without groups of 16) gives its
layer no blocks.

Two ways in. After an ordinary load (float weights dequantized), ``gguf_linear_blocks``
reads the file's blocks again and checks each layer against its weight. A platform that
will put every such layer on its blocks (``Platform.computes_on_weight_blocks``) has the
model loaded by ``load_gguf_keeping_blocks`` instead: each tensor is read once, the blocks
are routed first, and the float weights of the layers that get them are never computed;
``gguf_linear_blocks`` then hands over those blocks.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from pagedlm.model_executor.loader.block_routing import (
    linear_blocks_from,
    load_keeping_blocks,
    take_kept_blocks,
)
from pagedlm.model_executor.loader.gguf_blocks import GROUP_SIZE, AffineBlocks, decode_blocks
from pagedlm.model_executor.loader.gguf_loader import (
    GGUF_ARCHITECTURES,
    iter_gguf_entries,
    offset_norm,
)
from pagedlm.model_executor.loader.gguf_reader import (
    dequantize_gguf_raw,
    read_gguf_header,
    read_gguf_raw,
)
from pagedlm.model_executor.loader.weight_utils import one_intra_op_thread

_PARTS = ("codes", "scales", "mins")


def _iter_blocks(
    path: str, model: nn.Module, groups_of_16: bool = False
) -> Iterator[tuple[str, AffineBlocks]]:
    """(HF name, affine blocks in HF row order) for each 2-D tensor that has an affine form
    (Q2_K's, Q3_K's and Q6_K's, in groups of 16, only with ``groups_of_16``)."""
    header = read_gguf_header(path)
    with open(path, "rb", buffering=0) as file:
        for name, info, fix_rows in iter_gguf_entries(header, model.arch):
            if len(info.shape) != 2 or info.shape[1] % GROUP_SIZE:
                continue
            raw, type_name = read_gguf_raw(file, info, path)
            blocks = decode_blocks(raw, type_name, info.shape, groups_of_16)
            if blocks is not None:
                yield name, AffineBlocks(*(fix_rows(getattr(blocks, p)) for p in _PARTS))


def gguf_linear_blocks(
    model: nn.Module, path: str, groups_of_16: bool = False
) -> dict[str, AffineBlocks]:
    """Module name -> its weight's blocks, for every ``LinearBase`` whose whole weight came
    from affine-form tensors of the GGUF file ``path`` (the model loaded from it); with
    ``groups_of_16``, Q2_K, Q3_K and Q6_K tensors count as affine too (a scale per 16
    columns).

    For a model that ``load_gguf_keeping_blocks`` filled, the blocks it kept (once: a
    second call reads the file).
    """
    kept = take_kept_blocks(model)
    if kept is not None:
        return kept
    # Decoded once (about 1.1 bytes per weight), then routed part by part.
    return linear_blocks_from(model, _iter_blocks(path, model, groups_of_16))


def load_gguf_keeping_blocks(
    model: nn.Module, path: str, groups_of_16: bool = False, device: torch.device | None = None
) -> set[str]:
    """Fill ``model`` from the GGUF file ``path``, reading each tensor once, and keep the
    blocks of every linear layer whose whole weight has them for ``gguf_linear_blocks``
    (those in groups of 16 too with ``groups_of_16``); returns the names of the parameters
    filled. The float weights of kept layers are never made: the caller must give each of
    them a kernel on its blocks (``block_routing.load_keeping_blocks``)."""
    with one_intra_op_thread():
        return _load_keeping_blocks(model, path, groups_of_16, device)


def _load_keeping_blocks(
    model: nn.Module, path: str, groups_of_16: bool, device: torch.device | None
) -> set[str]:
    header = read_gguf_header(path)
    norm_offset = GGUF_ARCHITECTURES[header.metadata["general.architecture"]].norm_offset
    blocks_by_tensor: dict[str, AffineBlocks] = {}
    others = []  # tensors without an affine form: read in the float pass
    with open(path, "rb", buffering=0) as file:
        for name, info, fix_rows in iter_gguf_entries(header, model.arch):
            if len(info.shape) == 2 and info.shape[1] % GROUP_SIZE == 0:
                raw, type_name = read_gguf_raw(file, info, path)
                blocks = decode_blocks(raw, type_name, info.shape, groups_of_16)
                if blocks is not None:
                    blocks_by_tensor[name] = AffineBlocks(
                        *(fix_rows(getattr(blocks, p)) for p in _PARTS)
                    )
                    continue
            others.append((name, info, fix_rows))

        def float_weights() -> Iterator[tuple[str, torch.Tensor]]:
            for name, info, fix_rows in others:
                raw, type_name = read_gguf_raw(file, info, path)
                tensor = fix_rows(dequantize_gguf_raw(raw, type_name, info, path))
                yield name, offset_norm(tensor, info, norm_offset)

        return load_keeping_blocks(model, blocks_by_tensor, float_weights, device)


__all__ = ["gguf_linear_blocks", "load_gguf_keeping_blocks"]
