"""``y = x W^T + b`` for 2 to 128 rows of ``x`` (the linear layers send up to 32): a
speculative verification step (``1 + k`` rows per request), a small decode batch, a short
prefill chunk.

At a few rows a linear layer still only streams its weight. cuBLAS serves these shapes
with its one-row tiles, plus a separate split-K reduction kernel on some, and takes its
one-row time, which the one-row GEMV (``gemv.py``) beats by 9-35%. Here the operands are
swapped so the weight feeds Hopper's warpgroup MMA as its 64-row side: each program owns
``BLOCK_N`` (64 or 128) weight rows, streams them in ``BLOCK_K`` slices through a
``STAGES``-deep pipeline, and multiplies each slice by the rows of ``x`` padded with zeros
to ``ROWS`` (16, 32, 64 or 128; masked loads), ``tl.dot(w [BLOCK_N, BLOCK_K], x^T
[BLOCK_K, ROWS])`` into a float32 ``[BLOCK_N, ROWS]`` accumulator. A weight with few row
blocks (up to 4k rows: 64 programs for 132 SMs) splits each block's columns over
``split_k`` programs (``split_k.py``: the last to finish sums the parts in split order).

Session 23, H100, 5 rows, weights rotated past the L2, us per call (cuBLAS / this kernel
/ the one-row GEMV): q/k/v 6144x4096 20.8 / 19.0 / 17.8, o 4096x4096 16.0 / 13.5 / 11.8,
gate/up 28672x4096 86.4 / 80.3 / 79.3, down 4096x14336 43.8 / 41.2 / 39.6, LM head
128256x4096 378.3 / 343.4 / 339.0. Session 13's version of this kernel took 16 weight
rows per program (the MMA of the previous generation) and lost to cuBLAS.

Session 31, H100, qwen3-0.6b's projections at 24 and 32 rows (us per call, cuBLAS / this
kernel): q/k/v 5.69 / 5.60 and 6.09 / 5.57, o 6.15 / 5.63 and 6.11 / 5.73, gate/up with
SiLU-and-mul 7.21 / 6.55 and 7.36 / 6.58, down 7.58 / 6.37 and 7.47 / 6.47; the LM head
111.5 / 122.6 (so it stays on cuBLAS there). At 64 rows the two were within 5% either
way, at 128 cuBLAS won.

Accumulation is float32 in an order fixed by the shapes and the tiles; padded rows are
zeros and never mix with real ones, so a row's result depends on its own values only
(the same at 2 rows as at 128, from a CUDA graph or eagerly). It differs in the last bits
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

MAX_ROWS = 128
"""Rows of ``x`` one call takes. They are the MMA's narrow side, padded with zeros to the
next power of two from 16 (``ROWS``)."""


@triton.jit(do_not_specialize=["M"])
def _gemm_rows_kernel(
    x_ptr, w_ptr, bias_ptr, out_ptr, partials_ptr, counts_ptr, M, N, K, K_SPLIT,
    stride_x, stride_w, stride_out,
    HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    STAGES: tl.constexpr, SPLIT: tl.constexpr, EVEN_K: tl.constexpr, GATED: tl.constexpr,
    ROWS: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    pdl.allow_next(USE_PDL)
    rows, row_mask = weight_rows(N, BLOCK_N, GATED)
    k_start = tl.program_id(1) * K_SPLIT
    k_end = tl.minimum(k_start + K_SPLIT, K)
    w_rows = w_ptr + rows[:, None].to(tl.int64) * stride_w
    x_index = tl.arange(0, ROWS)
    x_mask = x_index < M
    x_rows = x_ptr + x_index[:, None] * stride_x
    cols = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_N, ROWS), dtype=tl.float32)
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
                   BLOCK_N, GATED, HAS_BIAS, ROWS)  # fmt: skip
    else:
        _store(acc, rows, row_mask, x_index, x_mask, bias_ptr, out_ptr, N, stride_out, BLOCK_N,
               GATED, HAS_BIAS, ROWS)  # fmt: skip


@triton.jit
def _store(
    acc, rows, row_mask, x_index, x_mask, bias_ptr, out_ptr, N, stride_out,
    BLOCK_N: tl.constexpr, GATED: tl.constexpr, HAS_BIAS: tl.constexpr, ROWS: tl.constexpr,
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
        halves = tl.permute(tl.reshape(projected, (2, HALF_N, ROWS)), (1, 2, 0))
        gate, up = tl.split(halves)
        out = silu_times(gate, up).to(out_ptr.dtype.element_ty)
        out_rows = tl.program_id(0) * HALF_N + tl.arange(0, HALF_N)
        index = x_index[None, :] * stride_out + out_rows[:, None]
        tl.store(out_ptr + index, out, mask=x_mask[None, :] & (out_rows < N // 2)[:, None])
    else:
        index = x_index[None, :] * stride_out + rows[:, None]
        tl.store(out_ptr + index, projected, mask=x_mask[None, :] & row_mask[:, None])


ONE_WAVE_PROGRAMS = 128
"""Above 16 rows, grids of up to this many programs (one per SM on a 132-SM Hopper) keep
four stages in flight; larger ones take three, so that three programs share an SM."""


class GemmRowsConfig(NamedTuple):
    """Weight rows per program (64 or 128: one or two warpgroups' MMA side), columns per
    slice, warps, slices in flight, and how many programs share a row block's columns."""

    block_n: int
    block_k: int
    num_warps: int
    stages: int
    split_k: int = 1


def gemm_rows_config(n: int, k: int, rows: int = 16) -> GemmRowsConfig:
    """The tiles for an ``n x k`` weight at ``rows`` rows of x.

    Up to 16 rows, from the H100 sweep of llama-3-8b's projections at 5 rows (session 23):
    up to 4k weight rows, 128-column slices split four ways (o 13.5 us, down 41.2); up to
    8k, one program per row block with 256-column slices (q/k/v 19.0); beyond,
    128-column slices four deep (gate/up 80.3, LM head 343.4).

    17 to 32 rows, from the H100 sweep of qwen3-0.6b's at 32 rows (session 31):
    128-column slices four deep, split four ways where the weight has up to 4k rows of
    at least 2k columns (o 5.57 us against cuBLAS's 6.01, down 6.29 against 7.41; q/k/v,
    1k columns, unsplit 5.55 against 5.67 and split 8.66; gate/up 6.52 against 7.60).
    Four stages hold 96 kB of shared memory at 32 rows, so two programs fit an SM: where
    the grid has more programs than the GPU has SMs they take three (three programs per
    SM). From the H100 sweep of llama-3-8b's at 20 to 32 rows (session 32; cuBLAS / four
    stages / three): o 14.3 / 17.4 / 14.3 us at 20 rows (split four ways), down 43.0 /
    45.7 / 41.8 (split), gate/up 83.3 / 82.3 / 79.3; q/k/v (96 programs) 20.6 / 19.2 /
    21.5. More rows (where cuBLAS was as fast or faster) take 64-column slices, which fit
    the shared memory at 128 rows."""
    if rows > 16:
        split = 4 if n <= 4096 and k >= 2048 else 1
        if rows > 32:
            return GemmRowsConfig(64, 64, 4, 4, split)
        one_per_sm = triton.cdiv(n, 64) * split <= ONE_WAVE_PROGRAMS
        return GemmRowsConfig(64, 128, 4, 4 if one_per_sm else 3, split)
    if n <= 4096:
        return GemmRowsConfig(64, 128, 4, 3, 4)
    if n <= 8192:
        return GemmRowsConfig(64, 256, 4, 3)
    return GemmRowsConfig(64, 128, 4, 4)


DEFAULT_ROWS_MAX = 32
"""The most rows the linear layers send here by default (``PAGEDLM_GEMM_ROWS_MAX``)."""
WIDE_MAX_WEIGHT_ROWS = 32768
"""Above 16 rows, only weights of up to this many rows come here: qwen3-0.6b's LM head
(151,936 rows) took 124 us at 24-32 rows against cuBLAS's 112 (H100, session 31)."""


def beats_cublas(rows: int, n: int) -> bool:
    """Whether ``rows`` rows of x times an ``n``-row weight are faster here than in cuBLAS
    (H100 measurements; the caller caps ``rows``)."""
    return rows <= 16 or n <= WIDE_MAX_WEIGHT_ROWS


def padded_rows(m: int) -> int:
    """The MMA's narrow side for ``m`` rows of x: the next power of two, at least 16."""
    return max(16, triton.next_power_of_2(m))


def gemm_rows(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: GemmRowsConfig | tuple[int, ...] | None = None,
    silu_and_mul: bool = False,
) -> torch.Tensor:
    """x [M, K] with 1 <= M <= ``MAX_ROWS`` (unit-stride rows), weight [N, K] (unit-stride
    rows, x's dtype: float16 or bfloat16), bias [N] or None -> [M, N] in x's dtype.
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
    m = x.shape[0]
    cfg = GemmRowsConfig(*config) if config is not None else gemm_rows_config(n, k, m)
    if silu_and_mul and n % 2:
        raise ValueError(f"silu_and_mul needs an even row count; got {n}.")
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
        EVEN_K=k_split % cfg.block_k == 0, GATED=silu_and_mul, ROWS=padded_rows(m),
        num_warps=cfg.num_warps, num_stages=cfg.stages, **pdl.launch_options(),
    )  # fmt: skip
    return out
