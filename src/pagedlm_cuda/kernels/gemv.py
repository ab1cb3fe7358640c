"""``y = x W^T + b`` for one row of ``x``: the decode step of a single sequence.

At batch 1 every linear layer is a matrix-vector product that only streams its weight, so
its speed is the memory bandwidth it reaches. cuBLAS picks split-K GEMM tiles for these
shapes and stays near 3.1 TB/s on the smaller ones (llama-3-8b's q/k/v and o projections,
plus a separate split-K reduction kernel); this kernel gives each program ``BLOCK_N``
whole rows of ``W``, streams them in ``BLOCK_K`` slices and reduces in registers, with
no second pass. Measured on the H200 (bf16, weights rotated to
defeat the L2, from a CUDA graph): q/k/v 4096x6144 14.2 us against cuBLAS's 16.0, o
4096x4096 10.1 against 12.7, gate/up 4096x28672 54.3 against 55.0 (4.3 TB/s), down
14336x4096 28.8 against 30.5, LM head 4096x128256 231 against 239. In the llama-3-8b
decode step (W2) the linear layers went from 3.97 to 3.76 ms per token.

Accumulation is float32 in a fixed order that depends only on the shapes, so a row's
result does not depend on anything else in the step.

The slice loop can keep several slices in flight (``pipeline_stages`` > 1:
``tl.range(..., num_stages=S)`` copies S slices ahead into shared memory with
``cp.async``; the kernel-level ``num_stages`` pipelines only loads that feed a
``tl.dot``, so it never changed this loop). Measured on the H200 (session 14,
``tests/cuda/bench_gemv.py --kinds bf16 fp8 gguf4 --sweep``): it does not help bf16
(q/k/v 13.2 us with one stage against 13.7-15.6 with 2-4; o 8.9 against 8.7 at best),
so bf16 keeps one; it is worth 5-16% on FP8 codes (down 18.6 -> 15.7 us, the LM head
133.5 -> 122.2) and up to 1.4x on GGUF blocks (session 14's ``gguf_gemv``: o 14.6 -> 10.4
us, down 45.7 -> 32.4), whose loop does more arithmetic per byte. A split-K variant (the
last of a row block's programs summing the others' partials) lost on every shape and kind
(o, bf16: 11.2 us at best against 8.7) and was removed. Measured again in session 21 on an
H100 with ``split_k.py`` (which the GGUF GEMVs keep): it lost on q/k/v, o and down, in bf16
(o 11.89 us unsplit, 12.88-21.76 split) and FP8 (o 7.20, 9.23-13.97), so this kernel
streams whole rows.
"""

from __future__ import annotations

import functools
import json
import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from pagedlm_cuda.kernels import pdl
from pagedlm_cuda.kernels.activation import silu_times


@triton.jit
def weight_rows(N, BLOCK_N: tl.constexpr, GATED: tl.constexpr):
    """This program's ``BLOCK_N`` weight rows of ``N`` and their mask: consecutive rows,
    or under ``GATED`` (a SwiGLU MLP's gate projection over its up projection) the
    program's ``BLOCK_N / 2`` gate rows followed by the up rows ``N / 2`` below them,
    which the epilogue pairs into ``BLOCK_N / 2`` outputs."""
    if GATED:
        HALF_N: tl.constexpr = BLOCK_N // 2
        index = tl.arange(0, BLOCK_N)
        gate_rows = tl.program_id(0) * HALF_N + index % HALF_N
        rows = gate_rows + (index // HALF_N) * (N // 2)
        row_mask = gate_rows < N // 2
    else:
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        row_mask = rows < N
    return rows, row_mask


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, scale_ptr, bias_ptr, out_ptr, N, K, stride_w,
    HAS_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, PIPELINE: tl.constexpr, GATED: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    pdl.allow_next(USE_PDL)
    rows, row_mask = weight_rows(N, BLOCK_N, GATED)
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
    # PIPELINE > 1 keeps that many slices in flight (copied asynchronously to shared
    # memory); a plain loop issues a slice's loads only once the previous one is summed.
    for k0 in tl.range(BLOCK_K, K, BLOCK_K, num_stages=PIPELINE):
        k = k0 + tl.arange(0, BLOCK_K)
        k_mask = k < K
        w = tl.load(w_rows + k[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        x = tl.load(x_ptr + k, mask=k_mask, other=0.0)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    y = tl.sum(acc, axis=1)
    if HAS_SCALE:
        y *= scale
    if HAS_BIAS:
        y += tl.load(bias_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)
    if GATED:
        # silu(gate) * up from the rounded projections, as ``silu_and_mul`` computes it
        # from the GEMV's stored output.
        HALF_N: tl.constexpr = BLOCK_N // 2
        projected = tl.reshape(y.to(out_ptr.dtype.element_ty), (2, HALF_N))
        gate, up = tl.split(tl.trans(projected))
        out = silu_times(gate, up)
        out_rows = tl.program_id(0) * HALF_N + tl.arange(0, HALF_N)
        tl.store(out_ptr + out_rows, out.to(out_ptr.dtype.element_ty), mask=out_rows < N // 2)
    else:
        tl.store(out_ptr + rows, y.to(out_ptr.dtype.element_ty), mask=row_mask)


class GemvConfig(NamedTuple):
    """How ``gemv`` tiles a weight: each program owns ``block_n`` whole rows, which it
    streams in ``block_k``-column slices; ``pipeline_stages`` > 1 keeps that many slices in
    flight through shared memory (1: a plain loop). ``split_k`` > 1 (the GGUF GEMVs
    only) splits each row block's columns over that many programs, the last of which
    to finish sums their parts in a fixed order (``split_k.py``)."""

    block_n: int
    block_k: int
    num_warps: int
    pipeline_stages: int = 1
    split_k: int = 1


CONFIGS_ENV = "PAGEDLM_GEMV_CONFIGS"
"""For measuring only (off unless set): a JSON file ``{"N,K[,KIND]": [block_n, block_k,
num_warps, pipeline_stages]}`` (what ``tests/cuda/bench_gemv.py --best-json``
writes) whose entries replace ``gemv_config``'s for those weight shapes and kinds
(``WEIGHT_KINDS``; ``bf16`` where the key names none)."""

WEIGHT_KINDS = ("bf16", "fp8", "gguf4", "gguf8", "gguf4i8", "gguf8i8", "gguf4h")
"""What a GEMV streams per weight: 16-bit floats (bf16 or float16), FP8 codes with a scale
per row, GGUF codes of 4 bits (eight per int32 word) or 8 bits (four per word) with a scale
per 32 (``gguf_gemv``'s layout); ``i8``: the same codes against x rounded to int8
(``gguf_gemv_int8``); ``gguf4h``: 4-bit codes with float16 products (``gguf_gemv_half``)."""


@functools.cache
def _configs_from_env() -> dict[tuple[int, int, str], GemvConfig]:
    path = os.environ.get(CONFIGS_ENV)
    if not path:
        return {}
    with open(path) as f:
        table = json.load(f)
    configs = {}
    for key, tiles in table.items():
        parts = key.split(",")
        kind = parts.pop() if len(parts) == 3 else "bf16"
        ok = len(parts) == 2 and all(p.strip().isdigit() for p in parts) and kind in WEIGHT_KINDS
        if not ok or not 3 <= len(tiles) <= 5 or not all(t >= 1 for t in tiles):
            raise ValueError(
                f'{CONFIGS_ENV}={path}: entry {key!r}: {tiles!r}; write "N,K": [block_n, '
                "block_k, num_warps, pipeline_stages, split_k] (positive integers, the last "
                f'two optional), or "N,K,KIND" with KIND one of {", ".join(WEIGHT_KINDS)}.'
            )
        configs[(int(parts[0]), int(parts[1]), kind)] = GemvConfig(*tiles)
    return configs


def gemv_config(n: int, k: int, kind: str = "bf16") -> GemvConfig:
    """The tiles for an ``n x k`` weight of ``kind`` (``WEIGHT_KINDS``), from H200 sweeps
    of llama-3-8b's projections (bf16: session 9; FP8: session 14, ``tests/cuda/
    bench_gemv.py --sweep``). 16 rows per program nearly throughout; the fewer programs
    a layer has (small ``n``), the wider each one's slices. bf16: 1024 columns up to 4k
    outputs, 512 up to 8k, 256 with 4 warps beyond, one stage. FP8 codes: three slices in
    flight and 4 warps. GGUF blocks (session 16's word-layout kernel; swept on an H100 in
    session 18, where no other tile of the grid won by more than 16%; on the H200, session
    20, q/k/v took 16.65 us against 11.88 for (8, 1024, 4, 3), the other shapes unswept):
    8 rows of 512 columns in one warp, three slices in flight, the tile with the fewest
    loop instructions per weight among those that give llama-3-8b's smallest projection
    512 programs (``tests/cuda/sass_gguf_gemv.py``: 4.70 per weight). Up to 8k rows those
    one-warp programs are too few to keep the loads in flight, so Q4-class codes split
    each row block's columns (session 21, H100 sweep with split-K: q/k/v 16.97 -> 9.96 us
    at (8, 1024, 1, 3, 2), o 11.21 -> 9.20, down 32.61 -> 20.52 at (8, 512, 1, 3, 4);
    gate/up lost with every split; 8-bit codes unswept); o (up to 4k rows) takes
    (16, 512, 2, 3, 4), the best of both sweeps (H100 8.21 us, H200 in session 22 7.72
    against 8.78 for (8, 1024, 1, 3, 2)). The int8 GGUF GEMV
    (``gguf4i8``/``gguf8i8``, session 17; the H100 sweep's best beat it on q/k/v only):
    16 rows of 512 columns in one warp, three slices in flight (2.1 per weight; x is
    rounded once per program, so more rows per program pay for it). The float16-product
    GEMV (``gguf4h``, session 33, H100 sweep of 60 tiles per projection): 8 rows of 1024
    columns, one slice at a time (its loads straight to registers: staged through shared
    memory they stalled on its queue), two warps where the rows are many, else one warp
    with the columns split 2 (q/k/v) or 4 ways (o, down): q/k/v 8.04 us, o 5.91, gate/up
    26.86, down 15.45, LM head 108.18 (the exact GEMV's defaults: 9.81, 8.06, 31.72, 20.13,
    115.25). 8-bit codes (Q8_0; session 33, H100, 13 tiles): o and down split 4 ways (9.09
    -> 8.05 us, 27.35 -> 24.55), q/k/v 16 rows of 1024 columns in 4 warps, one stage (15.58
    -> 10.66); gate/up keeps its tile (45.12, the best 44.71)."""
    chosen = _configs_from_env().get((n, k, kind))
    if chosen is not None:
        return chosen
    if kind == "fp8":
        if n <= 4096:
            return GemvConfig(16, 1024, 4, 3)
        return GemvConfig(16, 512 if n <= 8192 else 256, 4, 3)
    if kind == "gguf4h":  # session 33 (H100): one stage, 1024-column slices
        if n > 8192:
            return GemvConfig(8, 1024, 2, 1)
        if k > 8192 or n <= 4096:
            return GemvConfig(8, 1024, 1, 1, 4)
        return GemvConfig(8, 1024, 2, 1, 2)
    if kind == "gguf4" and n <= 8192:  # few row blocks: split each one's columns
        if k > 8192:
            return GemvConfig(8, 512, 1, 3, 4)
        return GemvConfig(16, 512, 2, 3, 4) if n <= 4096 else GemvConfig(8, 1024, 1, 3, 2)
    if kind == "gguf8" and n <= 8192:  # session 33 (H100): split, or wider slices
        if k > 8192 or n <= 4096:
            return GemvConfig(8, 512, 1, 3, 4)
        return GemvConfig(16, 1024, 4, 1)
    if kind in ("gguf4", "gguf8"):
        return GemvConfig(8, 512, 1, 3)
    if kind in ("gguf4i8", "gguf8i8"):
        return GemvConfig(16, 512, 1, 3)
    if n <= 4096:
        return GemvConfig(16, 1024, 8)
    if n <= 8192:
        return GemvConfig(16, 512, 8)
    return GemvConfig(16, 256, 4)


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    weight_scale: torch.Tensor | None = None,
    config: GemvConfig | tuple[int, ...] | None = None,
    silu_and_mul: bool = False,
) -> torch.Tensor:
    """x [1, K] (unit-stride row), weight [N, K] (unit-stride rows; any float dtype, FP8
    included, converted in registers), bias [N] or None, weight_scale float32 [N] (or
    [N, 1]) or None: row r's result times weight_scale[r] -> [1, N] in x's dtype.
    ``silu_and_mul``: the weight is a gate projection over an up projection (a SwiGLU
    MLP's merged one) and the result is ``silu(gate) * up`` [1, N / 2], as
    ``silu_and_mul`` computes it from the plain result (each program's rows are half gate
    rows, half the up rows they pair with: one launch fewer per MLP)."""
    if x.dim() != 2 or x.shape[0] != 1:
        raise ValueError(f"gemv takes one row, x of shape [1, K]; got {tuple(x.shape)}.")
    n, k = weight.shape
    if x.shape[1] != k:
        raise ValueError(f"x has {x.shape[1]} features but weight is [{n}, {k}].")
    if weight_scale is not None and weight_scale.numel() != n:
        raise ValueError(f"{weight_scale.numel()} weight scales for a weight of {n} rows.")
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("gemv needs unit-stride rows in x and weight.")
    kind = "fp8" if weight.element_size() == 1 else "bf16"
    cfg = GemvConfig(*config) if config is not None else gemv_config(n, k, kind)
    if cfg.split_k != 1:
        raise ValueError(f"gemv streams whole rows per program; split_k must be 1, got {cfg}.")
    if silu_and_mul and (n % 2 or cfg.block_n % 2):
        raise ValueError(f"silu_and_mul needs an even row count and block_n; got {n}, {cfg}.")
    out = torch.empty((1, n // 2 if silu_and_mul else n), dtype=x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(n, cfg.block_n),)](
        x, weight, weight_scale if weight_scale is not None else weight,
        bias if bias is not None else weight, out, n, k, weight.stride(0),
        HAS_SCALE=weight_scale is not None, HAS_BIAS=bias is not None,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, PIPELINE=cfg.pipeline_stages,
        GATED=silu_and_mul, num_warps=cfg.num_warps, num_stages=cfg.pipeline_stages,
        **pdl.launch_options(),
    )  # fmt: skip
    return out
