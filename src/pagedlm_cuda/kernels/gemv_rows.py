"""``y = x W^T + b`` for a few rows of ``x`` (2 to 16) on the tensor cores: a speculative
verification step (``1 + k`` rows per request) or a short prefill chunk.

At a handful of rows a linear layer still only streams its weight, but cuBLAS serves
these shapes with the tiles it uses at one row and takes its one-row time, slower than
``gemv.py``. One float32 accumulator per row on the CUDA cores (one FMA per weight per
row) was tried and is issue-bound from three rows on. Here the operands are swapped: each
program owns ``BLOCK_N`` rows of ``W``, streams them in ``BLOCK_K`` slices and multiplies
each slice by the rows of ``x`` padded with zeros to 16 (masked loads, never read), as
``tl.dot(w_slice [BLOCK_N, BLOCK_K], x_slice^T [BLOCK_K, 16])`` into a float32
``[BLOCK_N, 16]`` accumulator. The weight is read once whatever the row count and the
multiply-adds go to the tensor cores, so the kernel costs about what one row does.

Accumulation is float32 in an order fixed by the shapes (the tile configuration depends
on the output features only), and padded rows are zeros, so a row's result depends on
its own values only: the same at 2 rows as at 16, in a CUDA graph as eagerly. It differs
in the last bits from both ``gemv`` and ``F.linear``.

**Unmeasured on a GPU** (written in session 13, which had no device time): it is off by
default (``fused_layers.GEMV_ROWS_MAX`` = 1; ``PAGEDLM_GEMV_ROWS_MAX=8`` routes 2-8 rows
here) and ``gemv_rows_config`` is a starting point, not a sweep's result. What decides
the default, on the H200:

    python tests/cuda/bench_gemv_rows.py --sweep --rows 1 2 3 5 8 16 --sweep-rows 5 8
    PAGEDLM_GEMV_ROWS_MAX=8 python -m pagedlm.benchmarks.spec_acceptance \
        --targets acceptance --cases 1.0:4 --output-json spec.json

(the first: cuBLAS, the one-row GEMV and this kernel per Llama-3-8B projection from CUDA
graphs, weights rotated past the L2, then the best tiles per projection; the second: the
A = 1.0, k = 4 speedup, 3.44x with cuBLAS in session 12, to be compared with the same
command without the variable). Expected: about the one-row GEMV's time at every row
count up to 8 (the weight bytes are the same; each program also reads its x rows from the
L2, 5/16 of its weight bytes at 5 rows and ``BLOCK_N`` = 16, less with wider tiles), so
~0.3 of the ~0.39 ms per verification step that the session-12 figures put between cuBLAS
at 5 rows and the one-row GEMV, a verification step near 1.26x a plain one and A = 1.0,
k = 4 near 3.6-3.7x. The risk: session 8's tensor-core attempt (eager timings) was no
faster than cuBLAS on the large projections; the sweep's 64- and 128-row tiles (wgmma on
Hopper) and 16-row ones (mma.sync, more programs) are there to find out which loads
pipeline best. Make it the default only where both commands say it is faster.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from pagedlm_cuda.kernels import pdl

MAX_ROWS = 16
"""Rows of ``x`` one call takes: the MMA's narrow side, which the rows are padded to."""


@triton.jit
def _gemv_rows_kernel(
    x_ptr, w_ptr, bias_ptr, out_ptr, M, N, K, stride_x, stride_w, stride_out,
    HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_M: tl.constexpr, PRECISION: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    pdl.allow_next(USE_PDL)
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    w_rows = w_ptr + rows[:, None].to(tl.int64) * stride_w
    x_index = tl.arange(0, BLOCK_M)
    x_mask = x_index < M
    x_rows = x_ptr + x_index[:, None] * stride_x
    cols = tl.arange(0, BLOCK_K)
    # The first weight slice is read before waiting for the kernel that produces x:
    # weights never change, so this overlaps the previous kernel's tail.
    k_mask = cols < K
    w = tl.load(w_rows + cols[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
    pdl.wait_for_previous(USE_PDL)
    x = tl.load(x_rows + cols[None, :], mask=x_mask[:, None] & k_mask[None, :], other=0.0)
    acc = tl.dot(w, tl.trans(x), input_precision=PRECISION, out_dtype=tl.float32)
    for k0 in range(BLOCK_K, K, BLOCK_K):
        k = k0 + cols
        k_mask = k < K
        w = tl.load(w_rows + k[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        x = tl.load(x_rows + k[None, :], mask=x_mask[:, None] & k_mask[None, :], other=0.0)
        acc = tl.dot(w, tl.trans(x), acc, input_precision=PRECISION, out_dtype=tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)[:, None]
    out = out_ptr + x_index[None, :] * stride_out + rows[:, None]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & x_mask[None, :])


class GemvRowsConfig(NamedTuple):
    block_n: int
    """Weight rows per program."""
    block_k: int
    """Input features per slice."""
    num_warps: int
    num_stages: int


def gemv_rows_config(n: int) -> GemvRowsConfig:
    """The tile configuration for ``n`` output features. Not yet swept (see the module
    docstring): 16-row tiles as in ``gemv.py`` (the most programs, each of its 16 x 256
    slices and x's 16 rows 16 KB per stage, so several programs share an SM), wider
    slices where there are fewer programs per SM."""
    if n <= 8192:
        return GemvRowsConfig(16, 512, 4, 4)
    return GemvRowsConfig(16, 256, 4, 4)


def gemv_rows(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: GemvRowsConfig | None = None,
) -> torch.Tensor:
    """x [M, K] with 1 <= M <= 16 (unit-stride rows), weight [N, K] (unit-stride rows, x's
    dtype: float16, bfloat16, or float32 on exact CUDA-core products), bias [N] or None
    -> [M, N] in x's dtype."""
    if x.dim() != 2 or not 1 <= x.shape[0] <= MAX_ROWS:
        raise ValueError(
            f"gemv_rows takes 1 to {MAX_ROWS} rows, x of shape [M, K]; got {tuple(x.shape)} "
            "(use F.linear for more)."
        )
    n, k = weight.shape
    if x.shape[1] != k:
        raise ValueError(f"x has {x.shape[1]} features but weight is [{n}, {k}].")
    if x.dtype != weight.dtype:
        raise ValueError(f"x is {x.dtype} but weight is {weight.dtype}; cast one of them.")
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("gemv_rows needs unit-stride rows in x and weight.")
    rows = x.shape[0]
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    block_n, block_k, num_warps, num_stages = config or gemv_rows_config(n)
    precision = "ieee" if x.dtype == torch.float32 else None  # None: the target's default
    _gemv_rows_kernel[(triton.cdiv(n, block_n),)](
        x, weight, bias if bias is not None else weight, out, rows, n, k, x.stride(0),
        weight.stride(0), out.stride(0), HAS_BIAS=bias is not None, BLOCK_N=block_n,
        BLOCK_K=block_k, BLOCK_M=MAX_ROWS, PRECISION=precision, num_warps=num_warps,
        num_stages=num_stages, **pdl.launch_options(),
    )  # fmt: skip
    return out
