"""One or two rows of a large layer through fbgemm's int8 kernel, activations kept exact.

At batch 1 a CPU decode step reads every weight once, so the LM head, the largest layer
(SmolLM2's tied Q8_0 table: 49,152 x 576), costs what its bytes cost. torch's int4 kernel
reads a Q8_0 table as two 4-bit planes and is bound by dequantizing them (3.3 ms a step on
one Zen 4 core, of ~17); fbgemm's int8 GEMM (``quantized.linear_dynamic``) reads one byte
per weight at memory speed (~1.1 ms). Its numerics are what kept it out: it rounds the
activations to 8 bits per tensor, which moved SmolLM2's logprobs by up to 0.77.

``Int8RowsLinear`` keeps the kernel and removes that rounding. Each row of x is scaled to
a peak of 63 and split into two integer levels, ``x ~ (c1 + c2 / 126) * peak / 63`` with
``c1, c2`` in [-63, 63]; both levels go through one call as rows of one input, beside a
row holding the endpoints -64 and 63. fbgemm picks its activation scale from the input's
range, which is then exactly one integer step (7-bit range, zero point 64), so it
quantizes every level exactly, and the int32 products are exact: the only activation
error left is the second level's rounding, ~6e-5 of the row's peak (bf16 rounds to 2e-3
of each value). ``fbgemm_is_exact`` checks that premise on this torch build once.

What remains is the weights' own rounding to int8 with one scale per output row (the
GGUF block scales are per 32 weights): on SmolLM2's LM head it moved prompt logprobs
against the float32 weights by at most 0.15, as rounding the same weights to bf16 does
(docs/performance.md, session 35). The kernel is used for one or two rows
(``MAX_ROWS``): at three rows and more, the levels make it as slow as oneDNN's bf16 GEMM.
"""

from __future__ import annotations

import functools
import warnings

import torch
from torch import nn

from pagedlm.model_executor.layers.vocab_embedding import ParallelLMHead
from pagedlm.model_executor.loader.gguf_blocks import AffineBlocks
from pagedlm_cpu.quantized_linear import Int4Linear

MAX_ROWS = 2
"""Rows of x up to which ``Int8RowsLinear`` serves a layer (measured on the LM head: 1.6 /
1.8 ms at one / two rows against 4.3 / 4.8 for a bf16 copy and 3.3 / 4.3 for two int4
planes; at three rows 3.6 against 4.6 and 5.3, at four no faster than the copy)."""

_LEVEL = 63
"""The largest code of either level: 7-bit inputs (``reduce_range``), zero point 64."""
_SECOND = 2 * _LEVEL
"""The second level's scale relative to the first: a remainder in [-0.5, 0.5] times
126 stays within [-63, 63]."""
_CHUNK_ROWS = 4096
"""Rows rounded to int8 at a time at load."""


def _quantized_ops_available() -> bool:
    ops = torch.ops.quantized
    return (
        "fbgemm" in torch.backends.quantized.supported_engines
        and hasattr(ops, "linear_dynamic")
        and hasattr(ops, "linear_prepack")
        and hasattr(torch, "_make_per_channel_quantized_tensor")
    )


def _prepack(codes: torch.Tensor, scales: torch.Tensor) -> object:
    """fbgemm's packed form of int8 ``codes`` [out, in] with one float scale per row."""
    engine = torch.backends.quantized.engine
    try:
        # The packing engine decides the kernel; torch's default ("x86") may pick oneDNN.
        torch.backends.quantized.engine = "fbgemm"
        with warnings.catch_warnings():
            # Quantized tensors are deprecated as a user-facing type; this one lives only
            # for the prepack call, which still takes it.
            warnings.simplefilter("ignore", UserWarning)
            weight = torch._make_per_channel_quantized_tensor(
                codes,
                scales.to(torch.float64),
                torch.zeros(codes.shape[0], dtype=torch.long),
                0,
            )
        return torch.ops.quantized.linear_prepack(weight, None)
    finally:
        torch.backends.quantized.engine = engine


@functools.cache
def fbgemm_is_exact() -> bool:
    """Whether fbgemm is here and multiplies on-grid inputs exactly as ``Int8RowsLinear``
    relies on (its input range read as one integer step per code, products in int32)."""
    if not _quantized_ops_available():
        return False
    generator = torch.Generator().manual_seed(0)
    codes = torch.randint(-127, 128, (48, 64), generator=generator, dtype=torch.int8)
    inputs = torch.randint(-_LEVEL, _LEVEL + 1, (3, 64), generator=generator).float()
    inputs[0] = _endpoints(64)
    try:
        packed = _prepack(codes, torch.ones(48))
        out = torch.ops.quantized.linear_dynamic(inputs, packed, True)
    except RuntimeError:
        return False
    return torch.equal(out, inputs @ codes.float().t())


@functools.cache
def _endpoints(cols: int) -> torch.Tensor:
    """[cols] the row that fixes fbgemm's input range to [-64, 63]: those two, then zeros."""
    row = torch.zeros(cols)
    row[0], row[1] = -_LEVEL - 1, _LEVEL
    return row


class Int8RowsLinear:
    """``x W^T + b`` for x [rows <= MAX_ROWS, in_features] (float32 or bf16) -> [rows,
    out_features] in x's dtype, with W rounded to int8 per output row and x split into two
    exact int8 levels (see the module's doc)."""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None):
        """``codes`` int8 [out, in] and ``scales`` [out]: ``W = codes * scales[:, None]``."""
        self.out_features, self.in_features = codes.shape
        self.packed = _prepack(codes, scales)
        self.bias = None if bias is None else bias.detach().float()
        self._inputs = torch.empty(1 + 2 * MAX_ROWS, self.in_features)
        self._inputs[0] = _endpoints(self.in_features)

    @classmethod
    def from_blocks(cls, blocks: AffineBlocks, bias: torch.Tensor | None) -> Int8RowsLinear:
        """The layer of GGUF ``blocks``, rounded to int8 per row ``_CHUNK_ROWS`` rows at a
        time (a float32 copy of a whole LM head would take 4 bytes per weight at load)."""
        rows, cols = blocks.codes.shape
        codes = torch.empty(rows, cols, dtype=torch.int8)
        scales = torch.empty(rows)
        for start in range(0, rows, _CHUNK_ROWS):
            part = slice(start, start + _CHUNK_ROWS)
            chunk = AffineBlocks(blocks.codes[part], blocks.scales[part], blocks.mins[part])
            weight = chunk.dequantize()
            scale = weight.abs().amax(dim=1).div_(127).clamp_min_(torch.finfo(torch.float32).tiny)
            codes[part] = weight.div_(scale[:, None]).round_().clamp_(-127, 127)
            scales[part] = scale
        return cls(codes, scales, bias)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if rows > MAX_ROWS:
            raise ValueError(f"Int8RowsLinear takes at most {MAX_ROWS} rows, got {rows}")
        x32 = x.float()
        peak = x32.abs().amax(dim=1, keepdim=True).clamp_min_(torch.finfo(torch.float32).tiny)
        units = torch.mul(x32, _LEVEL / peak)  # each row's peak at 63
        # Row 0 holds the endpoints (written once); then the first level, then the second.
        inputs = self._inputs[: 1 + 2 * rows]
        first = torch.round(units, out=inputs[1 : 1 + rows])
        torch.round(units.sub_(first).mul_(_SECOND), out=inputs[1 + rows :])
        out = torch.ops.quantized.linear_dynamic(inputs, self.packed, True)
        result = torch.add(out[1 : 1 + rows], out[1 + rows :], alpha=1.0 / _SECOND)
        result.mul_(peak / _LEVEL)
        if self.bias is not None:
            result.add_(self.bias)
        return result if result.dtype == x.dtype else result.to(x.dtype)


def install_int8_rows(model: nn.Module, budget_bytes: int | None = None) -> int:
    """Give the LM head of ``model`` an ``Int8RowsLinear`` for one or two rows where its
    int4 kernel reads two planes (a Q5_*/Q8_0 table); returns how many layers got one
    (0 where fbgemm is missing or not exact, or where the int8 copies, a byte per weight
    beside the planes, would exceed ``budget_bytes``).

    Only the LM head: it is where the bytes are (a third of SmolLM2's), and its rounding
    was measured on the logprobs it produces directly. Layers inside the model compound
    their errors through the rest of it and are small enough that fbgemm's fixed costs
    eat its gain (a 3,072 x 576 layer: 0.19 ms at one row against 0.21 for two int4
    planes, 0.10 for one)."""
    if not fbgemm_is_exact():
        return 0
    heads = [
        module.kernel
        for module in model.modules()
        if isinstance(module, ParallelLMHead)
        and isinstance(module.kernel, Int4Linear)
        and module.kernel.num_planes == 2
        and module.kernel.blocks is not None
    ]
    if budget_bytes is not None and sum(h.blocks.codes.numel() for h in heads) > budget_bytes:
        return 0
    for kernel in heads:
        kernel.serve_few_rows(Int8RowsLinear.from_blocks(kernel.blocks, kernel.bias), MAX_ROWS)
    return len(heads)
