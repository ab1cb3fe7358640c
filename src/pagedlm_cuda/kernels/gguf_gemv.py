"""GGUF weights kept quantized on the GPU: their device layout, the tile dequantizer every
GGUF kernel shares, and the batch-1 GEMV.

A layer's weight ``w[r, c] = scale[r, c // 32] * code[r, c] + min[r, c // 32]`` (the loader's
affine form, ``gguf_blocks.AffineBlocks``) is stored as ``PackedGguf``:

- codes below 16 (Q4_0, Q4_1, Q4_K) two per byte, ``[N, K / 2]``: byte ``j`` holds column
  ``2j`` in its low nibble and ``2j + 1`` in its high one (0.5 byte per weight); wider codes
  (Q5_*, Q8_0) one per byte, ``[N, K]``;
- scales ``[N, K / 32]`` in float16 where every one is exact in float16 (the legacy types'
  ``d`` is a float16), else float32 (the K-quants' ``d * sub_scale`` needs 17 bits);
- minimums the same way, or none where each is ``-offset * scale`` (Q4_0: 8, Q5_0: 16,
  Q8_0: 128): the kernel then computes ``(code - offset) * scale``.

Q4_0 thus reads 0.5625 byte per weight (the file's own size), Q4_1 0.625 and Q4_K 0.75,
against 2 for bf16. Dequantized values equal the float32 ones exactly (same products and
one rounding, as in ``AffineBlocks.dequantize``); kernels accumulate in float32.

The GEMV gives each program ``BLOCK_N`` whole rows, streams them in ``BLOCK_K`` slices
(whole groups of 32), dequantizes each slice in registers and accumulates
``w * x`` per column as the bf16 GEMV does, summing once at the end. Per weight that is
a nibble extraction, an integer-to-float conversion and two FMAs, and the arithmetic, not
the bandwidth, bounds it: measured on the H200 (session 14, ``tests/cuda/bench_gemv.py
--kinds gguf4 --sweep`` and a side-by-side of loaders), llama-3-8b's Q4_0 projections
take 10.4-184 us at batch 1 with the default tiles, 21-37% of 4.8 TB/s, 0.85-1.25x the
bf16 GEMV's speed for 3.5x fewer bytes. Pipelining the slice loop (three slices in
flight) took o from 14.6 to 10.4 us and down from 45.7 to 32.4. Building the floats from the codes'
bits instead of converting them (int32 words, ``0x4B000000 | code`` less 2^23) was
slower (o 10.0-21.5 us, down 28.8-69.7): the reshapes from words to columns cost more
than the conversions they save. What is left to try: float16 tiles into ``tl.dot``, or
int8 activations and integer dot products as llama.cpp's CUDA kernels do.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pagedlm_cuda.kernels import pdl
from pagedlm_cuda.kernels.gemv import GemvConfig, gemv_config

GROUP_SIZE = 32


@dataclass(frozen=True)
class PackedGguf:
    """One layer's GGUF weight on the device (see the module docstring)."""

    codes: torch.Tensor
    """uint8 [N, K / 2] (bits 4) or [N, K] (bits 8)."""
    scales: torch.Tensor
    """float16 or float32 [N, K / 32]."""
    mins: torch.Tensor | None
    """Like ``scales``, or None: each minimum is ``-offset * scale``."""
    offset: int
    bits: int
    in_features: int

    @property
    def out_features(self) -> int:
        return self.codes.shape[0]

    def nbytes(self) -> int:
        tensors = [self.codes, self.scales] + ([self.mins] if self.mins is not None else [])
        return sum(t.numel() * t.element_size() for t in tensors)


def _exact_in_half(values: torch.Tensor) -> bool:
    return bool(torch.equal(values.half().float(), values))


def pack_blocks(
    codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, device: torch.device
) -> PackedGguf:
    """The device layout of an affine tensor: codes uint8 [N, K], scales and mins float32
    [N, K / 32] (``AffineBlocks``' fields)."""
    cols = codes.shape[1]
    if cols % GROUP_SIZE:
        raise ValueError(f"GGUF weights need K a multiple of {GROUP_SIZE}; got {cols}.")
    bits = 4 if int(codes.max()) < 16 else 8
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4) if bits == 4 else codes
    offset = next((o for o in (8, 16, 128) if torch.equal(mins, -o * scales)), 0)
    stored_mins = None if offset else mins
    exact = _exact_in_half(scales) and (stored_mins is None or _exact_in_half(stored_mins))
    dtype = torch.float16 if exact else torch.float32
    return PackedGguf(
        codes=packed.contiguous().to(device),
        scales=scales.to(device, dtype).contiguous(),
        mins=None if stored_mins is None else stored_mins.to(device, dtype).contiguous(),
        offset=offset,
        bits=bits,
        in_features=cols,
    )


@triton.jit
def load_weight_tile(
    codes_ptr, scales_ptr, mins_ptr, rows, row_mask, k0, K, stride_codes, stride_groups,
    OFFSET: tl.constexpr, BITS: tl.constexpr, HAS_MINS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """float32 [BLOCK_N, BLOCK_K]: rows ``rows`` (masked by ``row_mask``), columns
    ``k0 ..`` of the weight (zeros past K); ``k0`` and ``BLOCK_K`` are multiples of 32."""
    GROUPS: tl.constexpr = BLOCK_K // 32
    row_offsets = rows[:, None].to(tl.int64)
    if BITS == 4:
        half = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        mask = row_mask[:, None] & (half[None, :] < K // 2)
        packed = tl.load(codes_ptr + row_offsets * stride_codes + half[None, :], mask=mask, other=0)
        low = (packed & 0xF).to(tl.float32)
        high = (packed >> 4).to(tl.float32)
        codes = tl.reshape(tl.join(low, high), (BLOCK_N, BLOCK_K))
    else:
        cols = k0 + tl.arange(0, BLOCK_K)
        mask = row_mask[:, None] & (cols[None, :] < K)
        codes = tl.load(codes_ptr + row_offsets * stride_codes + cols[None, :], mask=mask, other=0)
        codes = codes.to(tl.float32)
    groups = k0 // 32 + tl.arange(0, GROUPS)
    group_mask = row_mask[:, None] & (groups[None, :] < K // 32)
    group_offsets = row_offsets * stride_groups + groups[None, :]
    scales = tl.load(scales_ptr + group_offsets, mask=group_mask, other=0.0).to(tl.float32)
    if HAS_MINS:
        mins = tl.load(mins_ptr + group_offsets, mask=group_mask, other=0.0).to(tl.float32)
    else:
        mins = scales * -OFFSET  # exact: OFFSET is a power of two
    # One FMA per weight: at 4 bits the GEMV's arithmetic per byte read is what bounds it.
    codes = tl.reshape(codes, (BLOCK_N, GROUPS, 32))
    weights = codes * scales[:, :, None] + mins[:, :, None]
    return tl.reshape(weights, (BLOCK_N, BLOCK_K))


@triton.jit
def _gguf_gemv_kernel(
    x_ptr, codes_ptr, scales_ptr, mins_ptr, bias_ptr, out_ptr, N, K,
    stride_codes, stride_groups,
    OFFSET: tl.constexpr, BITS: tl.constexpr, HAS_MINS: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PIPELINE: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    pdl.allow_next(USE_PDL)
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    cols = tl.arange(0, BLOCK_K)
    # Weights never change: the first slice is read before waiting for x's producer.
    w = load_weight_tile(
        codes_ptr, scales_ptr, mins_ptr, rows, row_mask, 0, K, stride_codes, stride_groups,
        OFFSET, BITS, HAS_MINS, BLOCK_N, BLOCK_K,
    )  # fmt: skip
    pdl.wait_for_previous(USE_PDL)
    x = tl.load(x_ptr + cols, mask=cols < K, other=0.0).to(tl.float32)
    acc = w * x[None, :]
    # PIPELINE > 1 keeps that many slices in flight (as in ``gemv``).
    for k0 in tl.range(BLOCK_K, K, BLOCK_K, num_stages=PIPELINE):
        w = load_weight_tile(
            codes_ptr, scales_ptr, mins_ptr, rows, row_mask, k0, K, stride_codes,
            stride_groups, OFFSET, BITS, HAS_MINS, BLOCK_N, BLOCK_K,
        )  # fmt: skip
        x = tl.load(x_ptr + k0 + cols, mask=k0 + cols < K, other=0.0).to(tl.float32)
        acc += w * x[None, :]
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += tl.load(bias_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + rows, y.to(out_ptr.dtype.element_ty), mask=row_mask)


def default_gemv_config(weight: PackedGguf) -> GemvConfig:
    """``gemv.gemv_config`` for the weight's kind (``gguf4`` / ``gguf8``): 16 x 512
    tiles with three slices in flight (the H200 sweep's fastest or within 4%)."""
    kind = "gguf4" if weight.bits == 4 else "gguf8"
    return gemv_config(weight.out_features, weight.in_features, kind)


def gguf_gemv(
    x: torch.Tensor,
    weight: PackedGguf,
    bias: torch.Tensor | None = None,
    config: GemvConfig | tuple[int, ...] | None = None,
) -> torch.Tensor:
    """x [1, K] (unit-stride row) -> [1, N] in x's dtype. ``config``: (block_n, block_k,
    num_warps[, pipeline_stages]) with ``block_k`` a multiple of 32."""
    if x.dim() != 2 or x.shape[0] != 1 or x.stride(1) != 1:
        raise ValueError(f"gguf_gemv takes one unit-stride row [1, K]; got {tuple(x.shape)}.")
    n, k = weight.out_features, weight.in_features
    if x.shape[1] != k:
        raise ValueError(f"x has {x.shape[1]} features but the weight is [{n}, {k}].")
    cfg = GemvConfig(*config) if config is not None else default_gemv_config(weight)
    if cfg.block_k % GROUP_SIZE:
        raise ValueError(f"gguf_gemv streams whole groups of {GROUP_SIZE} columns; got {cfg}.")
    out = torch.empty((1, n), dtype=x.dtype, device=x.device)
    mins = weight.mins if weight.mins is not None else weight.scales
    _gguf_gemv_kernel[(triton.cdiv(n, cfg.block_n),)](
        x, weight.codes, weight.scales, mins, bias if bias is not None else weight.scales,
        out, n, k, weight.codes.stride(0), weight.scales.stride(0),
        OFFSET=weight.offset, BITS=weight.bits, HAS_MINS=weight.mins is not None,
        HAS_BIAS=bias is not None, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        PIPELINE=cfg.pipeline_stages, num_warps=cfg.num_warps,
        num_stages=cfg.pipeline_stages, **pdl.launch_options(),
    )  # fmt: skip
    return out
