"""``y = x W^T + b`` for one row of ``x``: the decode step of a single sequence.

At batch 1 every linear layer is a matrix-vector product that only streams its weight, so
its speed is the memory bandwidth it reaches. cuBLAS picks split-K GEMM tiles for these
shapes and stays near 3.1 TB/s on the smaller ones (llama-3-8b's q/k/v and o projections,
plus a separate split-K reduction kernel); this kernel gives each program ``BLOCK_N``
whole rows of ``W``, streams them in ``BLOCK_K`` slices through a deep pipeline and
reduces in registers, with no second pass. Measured on the H200 (bf16, weights rotated to
defeat the L2, from a CUDA graph): q/k/v 4096x6144 14.2 us against cuBLAS's 16.0, o
4096x4096 10.1 against 12.7, gate/up 4096x28672 54.3 against 55.0 (4.3 TB/s), down
14336x4096 28.8 against 30.5, LM head 4096x128256 231 against 239. In the llama-3-8b
decode step (W2) the linear layers went from 3.97 to 3.76 ms per token.

Accumulation is float32 in a fixed order that depends only on the shapes, so a row's
result does not depend on anything else in the step.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedlm_cuda.kernels import pdl


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, scale_ptr, bias_ptr, out_ptr, N, K, stride_w,
    HAS_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    pdl.allow_next(USE_PDL)
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    w_rows = w_ptr + rows[:, None].to(tl.int64) * stride_w
    cols = tl.arange(0, BLOCK_K)
    # The first weight slice is read before waiting for the kernel that produces x:
    # weights never change, so this overlaps the previous kernel's tail.
    k_mask = cols < K
    w = tl.load(w_rows + cols[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
    if HAS_SCALE:  # quantized rows (FP8): w[r] stands for w[r] * scale[r]
        scale = tl.load(scale_ptr + rows, mask=row_mask, other=0.0)
    pdl.wait_for_previous(USE_PDL)
    x = tl.load(x_ptr + cols, mask=k_mask, other=0.0)
    acc = w.to(tl.float32) * x.to(tl.float32)[None, :]
    for k0 in range(BLOCK_K, K, BLOCK_K):
        k = k0 + cols
        k_mask = k < K
        w = tl.load(w_rows + k[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        x = tl.load(x_ptr + k, mask=k_mask, other=0.0)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    y = tl.sum(acc, axis=1)
    if HAS_SCALE:
        y *= scale
    if HAS_BIAS:
        y += tl.load(bias_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + rows, y.to(out_ptr.dtype.element_ty), mask=row_mask)


GemvConfig = tuple[int, int, int, int]
"""(BLOCK_N, BLOCK_K, num_warps, num_stages)."""


def gemv_config(n: int) -> GemvConfig:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages), from H200 sweeps of 4-32 rows x 128-1024
    columns x 4/8 warps x 3-6 stages (bf16): 16 rows per program throughout; the fewer
    programs a layer has, the wider each one's slices (1024 columns up to 4k outputs, 512
    up to 8k, 256 with 4 warps beyond, where many programs share each SM)."""
    if n <= 4096:
        return 16, 1024, 8, 4
    if n <= 8192:
        return 16, 512, 8, 4
    return 16, 256, 4, 4


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    weight_scale: torch.Tensor | None = None,
    config: GemvConfig | None = None,
) -> torch.Tensor:
    """x [1, K] (unit-stride row), weight [N, K] (unit-stride rows; any float dtype, FP8
    included, converted in registers), bias [N] or None, weight_scale float32 [N] (or
    [N, 1]) or None: row r's result times weight_scale[r] -> [1, N] in x's dtype."""
    if x.dim() != 2 or x.shape[0] != 1:
        raise ValueError(f"gemv takes one row, x of shape [1, K]; got {tuple(x.shape)}.")
    n, k = weight.shape
    if x.shape[1] != k:
        raise ValueError(f"x has {x.shape[1]} features but weight is [{n}, {k}].")
    if weight_scale is not None and weight_scale.numel() != n:
        raise ValueError(f"{weight_scale.numel()} weight scales for a weight of {n} rows.")
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("gemv needs unit-stride rows in x and weight.")
    out = torch.empty((1, n), dtype=x.dtype, device=x.device)
    block_n, block_k, num_warps, num_stages = config or gemv_config(n)
    unused = weight_scale if weight_scale is not None else weight
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x, weight, unused, bias if bias is not None else unused, out, n, k, weight.stride(0),
        HAS_SCALE=weight_scale is not None, HAS_BIAS=bias is not None, BLOCK_N=block_n,
        BLOCK_K=block_k, num_warps=num_warps, num_stages=num_stages, **pdl.launch_options(),
    )  # fmt: skip
    return out
