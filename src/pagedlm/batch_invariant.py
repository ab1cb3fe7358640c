"""Batch-invariant mode: a request's logits do not depend on what else is in its step.

``batch_invariant=True`` (``--batch-invariant``, or vLLM's ``VLLM_BATCH_INVARIANT=1``)
makes every token's result a function of that token's own inputs: the same request gives
bitwise the same logits alone, in a batch of 256, or with its prompt cut into any chunks.
Four places decide a row's reduction order, and each is pinned:

- GEMMs. A BLAS picks its blocking, and so the order in which it sums over K, from the
  matrix shapes: a row multiplied in a batch of 1 (often a GEMV) and in a batch of 300
  sums differently (seen on CPU: float32 ``F.linear`` rows at M = 1 or 2, where MKL
  takes its GEMV path, differ from the same rows at M = 300).
  ``RowTiledLinear`` feeds the layer's kernel only tiles of exactly ``ROW_TILE`` rows
  (zero-padded), so the kernel always sees one shape; GEMMs never mix rows, so a row's
  bits depend on its own values only. It wraps whatever kernel the platform installed
  (``LinearBase.set_kernel``), the LM head included, without touching the models.
- Attention. The backend's ``set_batch_invariant(True)`` (``AttentionBackend``): CPU
  runs every query token in its own call over exactly its keys; the Triton backend runs
  every token through the decode kernel with one fixed split, so a token computed in a
  prefill chunk and as a decode reduces in the same order.
- MoE experts. An expert's GEMM gets the rows of the tokens that chose it, as many as the
  batch sends; in the mode it gets them in tiles of ``ROW_TILE`` rows
  (``FusedMoE.row_tile``), and a platform's expert kernel uses one tiling whatever the
  batch and sums a token's top-k contributions in slot order. Each token adds its
  experts' outputs in a fixed order (expert id or slot), never in an order the batch sets.
- Norms, rotary, activations and the sampler are row-wise already (one row's reduction
  never spans rows, and a seeded request samples from its own generator).

The cost is the padding and the per-tile launches (``pagedlm bench``: see
``benchmarks/batch_invariant.py``). LoRA deltas are not covered.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from pagedlm.model_executor.layers.row_tiles import in_row_tiles

if TYPE_CHECKING:
    from pagedlm.model_executor.layers.linear_base import LinearBase, LinearKernel

BATCH_INVARIANT_ENV = ("VLLM_BATCH_INVARIANT", "PAGEDLM_BATCH_INVARIANT")
"""Environment switches of the mode: vLLM's spelling and ours ("1" turns it on)."""

ROW_TILE = 64
"""Rows per GEMM call in the mode: small enough that a decode of one request pays for few
padded rows, large enough that a batch of 256 makes only four calls per layer."""


def batch_invariant_from_env() -> bool:
    return any(os.environ.get(name, "0").lower() in ("1", "true") for name in BATCH_INVARIANT_ENV)


class RowTiledLinear:
    """``x W^T + b`` through ``kernel`` in tiles of exactly ``ROW_TILE`` rows.

    Invariant: every call of ``kernel`` gets a contiguous [ROW_TILE, in_features] tensor,
    so its blocking (and each output row's summation order) is the same for every batch.
    """

    def __init__(self, layer: LinearBase, tile: int = ROW_TILE) -> None:
        self.layer = layer
        self.inner: LinearKernel | None = layer.kernel
        self.tile = tile

    def _apply(self, x: torch.Tensor) -> torch.Tensor:
        if self.inner is not None:
            return self.inner(x)
        return F.linear(x, self.layer.weight, self.layer.linear_bias)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2:  # [..., in_features]: tile the flattened rows
            return self(x.reshape(-1, x.shape[-1])).view(*x.shape[:-1], -1)
        return in_row_tiles(self._apply, x, self.tile)


def make_batch_invariant(model: nn.Module, tile: int = ROW_TILE) -> int:
    """Route every linear layer of ``model`` through ``RowTiledLinear``, and every MoE
    layer's experts through tiles of ``tile`` rows (``FusedMoE.row_tile``), after the
    platform's ``prepare_model``, before LoRA; returns how many layers were changed."""
    from pagedlm.model_executor.layers.linear_base import LinearBase
    from pagedlm.model_executor.layers.moe import FusedMoE

    count = 0
    for module in model.modules():
        if isinstance(module, LinearBase) and not isinstance(module.kernel, RowTiledLinear):
            module.set_kernel(RowTiledLinear(module, tile))
            count += 1
        elif isinstance(module, FusedMoE) and module.row_tile != tile:
            module.row_tile = tile
            count += 1
    return count
