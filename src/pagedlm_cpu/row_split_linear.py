"""Quantized layers that switch to a dense copy of their weights for larger batches.

torch's int4 kernel (``quantized_linear.Int4Linear``) dequantizes every weight again for
each few rows of input, so its time grows with the rows: it is the fastest kernel for a
decode step of a few sequences, where reading the weights dominates, and among the slowest
from a handful of rows on, where arithmetic does. oneDNN on a prepacked dense copy of the
same weights costs almost the same from 1 to 32 rows. So a layer takes the int4 kernel
while ``rows * planes < dense_from_rows`` (two 4-bit planes, Q5_* and Q8_0 codes, double
the int4 kernel's work) and the copy from there on.

The copy's dtype is the platform's choice (``CpuPlatform._install_dense_copies``): bf16
where the model computes in bf16 and the CPU multiplies bf16 faster than float32 (AMX
tiles: 2.7x float32's rate at 32 rows; Zen 4's AVX512-BF16: 1.6x; half the bytes either
way: ``platform.has_fast_bf16_gemms``), else float32. Either is what the dequantized path
(``PAGEDLM_CPU_DEQUANTIZE_GGUF=1``) computes in that dtype, so the rows it serves match it
up to summation order. The crossover with the int4 kernel depends on the copy
(``DEFAULT_DENSE_FROM_ROWS``, measured on SmolLM2-135M's shapes with
``python -m pagedlm.benchmarks.cpu_linear_kernels``: docs/performance.md).

``install_dense_copies`` adds the copies only while those of all layers fit the memory
budget it is given, and otherwise none (the layers keep their own large-batch path). A
layer whose copy serves every row count the int4 layer would dequantize for releases the
int4 layer's one-byte codes: only the packed planes and the copy stay resident. The choice
depends on the row count alone, so a given batch always runs the same kernels.

The int8 kernels that are faster still at these batch sizes (``quantized.linear_dynamic``:
int8 weights per output row, activations quantized at run time) were measured and refused:
on SmolLM2 they move next-token logprobs by up to 1.9 (per-row activation scales) and 8.1
(per-tensor), against 0.18 for the int4 kernel (docs/performance.md).
"""

from __future__ import annotations

import torch
from torch import nn

from pagedlm.model_executor.layers.linear_base import LinearBase
from pagedlm.model_executor.loader.gguf_blocks import GROUP_SIZE, AffineBlocks
from pagedlm_cpu.linear import OneDnnLinear, onednn_available
from pagedlm_cpu.quantized_linear import DequantScratch, Int4Linear

DEFAULT_DENSE_FROM_ROWS = {torch.float32: 16, torch.bfloat16: 8}
"""Per copy dtype, ``rows * planes`` from which a quantized layer uses its copy (measured
crossovers: a float32 copy on oneDNN passes the int4 kernel between 8 and 16 rows of a
4-bit layer, a bf16 copy between 4 and 8 on AMX and at 4-6 on Zen 4; docs/performance.md)."""


class RowSplitLinear:
    """``x W^T + b`` for x [num_tokens, in_features] -> [num_tokens, out_features] in x's
    dtype: ``quantized`` below the threshold, ``dense`` (the copy, in ``dense_dtype``) at
    and above; the dense path computes in ``dense_dtype`` whatever x's dtype."""

    def __init__(
        self,
        quantized: Int4Linear,
        dense: OneDnnLinear,
        dense_from_rows: int,
        dense_dtype: torch.dtype = torch.float32,
    ) -> None:
        self.quantized = quantized
        self.dense = dense
        self.dense_dtype = dense_dtype
        # Per layer: the int4 kernel's work is proportional to rows * planes.
        self.dense_from_rows = max(1, -(-dense_from_rows // quantized.num_planes))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] < self.dense_from_rows:
            return self.quantized(x)
        if x.dtype == self.dense_dtype:
            return self.dense(x)
        return self.dense(x.to(self.dense_dtype)).to(x.dtype)


def dense_copy_bytes(model: nn.Module, dtype: torch.dtype = torch.float32) -> int:
    """Bytes the ``dtype`` copies of ``model``'s int4 layers would take."""
    element = torch.empty((), dtype=dtype).element_size()
    return sum(
        module.kernel.blocks.codes.numel() * element
        for module in model.modules()
        if isinstance(module, LinearBase) and isinstance(module.kernel, Int4Linear)
    )


def install_dense_copies(
    model: nn.Module,
    dense_from_rows: int,
    budget_bytes: int,
    dtype: torch.dtype = torch.float32,
) -> int:
    """Wrap every ``Int4Linear`` layer of ``model`` in a ``RowSplitLinear`` with a ``dtype``
    copy of its weights on oneDNN; returns how many layers got one (0 when the copies
    would exceed ``budget_bytes``, when ``dense_from_rows`` is 0, or without oneDNN)."""
    if dense_from_rows <= 0 or not onednn_available():
        return 0
    if dense_copy_bytes(model, dtype) > budget_bytes:
        return 0
    scratch = DequantScratch()
    count = 0
    for module in model.modules():
        if not isinstance(module, LinearBase) or not isinstance(module.kernel, Int4Linear):
            continue
        quantized = module.kernel
        bias = None if quantized.bias is None else quantized.bias.to(dtype)
        dense = OneDnnLinear(_dequantize(quantized.blocks, scratch).to(dtype), bias)
        layer = RowSplitLinear(quantized, dense, dense_from_rows, dtype)
        if layer.dense_from_rows - 1 <= quantized.max_rows:
            quantized.release_codes()  # its own dense path can no longer be reached
        module.set_kernel(layer)
        count += 1
    return count


def _dequantize(blocks: AffineBlocks, scratch: DequantScratch) -> torch.Tensor:
    """float32 [rows, cols], what ``blocks.dequantize()`` gives, in one pass into a buffer
    every layer reuses (the oneDNN reorder copies it): at load that halves the copies' time,
    most of which is memory traffic and first-touch page faults."""
    codes = blocks.codes
    rows, cols = codes.shape
    weight = scratch.take(codes.numel(), torch.float32).view(rows, -1, GROUP_SIZE)
    grouped_codes = codes.view(rows, -1, GROUP_SIZE)
    torch.addcmul(blocks.mins[..., None], grouped_codes, blocks.scales[..., None], out=weight)
    return weight.view(rows, cols)
