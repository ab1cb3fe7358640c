"""Quantized layers that switch to a dense float32 copy of their weights for larger batches.

torch's int4 kernel (``quantized_linear.Int4Linear``) dequantizes every weight again for
each few rows of input, so its time grows with the rows: it is the fastest kernel for a
decode step of a few sequences, where reading the weights dominates, and among the slowest
from a dozen rows on, where arithmetic does. oneDNN on a prepacked float32 copy of the same
weights costs almost the same from 1 to 32 rows. Measured on SmolLM2-135M's shapes
(``python -m pagedlm.benchmarks.cpu_linear_kernels``, docs/performance.md): the two cross
between 8 and 16 rows of a 4-bit layer, and at half that for a layer of two 4-bit planes
(Q5_*, Q8_0), whose int4 work is doubled. So a layer takes the int4 kernel while
``rows * planes < dense_from_rows`` and the float32 copy from there on.

The copy is what the dequantized path computes (float32, bias included), so the rows it
serves match ``PAGEDLM_CPU_DEQUANTIZE_GGUF=1`` up to summation order. It costs 4 bytes per
weight and its packing at load; ``install_dense_copies`` adds it only while the copies of
all layers fit the memory budget it is given, and otherwise none (the layers keep their
own large-batch path). The choice depends on the row count alone, so a given batch always
runs the same kernels.

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

DEFAULT_DENSE_FROM_ROWS = 16
"""``rows * planes`` from which a quantized layer uses its float32 copy (measured crossover;
docs/performance.md)."""


class RowSplitLinear:
    """``x W^T + b`` for x [num_tokens, in_features] -> [num_tokens, out_features] in x's
    dtype: ``quantized`` below the threshold, ``dense`` (float32 weights) at and above.

    ``dense`` computes in float32 whatever x's dtype, as the dequantized path does.
    """

    def __init__(self, quantized: Int4Linear, dense: OneDnnLinear, dense_from_rows: int) -> None:
        self.quantized = quantized
        self.dense = dense
        # Per layer: the int4 kernel's work is proportional to rows * planes.
        self.dense_from_rows = max(1, -(-dense_from_rows // quantized.num_planes))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] < self.dense_from_rows:
            return self.quantized(x)
        if x.dtype == torch.float32:
            return self.dense(x)
        return self.dense(x.float()).to(x.dtype)


def dense_copy_bytes(model: nn.Module) -> int:
    """Bytes the float32 copies of ``model``'s int4 layers would take."""
    return sum(
        module.kernel.blocks.codes.numel() * 4
        for module in model.modules()
        if isinstance(module, LinearBase) and isinstance(module.kernel, Int4Linear)
    )


def install_dense_copies(model: nn.Module, dense_from_rows: int, budget_bytes: int) -> int:
    """Wrap every ``Int4Linear`` layer of ``model`` in a ``RowSplitLinear`` with a float32
    copy of its weights on oneDNN; returns how many layers got one (0 when the copies
    would exceed ``budget_bytes``, when ``dense_from_rows`` is 0, or without oneDNN)."""
    if dense_from_rows <= 0 or not onednn_available():
        return 0
    if dense_copy_bytes(model) > budget_bytes:
        return 0
    scratch = DequantScratch()
    count = 0
    for module in model.modules():
        if not isinstance(module, LinearBase) or not isinstance(module.kernel, Int4Linear):
            continue
        quantized = module.kernel
        bias = None if quantized.bias is None else quantized.bias.float()
        dense = OneDnnLinear(_dequantize(quantized.blocks, scratch), bias)
        module.set_kernel(RowSplitLinear(quantized, dense, dense_from_rows))
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
