"""The GGUF file's own quantization of each linear layer, for kernels that compute on it.

The float weights of a GGUF model are loaded as usual (dequantized). A platform with a
weight-only quantized matmul then asks ``gguf_linear_blocks`` for the file's blocks in
affine form (``gguf_blocks.AffineBlocks``), laid out exactly like each layer's weight:
q/k/v stacked into ``qkv_proj``, gate/up into ``gate_up_proj``, this rank's tensor-parallel
shard, llama's q/k rows un-permuted, a tied LM head sharing the embedding's.

No model knowledge is repeated here: the blocks go through the model's own
``load_weights`` and weight loaders, three times (codes, then scales, then minimums), with
every 2-D parameter temporarily replaced by a stand-in of the shape that part has (codes:
the weight's shape; scales and minimums: one column per 32). Every step on the way copies
whole rows or block-aligned column slices, so each stand-in ends up holding its layer's
blocks. Layers where that does not hold are left out, never approximated:

- a layer fed by a tensor without an affine form (e.g. v_proj in Q6_K next to q/k in
  Q4_K): its scales keep the NaN they start with;
- a layer whose blocks do not dequantize to exactly the float weight it was loaded with
  (a ``load_weights`` that does more than copy), or whose input width is not a multiple
  of 32.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Literal

import torch
from torch import nn

from pagedlm.model_executor.layers.linear_base import LinearBase
from pagedlm.model_executor.loader.gguf_blocks import GROUP_SIZE, AffineBlocks, decode_blocks
from pagedlm.model_executor.loader.gguf_loader import iter_gguf_entries
from pagedlm.model_executor.loader.gguf_reader import read_gguf_header, read_gguf_raw
from pagedlm.model_executor.loader.weight_utils import get_weight_loader, set_weight_loader

logger = logging.getLogger(__name__)

Part = Literal["codes", "scales", "mins"]
_PARTS: tuple[Part, ...] = ("codes", "scales", "mins")


def _iter_blocks(path: str, model: nn.Module) -> Iterator[tuple[str, AffineBlocks]]:
    """(HF name, affine blocks in HF row order) for each 2-D tensor that has an affine form."""
    header = read_gguf_header(path)
    with open(path, "rb", buffering=0) as file:
        for name, info, fix_rows in iter_gguf_entries(header, model.arch):
            if len(info.shape) != 2 or info.shape[1] % GROUP_SIZE:
                continue
            raw, type_name = read_gguf_raw(file, info, path)
            blocks = decode_blocks(raw, type_name, info.shape)
            if blocks is not None:
                yield name, AffineBlocks(*(fix_rows(getattr(blocks, p)) for p in _PARTS))


def _stand_in(weight: torch.Tensor, part: Part) -> torch.Tensor | None:
    rows, cols = weight.shape
    if part == "codes":
        return torch.zeros(rows, cols, dtype=torch.uint8)
    if cols % GROUP_SIZE:
        return None
    return torch.full((rows, cols // GROUP_SIZE), float("nan"), dtype=torch.float32)


@contextmanager
def _stand_ins(model: nn.Module, part: Part) -> Iterator[dict[int, torch.Tensor]]:
    """Every 2-D parameter replaced (in every module holding it) by a stand-in for ``part``;
    yields ``{id(original parameter): stand-in data}`` and puts the originals back."""
    holders: list[tuple[nn.Module, str, nn.Parameter]] = []
    replacements: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for attr, param in list(module.named_parameters(recurse=False)):
            if param.dim() != 2:
                continue
            if id(param) not in replacements:
                data = _stand_in(param, part)
                if data is None:
                    continue
                replacement = nn.Parameter(data, requires_grad=False)
                set_weight_loader(replacement, get_weight_loader(param))
                replacements[id(param)] = replacement
            holders.append((module, attr, param))
            setattr(module, attr, replacements[id(param)])
    try:
        yield {key: value.data for key, value in replacements.items()}
    finally:
        for module, attr, param in holders:
            setattr(module, attr, param)


def gguf_linear_blocks(model: nn.Module, path: str) -> dict[str, AffineBlocks]:
    """Module name -> its weight's blocks, for every ``LinearBase`` whose whole weight came
    from affine-form tensors of the GGUF file ``path`` (the model loaded from it)."""
    linears = {
        name: module
        for name, module in model.named_modules()
        if isinstance(module, LinearBase) and module.weight.dim() == 2
    }
    # Decoded once (about 1.1 bytes per weight), then routed part by part.
    decoded = list(_iter_blocks(path, model))
    parts: dict[Part, dict[int, torch.Tensor]] = {}
    with torch.no_grad():
        for part in _PARTS:
            with _stand_ins(model, part) as filled:
                model.load_weights((name, getattr(blocks, part)) for name, blocks in decoded)
            parts[part] = filled
    del decoded
    found: dict[str, AffineBlocks] = {}
    for name, module in linears.items():
        key = id(module.weight)
        if any(key not in parts[part] for part in _PARTS):
            continue
        blocks = AffineBlocks(*(parts[part][key] for part in _PARTS))
        if torch.isnan(blocks.scales).any():
            continue  # some rows came from a tensor without an affine form
        weight = module.weight
        # Checked where the weight lives (the GPU dequantizes an 8B model in moments).
        on_device = AffineBlocks(*(getattr(blocks, p).to(weight.device) for p in _PARTS))
        if not torch.equal(on_device.dequantize().to(weight.dtype), weight):
            logger.warning(
                "%s: the GGUF blocks do not reproduce the loaded weight; it stays dense.", name
            )
            continue
        found[name] = blocks
    return found


__all__ = ["gguf_linear_blocks"]
