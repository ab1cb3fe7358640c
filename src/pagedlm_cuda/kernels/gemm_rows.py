"""``y = x W^T + b`` for 2 to 16 rows of ``x``: a speculative verification step (``1 + k``
rows per request), a small decode batch, a short prefill chunk.

At a few rows a linear layer still only streams its weight. cuBLAS serves these shapes
with its one-row tiles, plus a separate split-K reduction kernel on some, and takes its
one-row time, which the one-row GEMV (``gemv.py``) beats by 9-35%. Here the operands are
swapped so the weight feeds Hopper's warpgroup MMA as its 64-row side: each program owns
``BLOCK_N`` (64 or 128) weight rows, streams them in ``BLOCK_K`` slices through a
``STAGES``-deep pipeline, and multiplies each slice by the rows of ``x`` padded with zeros
to 16 (masked loads), ``tl.dot(w [BLOCK_N, BLOCK_K], x^T [BLOCK_K, 16])`` into a float32
``[BLOCK_N, 16]`` accumulator. A weight with few row blocks (up to 4k rows: 64 programs
for 132 SMs) splits each block's columns over ``split_k`` programs (``split_k.py``: the
last to finish sums the parts in split order).

Session 23, H100, 5 rows, weights rotated past the L2, us per call (cuBLAS / this kernel
/ the one-row GEMV): q/k/v 6144x4096 20.8 / 19.0 / 17.8, o 4096x4096 16.0 / 13.5 / 11.8,
gate/up 28672x4096 86.4 / 80.3 / 79.3, down 4096x14336 43.8 / 41.2 / 39.6, LM head
128256x4096 378.3 / 343.4 / 339.0. Session 13's version of this kernel took 16 weight
rows per program (the MMA of the previous generation) and lost to cuBLAS.

Accumulation is float32 in an order fixed by the shapes and the tiles; padded rows are
zeros and never mix with real ones, so a row's result depends on its own values only
(the same at 2 rows as at 16, from a CUDA graph or eagerly). It differs in the last bits
from ``gemv`` and from ``F.linear``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from pagedlm_cuda.kernels import pdl
from pagedlm_cuda.kernels.activation import silu_times
from pagedlm_cuda.kernels.gemv import weight_rows
from pagedlm_cuda.kernels.split_k import SPLIT_BLOCKS, SPLIT_PARTIALS, split_sum, split_workspace

MAX_ROWS = 16
"""Rows of ``x`` one call takes: the MMA's narrow side, which the rows are padded to."""
_ROWS = tl.constexpr(MAX_ROWS)


@triton.jit(do_not_specialize=["M"])
def _gemm_rows_kernel(
    x_ptr, w_ptr, bias_ptr, out_ptr, partials_ptr, counts_ptr, M, N, K, K_SPLIT,
    stride_x, stride_w, stride_out,
    HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    STAGES: tl.constexpr, SPLIT: tl.constexpr, EVEN_K: tl.constexpr, GATED: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    pdl.allow_next(USE_PDL)
    rows, row_mask = weight_rows(N, BLOCK_N, GATED)
    k_start = tl.program_id(1) * K_SPLIT
    k_end = tl.minimum(k_start + K_SPLIT, K)
    w_rows = w_ptr + rows[:, None].to(tl.int64) * stride_w
    x_index = tl.arange(0, _ROWS)
    x_mask = x_index < M
    x_rows = x_ptr + x_index[:, None] * stride_x
    cols = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_N, _ROWS), dtype=tl.float32)
    # Weights never change: the first slice is read before waiting for x's producer.
    k = k_start + cols
    k_mask = (k < k_end) | EVEN_K
    w = tl.load(w_rows + k[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
    pdl.wait_for_previous(USE_PDL)
    x = tl.load(x_rows + k[None, :], mask=x_mask[:, None] & k_mask[None, :], other=0.0)
    acc = tl.dot(w, tl.trans(x), acc, out_dtype=tl.float32)
    for k0 in tl.range(k_start + BLOCK_K, k_end, BLOCK_K, num_stages=STAGES):
        k = k0 + cols
        k_mask = (k < k_end) | EVEN_K
        w = tl.load(w_rows + k[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        x = tl.load(x_rows + k[None, :], mask=x_mask[:, None] & k_mask[None, :], other=0.0)
        acc = tl.dot(w, tl.trans(x), acc, out_dtype=tl.float32)
    mask = x_mask[None, :] & row_mask[:, None]
    if SPLIT > 1:
        parts = x_index[None, :] * N + rows[:, None]
        last, acc = split_sum(acc, parts, mask, partials_ptr, counts_ptr, M * N, SPLIT)
        if last:
            _store(acc, rows, row_mask, x_index, x_mask, bias_ptr, out_ptr, N, stride_out,
                   BLOCK_N, GATED, HAS_BIAS)  # fmt: skip
    else:
        _store(acc, rows, row_mask, x_index, x_mask, bias_ptr, out_ptr, N, stride_out, BLOCK_N,
               GATED, HAS_BIAS)  # fmt: skip


@triton.jit
def _store(
    acc, rows, row_mask, x_index, x_mask, bias_ptr, out_ptr, N, stride_out,
    BLOCK_N: tl.constexpr, GATED: tl.constexpr, HAS_BIAS: tl.constexpr,
):  # fmt: skip
    """The float32 sums ``acc`` [weight rows, x rows] plus the bias, rounded to out's dtype,
    into out [M, N] (element (x row r, weight row n) at ``r * stride_out + n``); ``GATED``:
    ``silu(gate) * up`` of the rounded projections into out [M, N / 2], as
    ``silu_and_mul`` computes it from the plain result."""
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)[:, None]
    projected = acc.to(out_ptr.dtype.element_ty)
    if GATED:
        HALF_N: tl.constexpr = BLOCK_N // 2
        halves = tl.permute(tl.reshape(projected, (2, HALF_N, 16)), (1, 2, 0))
        gate, up = tl.split(halves)
        out = silu_times(gate, up).to(out_ptr.dtype.element_ty)
        out_rows = tl.program_id(0) * HALF_N + tl.arange(0, HALF_N)
        index = x_index[None, :] * stride_out + out_rows[:, None]
        tl.store(out_ptr + index, out, mask=x_mask[None, :] & (out_rows < N // 2)[:, None])
    else:
        index = x_index[None, :] * stride_out + rows[:, None]
        tl.store(out_ptr + index, projected, mask=x_mask[None, :] & row_mask[:, None])


class GemmRowsConfig(NamedTuple):
    """Weight rows per program (64 or 128: one or two warpgroups' MMA side), columns per
    slice, warps, slices in flight, and how many programs share a row block's columns."""

    block_n: int
    block_k: int
    num_warps: int
    stages: int
    split_k: int = 1


def gemm_rows_config(n: int, k: int) -> GemmRowsConfig:
    """The tiles for an ``n x k`` weight, from the H100 sweep of llama-3-8b's projections
    at 5 rows (session 23): up to 4k rows, 128-column slices split four ways (o 13.5 us,
    down 41.2); up to 8k, one program per row block with 256-column slices (q/k/v 19.0);
    beyond, 128-column slices four deep (gate/up 80.3, LM head 343.4)."""
    if n <= 4096:
        return GemmRowsConfig(64, 128, 4, 3, 4)
    if n <= 8192:
        return GemmRowsConfig(64, 256, 4, 3)
    return GemmRowsConfig(64, 128, 4, 4)


def gemm_rows(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: GemmRowsConfig | tuple[int, ...] | None = None,
    silu_and_mul: bool = False,
) -> torch.Tensor:
    """x [M, K] with 1 <= M <= 16 (unit-stride rows), weight [N, K] (unit-stride rows, x's
    dtype: float16 or bfloat16), bias [N] or None -> [M, N] in x's dtype.
    ``silu_and_mul``: the weight is a gate projection over an up projection (a SwiGLU
    MLP's merged one) and the result is ``silu(gate) * up`` [M, N / 2], as
    ``silu_and_mul`` computes it from the plain result (each program's rows are half gate
    rows, half the up rows they pair with: one launch fewer per MLP)."""
    if x.dim() != 2 or not 1 <= x.shape[0] <= MAX_ROWS:
        raise ValueError(
            f"gemm_rows takes 1 to {MAX_ROWS} rows, x of shape [M, K]; got {tuple(x.shape)} "
            "(use F.linear for more)."
        )
    n, k = weight.shape
    if x.shape[1] != k:
        raise ValueError(f"x has {x.shape[1]} features but weight is [{n}, {k}].")
    if x.dtype != weight.dtype or x.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(
            f"gemm_rows multiplies float16 or bfloat16 x and weight of one dtype; got "
            f"{x.dtype} and {weight.dtype}."
        )
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("gemm_rows needs unit-stride rows in x and weight.")
    cfg = GemmRowsConfig(*config) if config is not None else gemm_rows_config(n, k)
    if silu_and_mul and n % 2:
        raise ValueError(f"silu_and_mul needs an even row count; got {n}.")
    m = x.shape[0]
    out = torch.empty((m, n // 2 if silu_and_mul else n), dtype=x.dtype, device=x.device)
    blocks = triton.cdiv(n // 2, cfg.block_n // 2) if silu_and_mul else triton.cdiv(n, cfg.block_n)
    split = cfg.split_k
    # Split only into whole slices, and only as far as the workspace holds the parts.
    if k % (split * cfg.block_k) or m * n * split > SPLIT_PARTIALS or blocks > SPLIT_BLOCKS:
        split = 1
    partials, counts = split_workspace(x.device) if split > 1 else (out, out)
    k_split = k // split if split > 1 else k
    _gemm_rows_kernel[(blocks, split)](
        x, weight, bias if bias is not None else weight, out, partials, counts, m, n, k,
        k_split, x.stride(0), weight.stride(0), out.stride(0), HAS_BIAS=bias is not None,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, STAGES=cfg.stages, SPLIT=split,
        EVEN_K=k_split % cfg.block_k == 0, GATED=silu_and_mul, num_warps=cfg.num_warps,
        num_stages=cfg.stages, **pdl.launch_options(),
    )  # fmt: skip
    return out
