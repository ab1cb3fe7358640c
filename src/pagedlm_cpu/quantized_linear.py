"""Linear layers that compute on the GGUF file's quantized weights, through torch's int4 kernel.

``torch.ops.aten._weight_int4pack_mm_for_cpu`` multiplies bf16 activations by 4-bit codes
dequantized on the fly as ``(code - 8) * scale + zero``, one bf16 (scale, zero) pair per 32
weights, accumulating in float32. A GGUF affine block (``scale * code + minimum``) maps onto
it exactly: ``zero = minimum + 8 * scale``. Codes wider than 4 bits (Q5_*, Q8_0) are split
into two 4-bit planes (``_planes``), multiplied as one matmul over the concatenated input
``[x, x]``. What differs from the float32 weights is the bf16 rounding of the
scales, zeros and activations, and of the output; the parity test bounds its effect on
logprobs.

The kernel re-dequantizes each weight for every 4 rows of input, so it wins where reading
weights dominates (decode batches) and loses where arithmetic does (long prompt chunks):
above ``max_rows`` rows the layer dequantizes its codes into a scratch buffer shared by all
layers and calls ``F.linear``. On AVX2 the kernel has a vectorized path for bf16 only, so
activations are cast to bf16 and back whatever the model's dtype.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from pagedlm.model_executor.layers.linear_base import LinearBase
from pagedlm.model_executor.loader.gguf_blocks import GROUP_SIZE, AffineBlocks
from pagedlm.model_executor.loader.weight_utils import one_intra_op_thread
from pagedlm_cpu.linear import release_weight, weight_uses

_KERNEL_DTYPE = torch.bfloat16
_N_MULTIPLE = 16
"""The int4 CPU layout packs output features in tiles of 16."""
DEFAULT_MAX_ROWS = 128
"""Input rows up to which the int4 kernel beats dequantize + F.linear (measured on AMD EPYC
AVX2 for SmolLM2-135M shapes: docs/performance.md)."""


INT4_MM = getattr(
    torch,
    "_weight_int4pack_mm_for_cpu",
    getattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu", None),
)
"""torch's int4 CPU matmul, through its direct binding where torch has one (1.9 us per call
at one row against 3.0 through ``torch.ops.aten``, session 30); None without the kernel."""


def int4_kernel_available() -> bool:
    return INT4_MM is not None


@dataclass
class DequantScratch:
    """One buffer the large-batch path dequantizes into, shared by a model's layers (one
    layer runs at a time, so one buffer of the largest layer's size suffices)."""

    buffer: torch.Tensor = field(default_factory=lambda: torch.empty(0))

    def take(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        if self.buffer.numel() < numel or self.buffer.dtype != dtype:
            self.buffer = torch.empty(numel, dtype=dtype)
        return self.buffer[:numel]


_PACK_ROWS = 1024
"""Rows converted to int32 and packed per call of torch's packing op: a bounded scratch
instead of 4 bytes per weight of the largest layer at once. The packed layout is made of
independent tiles of at most 64 output rows (16/32/64 by CPU capability), so packing a
multiple of 64 rows at a time gives the same bytes (``tests/cpu/test_quantized_linear.py``)."""


@dataclass(frozen=True)
class Int4Planes:
    """A layer in the kernel's ``(code - 8) * scale + zero`` form, as ``num_planes`` planes
    of 4-bit codes side by side along the input (the planes' sum is the weight).

    ``packed``: torch's int4 layout of ``[padded_rows, num_planes * cols]`` codes;
    ``scale_zeros``: bf16 ``[num_planes * cols / 32, padded_rows, 2]``.
    """

    packed: torch.Tensor
    scale_zeros: torch.Tensor
    num_planes: int


def _plane_codes(codes: torch.Tensor, offset: int) -> tuple[torch.Tensor, ...]:
    """4-bit codes of the planes of ``_plane_scales``: the codes themselves when ``offset``
    is 0 (they fit), else ``(high + 8, low)`` of ``code - offset = 16 * high + low``; with
    ``offset`` a multiple of 16 that is ``((code >> 4) + 8 - offset / 16, code & 15)``,
    computed on bytes."""
    if offset == 0:
        return (codes,)
    return (codes >> 4) + (8 - offset // 16), codes & 15


def _plane_scales(blocks: AffineBlocks, offset: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(scales, zeros) [rows, num_planes * cols / 32] of the planes.

    Wider codes are centred first (``q = code - offset``, ``offset = 2^(bits-1)``, so
    ``scale * q + centre`` with ``centre = minimum + offset * scale``) and split as
    ``q = 16 * high + low``: the high plane stores ``high + 8`` with ``16 * scale`` and
    zero 0, the low plane ``low`` with ``scale`` and the centre. Every zero is then of the
    order of the block's own values, so rounding it to bf16 costs about 2^-9 of them (an
    uncentred split would round zeros up to 16 times larger for Q5 codes).
    """
    scales, mins = blocks.scales, blocks.mins
    if offset == 0:
        return scales, mins + 8 * scales
    centre = mins + offset * scales
    return (
        torch.cat([scales * 16, scales], dim=1),
        torch.cat([torch.zeros_like(scales), centre + 8 * scales], dim=1),
    )


def pack_int4(blocks: AffineBlocks) -> Int4Planes:
    """The file's codes in the int4 kernel's layout, straight from the blocks (nothing is
    dequantized). Output rows are padded to a multiple of 16 with weights of exactly 0
    (code 8, scale 0, zero 0)."""
    codes = blocks.codes
    rows, cols = codes.shape
    max_code = int(codes.max())
    offset = 0 if max_code < 16 else 1 << (max_code.bit_length() - 1)
    num_planes = 1 if offset == 0 else 2
    padded = -(-rows // _N_MULTIPLE) * _N_MULTIPLE
    scratch = torch.empty(min(padded, _PACK_ROWS), num_planes * cols, dtype=torch.int32)
    packed = []
    for start in range(0, padded, _PACK_ROWS):
        stop = min(start + _PACK_ROWS, padded)
        chunk = scratch[: stop - start]
        filled = max(0, min(stop, rows) - start)
        for plane, plane_codes in enumerate(_plane_codes(codes[start : start + filled], offset)):
            chunk[:filled, plane * cols : (plane + 1) * cols].copy_(plane_codes)
        chunk[filled:].fill_(8)
        packed.append(torch.ops.aten._convert_weight_to_int4pack_for_cpu(chunk, 1))
    scales, zeros = _plane_scales(blocks, offset)
    pad = padded - rows
    if pad:
        scales, zeros = F.pad(scales, (0, 0, 0, pad)), F.pad(zeros, (0, 0, 0, pad))
    # [groups, out, 2]: the kernel reads the (scale, zero) pairs of one group contiguously.
    scale_zeros = torch.stack([scales, zeros], dim=-1).transpose(0, 1)
    return Int4Planes(
        packed=packed[0] if len(packed) == 1 else torch.cat(packed),
        scale_zeros=scale_zeros.to(_KERNEL_DTYPE).contiguous(),
        num_planes=num_planes,
    )


class Int4Linear:
    """``x W^T + b`` for x [num_tokens, in_features] (float32 or bf16) -> [num_tokens, out].

    Holds the int4-packed planes (0.5 byte per weight and plane, plus 4 bytes of scale and
    zero per 32 weights and plane) and, for the large-batch path, the codes (1 byte per
    weight) with float32 scales and minimums.
    """

    def __init__(
        self,
        blocks: AffineBlocks,
        bias: torch.Tensor | None,
        scratch: DequantScratch,
        max_rows: int = DEFAULT_MAX_ROWS,
    ) -> None:
        out_features = blocks.codes.shape[0]
        self.out_features = out_features
        self.blocks: AffineBlocks | None = blocks
        self.bias = None if bias is None else bias.detach()
        self.scratch = scratch
        self.max_rows = max_rows
        planes = pack_int4(blocks)
        self.num_planes = planes.num_planes
        self.packed = planes.packed
        self.scale_zeros = planes.scale_zeros
        self._few_rows: Callable[[torch.Tensor], torch.Tensor] | None = None
        self._few_rows_max = -1  # none

    def serve_few_rows(self, kernel: Callable[[torch.Tensor], torch.Tensor], max_rows: int) -> None:
        """Hand inputs of up to ``max_rows`` rows to ``kernel`` instead of the planes (an LM
        head's two planes on fbgemm's int8 GEMM: ``int8_rows.install_int8_rows``)."""
        self._few_rows, self._few_rows_max = kernel, max_rows

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] <= self._few_rows_max:
            return self._few_rows(x)  # type: ignore[misc]
        if x.shape[0] > self.max_rows:
            return self._dense(x)
        # No-op conversions skipped: each call costs microseconds, a decode step makes 121.
        inputs = x if x.dtype == _KERNEL_DTYPE else x.to(_KERNEL_DTYPE)
        inputs = inputs.contiguous()
        if self.num_planes == 2:
            inputs = torch.cat([inputs, inputs], dim=1)
        out = INT4_MM(inputs, self.packed, GROUP_SIZE, self.scale_zeros)
        if out.shape[1] != self.out_features:
            out = out[:, : self.out_features]
        if out.dtype != x.dtype:
            out = out.to(x.dtype)
        return out if self.bias is None else out + self.bias

    def release_codes(self) -> None:
        """Drop the one-byte codes the large-batch path dequantizes (a caller that never
        hands this layer more than ``max_rows`` rows, such as ``RowSplitLinear`` with a
        dense copy); the int4 planes stay. Larger inputs then raise."""
        self.blocks = None

    def _dense(self, x: torch.Tensor) -> torch.Tensor:
        if self.blocks is None:
            raise RuntimeError(
                f"this int4 layer released its codes: it takes at most {self.max_rows} rows"
            )
        codes, scales, mins = self.blocks.codes, self.blocks.scales, self.blocks.mins
        rows, cols = codes.shape
        weight = self.scratch.take(codes.numel(), x.dtype).view(rows, -1, GROUP_SIZE)
        grouped_codes = codes.view(rows, -1, GROUP_SIZE)
        torch.addcmul(mins[..., None], grouped_codes, scales[..., None], out=weight)
        return F.linear(x, weight.view(rows, cols), self.bias)


def install_int4_kernels(
    model: nn.Module, blocks_by_name: dict[str, AffineBlocks], max_rows: int = DEFAULT_MAX_ROWS
) -> int:
    """Give each named ``LinearBase`` of ``model`` an ``Int4Linear`` over its blocks;
    returns how many. Float weights are released as in ``prepack_linears``."""
    uses = weight_uses(model)
    scratch = DequantScratch()
    count = 0
    with one_intra_op_thread():  # packing is hundreds of small ops
        for name, module in model.named_modules():
            blocks = blocks_by_name.get(name)
            if blocks is None or not isinstance(module, LinearBase):
                continue
            module.set_kernel(Int4Linear(blocks, module.linear_bias, scratch, max_rows))
            release_weight(module, uses)
            count += 1
    return count
