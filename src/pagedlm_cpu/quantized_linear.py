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

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from pagedlm.model_executor.layers.linear_base import LinearBase
from pagedlm.model_executor.loader.gguf_blocks import GROUP_SIZE, AffineBlocks
from pagedlm_cpu.linear import release_weight, weight_uses

_KERNEL_DTYPE = torch.bfloat16
_N_MULTIPLE = 16
"""The int4 CPU layout packs output features in tiles of 16."""
DEFAULT_MAX_ROWS = 128
"""Input rows up to which the int4 kernel beats dequantize + F.linear (measured on AMD EPYC
AVX2 for SmolLM2-135M shapes: docs/performance.md)."""


def int4_kernel_available() -> bool:
    return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")


@dataclass
class DequantScratch:
    """One buffer the large-batch path dequantizes into, shared by a model's layers (one
    layer runs at a time, so one buffer of the largest layer's size suffices)."""

    buffer: torch.Tensor = field(default_factory=lambda: torch.empty(0))

    def take(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        if self.buffer.numel() < numel or self.buffer.dtype != dtype:
            self.buffer = torch.empty(numel, dtype=dtype)
        return self.buffer[:numel]


def _planes(blocks: AffineBlocks) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(4-bit codes, scales, zeros) in the kernel's ``(code - 8) * scale + zero`` form, one
    plane per 4 bits; the planes' sum is the weight.

    Wider codes are centred first (``q = code - 2^(bits-1)``, so ``scale * q + centre`` with
    ``centre = minimum + 2^(bits-1) * scale``) and split as ``q = 16 * high + low``: the high
    plane stores ``high + 8`` with ``16 * scale`` and zero 0, the low plane ``low`` with
    ``scale`` and the centre. Every zero is then of the order of the block's own values, so
    rounding it to bf16 costs about 2^-9 of them (an uncentred split would round zeros up
    to 16 times larger for Q5 codes).
    """
    codes, scales, mins = blocks.codes, blocks.scales, blocks.mins
    max_code = int(codes.max())
    if max_code < 16:
        return [(codes, scales, mins + 8 * scales)]
    offset = 1 << (max_code.bit_length() - 1)
    centred = codes.to(torch.int16) - offset
    high, low = centred >> 4, centred & 15  # floor division: high in [-8, 7], low in [0, 15]
    centre = mins + offset * scales
    return [
        ((high + 8).to(torch.uint8), scales * 16, torch.zeros_like(scales)),
        (low.to(torch.uint8), scales, centre + 8 * scales),
    ]


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
        self.blocks = blocks
        self.bias = None if bias is None else bias.detach()
        self.scratch = scratch
        self.max_rows = max_rows
        planes = _planes(blocks)
        self.num_planes = len(planes)
        padded = -(-out_features // _N_MULTIPLE) * _N_MULTIPLE
        pad = padded - out_features
        codes = torch.cat([c for c, _, _ in planes], dim=1).to(torch.int32)
        scales = torch.cat([s for _, s, _ in planes], dim=1)
        zeros = torch.cat([z for _, _, z in planes], dim=1)
        if pad:
            # Padding rows dequantize to exactly 0 (scale 0, zero 0); their outputs are cut.
            codes = F.pad(codes, (0, 0, 0, pad), value=8)
            scales, zeros = F.pad(scales, (0, 0, 0, pad)), F.pad(zeros, (0, 0, 0, pad))
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
        # [groups, out, 2]: the kernel reads the (scale, zero) pairs of one group contiguously.
        self.scale_zeros = torch.stack([scales, zeros], dim=-1).transpose(0, 1)
        self.scale_zeros = self.scale_zeros.to(_KERNEL_DTYPE).contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > self.max_rows:
            return self._dense(x)
        # No-op conversions skipped: each call costs microseconds, a decode step makes 121.
        inputs = x if x.dtype == _KERNEL_DTYPE else x.to(_KERNEL_DTYPE)
        inputs = inputs.contiguous()
        if self.num_planes == 2:
            inputs = torch.cat([inputs, inputs], dim=1)
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(
            inputs, self.packed, GROUP_SIZE, self.scale_zeros
        )
        if out.shape[1] != self.out_features:
            out = out[:, : self.out_features]
        if out.dtype != x.dtype:
            out = out.to(x.dtype)
        return out if self.bias is None else out + self.bias

    def _dense(self, x: torch.Tensor) -> torch.Tensor:
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
    for name, module in model.named_modules():
        blocks = blocks_by_name.get(name)
        if blocks is None or not isinstance(module, LinearBase):
            continue
        module.set_kernel(Int4Linear(blocks, module.linear_bias, scratch, max_rows))
        release_weight(module, uses)
        count += 1
    return count
