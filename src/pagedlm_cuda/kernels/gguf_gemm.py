"""GGUF weights at batches above 1: a GEMM that dequantizes its weight tiles in registers,
and a dequantizing kernel for the large-batch path.

``gguf_gemm``: ``x [M, K] @ W^T`` with ``W`` a ``PackedGguf``. Each program computes a
``[BLOCK_M, BLOCK_N]`` output tile; per ``BLOCK_K`` slice it dequantizes the weight tile
(``load_weight_tile``: the codes are read once per M-tile, 0.5-1 byte per weight), casts it
to x's dtype and multiplies on the tensor cores with a float32 accumulator.

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

from pagedlm_cuda.kernels import pdl
from pagedlm_cuda.kernels.gguf_gemv import PackedGguf, load_weight_tile


@triton.jit
def _gguf_gemm_kernel(
    x_ptr, codes_ptr, scales_ptr, mins_ptr, bias_ptr, out_ptr, M, N, K,
    stride_x, stride_out, stride_codes, stride_groups,
    OFFSET: tl.constexpr, BITS: tl.constexpr, HAS_MINS: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    pdl.allow_next(USE_PDL)
    tokens = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    token_mask, row_mask = tokens < M, rows < N
    cols = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + tokens[:, None].to(tl.int64) * stride_x
    pdl.wait_for_previous(USE_PDL)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = k0 + cols < K
        x = tl.load(
            x_rows + k0 + cols[None, :], mask=token_mask[:, None] & k_mask[None, :], other=0.0
        )
        w = load_weight_tile(
            codes_ptr, scales_ptr, mins_ptr, rows, row_mask, k0, K, stride_codes,
            stride_groups, OFFSET, BITS, HAS_MINS, BLOCK_N, BLOCK_K,
        )  # fmt: skip
        acc = tl.dot(x, tl.trans(w.to(x.dtype)), acc)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + tokens[:, None].to(tl.int64) * stride_out + rows[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=token_mask[:, None] & row_mask[None, :])


GemmConfig = tuple[int, int, int, int, int]
"""(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages)."""


def default_gemm_config(m: int) -> GemmConfig:
    """A first guess, not yet swept on the H200: one M-tile covers small decode batches so
    each weight tile is read once."""
    if m <= 16:
        return 16, 64, 128, 4, 4
    if m <= 32:
        return 32, 64, 128, 4, 4
    return 64, 128, 64, 8, 3


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
    mins = weight.mins if weight.mins is not None else weight.scales
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _gguf_gemm_kernel[grid](
        x, weight.codes, weight.scales, mins, bias if bias is not None else weight.scales,
        out, m, n, k, x.stride(0), out.stride(0), weight.codes.stride(0),
        weight.scales.stride(0), OFFSET=weight.offset, BITS=weight.bits,
        HAS_MINS=weight.mins is not None, HAS_BIAS=bias is not None, BLOCK_M=block_m,
        BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps, num_stages=num_stages,
        **pdl.launch_options(),
    )  # fmt: skip
    return out


@triton.jit
def _dequantize_kernel(
    codes_ptr, scales_ptr, mins_ptr, out_ptr, N, K, stride_codes, stride_groups,
    OFFSET: tl.constexpr, BITS: tl.constexpr, HAS_MINS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    pdl.allow_next(USE_PDL)
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K
    row_mask = rows < N
    cols = k0 + tl.arange(0, BLOCK_K)
    w = load_weight_tile(
        codes_ptr, scales_ptr, mins_ptr, rows, row_mask, k0, K, stride_codes, stride_groups,
        OFFSET, BITS, HAS_MINS, BLOCK_N, BLOCK_K,
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
        HAS_MINS=weight.mins is not None, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4,
        **pdl.launch_options(),
    )  # fmt: skip
    return dense
