"""GGUF weights at batches above 1: a GEMM that dequantizes its weight tiles in registers,
and a dequantizing kernel for the large-batch path.

``gguf_gemm``: ``x [M, K] @ W^T`` with ``W`` a ``PackedGguf``. Each program computes a
``[BLOCK_M, BLOCK_N]`` output tile (the codes are read once per M-tile, 0.5-1 byte per
weight). Per ``BLOCK_K`` slice it loads the words of its rows, and per code slot turns
them into floats as the GEMV does (``slot_codes``: no conversion instruction), scales
them, casts them to x's dtype and multiplies them, on the tensor cores with a float32
accumulator, by the x columns that slot holds: one dot per slot, of the slice's words.
The weight tile is the dot's first operand (the output tile is built transposed), which
lets Triton feed it from registers without a round trip through shared memory.

In sm_90 SASS (session 16, an ahead-of-time compile; not yet timed): 8.9 loop
instructions per weight at 16 rows (16 x 64 x 128 tiles, 4 warps), where session 14's
tile loader spent 7.3 plus one quarter-rate ``I2F`` per weight; 7.7 at 32 rows (32 x 64 x
256). Taking the weight as the second operand instead cost 9.6 (a 16-bit store to shared
memory per weight).

Trade-off, to be measured on the H200 (``pagedlm.benchmarks.quantized_gpu --gemm-sweep``):
a decode batch of a few to a few dozen rows is bound by reading the weight, so the tiled
GEMM reading 4-bit codes beats dequantize + cuBLAS, which writes and reads a bf16 copy
(2 + 2 bytes per weight besides the codes). A long prompt chunk is bound by arithmetic,
where cuBLAS' tiles beat a Triton GEMM that also spends instructions dequantizing; there
``dequantize_into`` writes the layer's bf16 weight into a scratch buffer shared by all
layers (one layer runs at a time) and the caller runs ``F.linear``. The row count where
one overtakes the other is ``GgufCudaLinear.max_tiled_rows``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedlm_cuda.kernels import pdl, stage_fit
from pagedlm_cuda.kernels.gguf_gemv import (
    LANES,
    MAGIC,
    PackedGguf,
    load_groups,
    load_weight_tile,
    slot_codes,
)


@triton.jit(do_not_specialize=["M"])
def _gguf_gemm_kernel(
    x_ptr, codes_ptr, scales_ptr, mins_ptr, bias_ptr, out_ptr, M, N, K,
    stride_x, stride_out, stride_codes, stride_groups, magic,
    OFFSET: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr, HAS_MINS: tl.constexpr,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    pdl.allow_next(USE_PDL)
    PER_WORD: tl.constexpr = 32 // BITS
    SPAN: tl.constexpr = LANES * PER_WORD
    SLOTS_PER_SCALE: tl.constexpr = GROUP // LANES
    SCALES_PER_SPAN: tl.constexpr = PER_WORD // SLOTS_PER_SCALE
    BLOCK_W: tl.constexpr = BLOCK_G * LANES
    tokens = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    token_mask, row_mask = tokens < M, rows < N
    word_ids = tl.arange(0, BLOCK_W)
    lanes = word_ids % LANES
    x_rows = x_ptr + tokens[:, None].to(tl.int64) * stride_x
    row_words = codes_ptr + rows[:, None].to(tl.int64) * stride_codes
    row_groups = rows[:, None].to(tl.int64) * stride_groups
    n_groups = tl.cdiv(K, SPAN)
    pdl.wait_for_previous(USE_PDL)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)  # transposed: W is the A operand
    for g0 in range(0, n_groups, BLOCK_G):
        lane_groups = g0 + word_ids // LANES  # each word's lane group
        words = tl.load(
            row_words + g0 * LANES + word_ids[None, :],
            mask=row_mask[:, None] & (lane_groups < n_groups)[None, :],
            other=0,
        )
        for part in tl.static_range(SCALES_PER_SPAN):
            groups = lane_groups * SCALES_PER_SPAN + part
            group_mask = row_mask[:, None] & (groups < K // GROUP)[None, :]
            scale = load_groups(scales_ptr + row_groups + groups[None, :], group_mask, False)
            if HAS_MINS:
                low = load_groups(mins_ptr + row_groups + groups[None, :], group_mask, False)
            for j in tl.static_range(SLOTS_PER_SCALE):
                codes = slot_codes(words, magic, part * SLOTS_PER_SCALE + j, OFFSET, BITS)
                w = codes * scale
                if HAS_MINS:
                    w += low
                # The slot's columns: its dot sums over them, x read in the same order.
                cols = lane_groups * SPAN + 8 * (part * SLOTS_PER_SCALE + j) + lanes
                x = tl.load(
                    x_rows + cols[None, :], mask=token_mask[:, None] & (cols < K)[None, :],
                    other=0.0,
                )  # fmt: skip
                acc = tl.dot(w.to(x.dtype), tl.trans(x), acc)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)[:, None]
    out = out_ptr + tokens[None, :].to(tl.int64) * stride_out + rows[:, None]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & token_mask[None, :])


GemmConfig = tuple[int, int, int, int, int]
"""(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages)."""


def default_gemm_config(m: int) -> GemmConfig:
    """Not yet swept on a GPU: one M-tile covers small decode batches so each weight tile
    is read once; the tiles are those with the fewest loop instructions per weight in
    sm_90 SASS at the programs they leave llama-3-8b's projections (``BLOCK_K``: at least
    two lane groups, a power of two of them)."""
    if m <= 16:
        return 16, 64, 128, 4, 4
    if m <= 32:
        return 32, 64, 256, 4, 3
    return 64, 128, 128, 8, 3


def gguf_gemm(
    x: torch.Tensor,
    weight: PackedGguf,
    bias: torch.Tensor | None = None,
    config: GemmConfig | None = None,
) -> torch.Tensor:
    """x [M, K] (unit-stride rows; float16, bfloat16 or float32) -> [M, N] in x's dtype."""
    if x.dim() != 2 or x.stride(1) != 1 or x.shape[1] != weight.in_features:
        raise ValueError(
            f"gguf_gemm takes unit-stride rows x [M, {weight.in_features}]; got {tuple(x.shape)}."
        )
    m, n, k = x.shape[0], weight.out_features, weight.in_features
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    block_m, block_n, block_k, num_warps, num_stages = config or default_gemm_config(m)
    block_g = block_k // weight.span
    if block_k % weight.span or block_g < 2 or block_g & (block_g - 1):
        raise ValueError(
            f"gguf_gemm's BLOCK_K is a power of two of at least two {weight.span}-column "
            f"lane groups; got {block_k}."
        )
    mins = weight.mins if weight.mins is not None else weight.scales
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    # Group-16 layers with minimums (Q2_K) and float32 x need more shared memory per
    # stage than the defaults were sized for: fewer stages where the GPU has too little.
    key = (x.device, x.dtype, weight.bits, weight.group_size, weight.mins is not None,
           weight.scales.dtype, block_m, block_n, block_k, num_warps)  # fmt: skip
    stage_fit.launch(
        _gguf_gemm_kernel[grid], key, num_stages,
        x, weight.codes, weight.scales, mins, bias if bias is not None else weight.scales,
        out, m, n, k, x.stride(0), out.stride(0), weight.codes.stride(0),
        weight.scales.stride(0), MAGIC.value, OFFSET=weight.offset, BITS=weight.bits,
        GROUP=weight.group_size, HAS_MINS=weight.mins is not None, HAS_BIAS=bias is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_G=block_g, num_warps=num_warps,
        **pdl.launch_options(),
    )  # fmt: skip
    return out


@triton.jit
def _dequantize_kernel(
    codes_ptr, scales_ptr, mins_ptr, out_ptr, N, K, stride_codes, stride_groups,
    OFFSET: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr, HAS_MINS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    pdl.allow_next(USE_PDL)
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K
    row_mask = rows < N
    cols = k0 + tl.arange(0, BLOCK_K)
    w = load_weight_tile(
        codes_ptr, scales_ptr, mins_ptr, rows, row_mask, k0, K, stride_codes, stride_groups,
        OFFSET, BITS, GROUP, HAS_MINS, BLOCK_N, BLOCK_K,
    )  # fmt: skip
    # The scratch buffer may still be read by the previous layer's GEMM.
    pdl.wait_for_previous(USE_PDL)
    out = out_ptr + rows[:, None].to(tl.int64) * K + cols[None, :]
    tl.store(out, w.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & (cols[None, :] < K))


def dequantize_into(weight: PackedGguf, out: torch.Tensor) -> torch.Tensor:
    """Write the dense weight into ``out`` (contiguous, N * K elements or more, any float
    dtype); returns it as [N, K]."""
    n, k = weight.out_features, weight.in_features
    dense = out[: n * k].view(n, k)
    block_n, block_k = 32, 128
    mins = weight.mins if weight.mins is not None else weight.scales
    _dequantize_kernel[(triton.cdiv(n, block_n), triton.cdiv(k, block_k))](
        weight.codes, weight.scales, mins, dense, n, k, weight.codes.stride(0),
        weight.scales.stride(0), OFFSET=weight.offset, BITS=weight.bits,
        GROUP=weight.group_size, HAS_MINS=weight.mins is not None, BLOCK_N=block_n,
        BLOCK_K=block_k, num_warps=4,
        **pdl.launch_options(),
    )  # fmt: skip
    return dense
