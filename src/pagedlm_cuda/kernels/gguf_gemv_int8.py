"""The batch-1 GGUF GEMV with x quantized to int8: integer dot products of four codes at a
time (``dp4a``), as llama.cpp's CUDA kernels (``mul_mat_vec_q`` with ``q8_1``
activations) and vLLM's GGUF path compute it.

Per 32-column scale group ``j`` each program quantizes x itself: ``d_j = max|x| / 127``,
``q = round(x / d_j)`` in [-127, 127]. A row's part of the product is then

    scale[r, j] * d_j * sum(code * q)  +  min[r, j] * sum(x)

with ``sum(code * q)`` exact in int32, and for the legacy types without stored minimums
(``min = -offset * scale``) ``scale[r, j] * d_j * sum((code - offset) * q)``.
So the only error against the exact float GEMV (``gguf_gemv``) is x's rounding to 8 bits
per group, the error llama.cpp's and vLLM's GGUF matmuls make: at most ``max|x| / 254`` per
element, about 1e-2 of a row's result on random data (``tests/cuda/test_gguf_gpu_kernels.py``
holds the kernel to that rounding's own error). On SmolLM2's weights it moves logprobs
about as much as running the model in bf16 does (``python -m
pagedlm.benchmarks.int8_activations``).

Why: ``gguf_gemv`` turns every code into a float (a logic op, an add and an FMA per
weight, 4.7 loop instructions per weight in sm_90 SASS), while an H200 reading 4-bit codes
at full bandwidth leaves about 3.5 instructions per weight. This is ``gguf_gemv``'s kernel
(``gemv_kernel``: its programs, slices and masks) with integer slices (``_slice_terms``).
In its word layout (``PackedGguf``) a scale group's four code slots sit one per byte,
4-bit codes in the low nibbles for a lane group's first scale group and in the high
nibbles for its second. So per word of eight 4-bit codes, one mask leaves the first
group's four codes one per byte, a second mask the other group's times 16 (divided out
exactly afterwards), and two ``dp4a`` take them against four int8 x values each. 8-bit
codes (four per word, one group per lane group) go to ``dp4a`` as they are. A program
rounds the x it needs once for its ``BLOCK_N`` rows: 2.1 loop instructions per weight at
the default tiles (``tests/cuda/sass_gguf_gemv.py --int8``).

Not the default: ``GgufCudaLinear`` takes it where ``PAGEDLM_GGUF_INT8_GEMV=1``. Timed on
an H100 (session 18, ``tests/cuda/bench_gemv.py --kinds gguf4 gguf4i8``), it beats
``gguf_gemv`` alone on llama-3-8b's q/k/v (13.5 against 17.0 us), o (9.0 / 11.4) and down
(25.5 / 32.9) and loses on gate/up (34.6 / 32.8) and the LM head (120.6 / 118.5), yet W2
on a Q4_0 file runs slower with it (``python -m pagedlm.benchmarks.quantized_gpu --parts
gguf``: 234.4 against 266.8 tok/s), for reasons not yet found. On that GPU the tile
(8, 256, 1, 2) gives wrong results for every block type (the interpreter's are right);
the default tiles pass.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from pagedlm_cuda.kernels.gemv import GemvConfig
from pagedlm_cuda.kernels.gguf_gemv import (
    LANES,
    PackedGguf,
    default_gemv_config,
    launch_gemv,
    load_groups,
)

INT8_GEMV_ENV = "PAGEDLM_GGUF_INT8_GEMV"
"""Set to 1 to run batch-1 GGUF layers through ``gguf_gemv_int8`` (off by default)."""

ROUNDING = tl.constexpr(12582912.0)
"""1.5 * 2^23: adding it to a float below 2^22 in magnitude rounds it to an integer held in
the low mantissa bits (the float's bits are ``0x4B400000`` plus the integer)."""
ROUNDING_BITS = tl.constexpr(0x4B400000)
HIGH_NIBBLES = tl.constexpr(-0x0F0F0F10)
"""``0xF0F0F0F0`` as an int32."""
HIGH_HALF = tl.constexpr(-0x10000)
"""``0xFFFF0000`` as an int32: bytes 2 and 3 (8-bit codes: a 32-column lane group's second
16-column scale group)."""
HIGH_NIBBLES_2_3 = tl.constexpr(-0x0F100000)
"""``0xF0F00000`` as an int32: the high nibbles of bytes 2 and 3."""


def int8_gemv_enabled() -> bool:
    return os.environ.get(INT8_GEMV_ENV, "0") == "1"


@triton.jit
def dp4a(a, b, c, EMULATE: tl.constexpr):
    """``c`` plus the dot product of ``a``'s four unsigned bytes with ``b``'s four signed
    bytes, per int32 element. ``EMULATE`` computes it with shifts (the interpreter has no
    inline assembly); on the GPU it is one ``dp4a`` (``IDP.4A``) per element."""
    if EMULATE:
        total = c
        for i in tl.static_range(4):
            total += ((a >> (8 * i)) & 0xFF) * ((b << (24 - 8 * i)) >> 24)
        return total
    return tl.inline_asm_elementwise(
        "dp4a.u32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c],
        dtype=tl.int32, is_pure=True, pack=1,
    )  # fmt: skip


@triton.jit
def _product(a, b, EMULATE: tl.constexpr):
    """``a * b`` rounded to float32 on its own: ``mul.rn`` is never fused into a following
    add, so x rounds to int8 exactly as ``torch.round(x * (127 / max|x|))`` does."""
    if EMULATE:
        return a * b
    return tl.inline_asm_elementwise(
        "mul.rn.f32 $0, $1, $2;", "=f,f,f", [a, b], dtype=tl.float32, is_pure=True, pack=1
    )


@triton.jit
def to_float(values):
    """int32 of magnitude below 2^22 -> float32, exactly, without a (quarter-rate)
    conversion instruction."""
    return (values + ROUNDING_BITS).to(tl.float32, bitcast=True) - ROUNDING


@triton.jit
def quantize_groups(
    x_ptr, j0, K, GROUPS: tl.constexpr, EVEN_K: tl.constexpr, EMULATE: tl.constexpr
):
    """x's 32-column groups ``j0 ..`` (zeros past K) quantized to int8: (words int32
    [GROUPS, 8], scales float32 [GROUPS], sums of the int8 values int32 [GROUPS, 2] and
    sums of x float32 [GROUPS, 2], each over the group's first and second 16 columns).
    Byte ``b`` of word ``w`` of group ``j`` holds column ``32 j + 8 b + w``, as the codes
    of a 32-column scale group sit in ``gguf_gemv``'s words (a 16-column one: bytes 0-1,
    or 2-3)."""
    groups = j0 + tl.arange(0, GROUPS)
    columns = (
        groups[:, None, None] * 32
        + (8 * tl.arange(0, 4))[None, :, None]
        + tl.arange(0, LANES)[None, None, :]
    )  # [GROUPS, byte, word]: x's own order
    if EVEN_K:
        x = tl.load(x_ptr + columns).to(tl.float32)
    else:
        x = tl.load(x_ptr + columns, mask=columns < K, other=0.0).to(tl.float32)
    amax = tl.max(tl.max(tl.abs(x), axis=2), axis=1)
    # IEEE division (``/`` is an approximate one): the inverse torch's tensor division
    # gives. (A Python number over a tensor is the tensor's reciprocal times the number
    # in torch, a unit in the last place off at times: 127 / 5.750026 gives 22.086859
    # against the correctly rounded 22.086857, and 4.776596 times it ties at 105.5.)
    inverse = tl.math.div_rn(tl.full(amax.shape, 127.0, tl.float32), tl.maximum(amax, 1e-30))
    scaled = _product(x, tl.broadcast_to(inverse[:, None, None], x.shape), EMULATE)
    rounded = (scaled + ROUNDING).to(tl.int32, bitcast=True)
    # The low byte of the rounded float's bits is the int8 value's two's complement.
    shifts = (8 * tl.arange(0, 4))[None, :, None]
    words = tl.sum((rounded & 0xFF) << shifts, axis=1)
    # [group, half, its 16 columns]: bytes 0-1 and 2-3 of the words.
    q_sums = tl.sum(tl.reshape(rounded - ROUNDING_BITS, (GROUPS, 2, 16)), axis=2)
    x_sums = tl.sum(tl.reshape(x, (GROUPS, 2, 16)), axis=2)
    return words, amax * (1.0 / 127.0), q_sums, x_sums


@triton.jit
def _group_terms(
    dots, q_sums, x_scales, x_sums, scales_ptr, mins_ptr, at, mask, OFFSET: tl.constexpr,
    HAS_MINS: tl.constexpr, EVEN: tl.constexpr,
):  # fmt: skip
    """float32 [BLOCK_N, G]: each (row, scale group)'s part of the product from its
    integer dot (``dots``) and x's scales and sums ([G] each)."""
    scale = load_groups(scales_ptr + at, mask, EVEN)
    if HAS_MINS:
        low = load_groups(mins_ptr + at, mask, EVEN)
        return scale * x_scales[None, :] * to_float(dots) + low * x_sums[None, :]
    return scale * x_scales[None, :] * to_float(dots - OFFSET * q_sums[None, :])


@triton.jit
def _slice_terms(
    words, magic, x_ptr, scales_ptr, mins_ptr, rows, row_mask, g0, K, stride_groups,
    OFFSET: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr, HAS_MINS: tl.constexpr,
    BLOCK_G: tl.constexpr, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr, EMULATE: tl.constexpr,
):  # fmt: skip
    """``gemv_kernel``'s ``SLICE`` for integer products. float32 [BLOCK_N, BLOCK_G]:
    per (row, lane group) of the slice's ``words`` ([BLOCK_N, BLOCK_G, 8], lane groups
    ``g0 ..``), its weights times x. (``magic`` is the float slice's.)"""
    EVEN: tl.constexpr = EVEN_N and EVEN_K
    row_groups = rows.to(tl.int64)[:, None] * stride_groups
    zero = tl.zeros(words.shape, dtype=tl.int32)
    if BITS == 4:  # a lane group is two 32-column x groups: the low nibbles, then the high
        x_words, x_scales, q_sums, x_sums = quantize_groups(
            x_ptr, 2 * g0, K, 2 * BLOCK_G, EVEN_K, EMULATE
        )
        lo_x, hi_x = tl.split(tl.permute(tl.reshape(x_words, (BLOCK_G, 2, LANES)), (0, 2, 1)))
        lo_scale, hi_scale = tl.split(tl.reshape(x_scales, (BLOCK_G, 2)))
        if GROUP == 16:  # each nibble half is two scale groups: bytes 0-1, then 2-3
            lo_q, hi_q = tl.split(tl.permute(tl.reshape(q_sums, (BLOCK_G, 2, 2)), (0, 2, 1)))
            lo_sum, hi_sum = tl.split(tl.permute(tl.reshape(x_sums, (BLOCK_G, 2, 2)), (0, 2, 1)))
            first = 4 * (g0 + tl.arange(0, BLOCK_G))
            out = _two_groups(
                words & 0x0F0F, words & 0x0F0F0000, 0, lo_x, lo_scale, lo_q, lo_sum, first,
                scales_ptr, mins_ptr, row_groups, row_mask, K, OFFSET, HAS_MINS, EVEN, EMULATE,
            )  # fmt: skip
            out += _two_groups(
                words & 0xF0F0, words & HIGH_NIBBLES_2_3, 4, hi_x, hi_scale, hi_q, hi_sum,
                first + 2, scales_ptr, mins_ptr, row_groups, row_mask, K, OFFSET, HAS_MINS,
                EVEN, EMULATE,
            )  # fmt: skip
            return out
        lo_q, hi_q = tl.split(tl.reshape(tl.sum(q_sums, axis=1), (BLOCK_G, 2)))
        lo_sum, hi_sum = tl.split(tl.reshape(tl.sum(x_sums, axis=1), (BLOCK_G, 2)))
        lo_dots = tl.sum(dp4a(words & 0x0F0F0F0F, lo_x[None], zero, EMULATE), axis=2)
        # The high nibbles in place are 16 times the codes: a shift divides it out exactly.
        hi_dots = tl.sum(dp4a(words & HIGH_NIBBLES, hi_x[None], zero, EMULATE), axis=2) >> 4
        groups = 2 * (g0 + tl.arange(0, BLOCK_G))
        mask = row_mask[:, None] & (groups[None, :] < K // 32)
        at = row_groups + groups[None, :]
        out = _group_terms(
            lo_dots, lo_q, lo_scale, lo_sum, scales_ptr, mins_ptr, at, mask, OFFSET, HAS_MINS,
            EVEN,
        )  # fmt: skip
        out += _group_terms(
            hi_dots, hi_q, hi_scale, hi_sum, scales_ptr, mins_ptr, at + 1,
            row_mask[:, None] & (groups[None, :] + 1 < K // 32), OFFSET, HAS_MINS, EVEN,
        )  # fmt: skip
        return out
    # 8-bit codes: a lane group is 32 columns, four codes per word.
    x_words, x_scales, q_sums, x_sums = quantize_groups(x_ptr, g0, K, BLOCK_G, EVEN_K, EMULATE)
    if GROUP == 16:  # two scale groups: bytes 0-1 (slots 0-1), then bytes 2-3
        return _two_groups(
            words & 0xFFFF, words & HIGH_HALF, 0, x_words, x_scales, q_sums, x_sums,
            2 * (g0 + tl.arange(0, BLOCK_G)), scales_ptr, mins_ptr, row_groups, row_mask, K,
            OFFSET, HAS_MINS, EVEN, EMULATE,
        )  # fmt: skip
    dots = tl.sum(dp4a(words, x_words[None], zero, EMULATE), axis=2)
    groups = g0 + tl.arange(0, BLOCK_G)
    mask = row_mask[:, None] & (groups[None, :] < K // 32)
    return _group_terms(
        dots, tl.sum(q_sums, axis=1), x_scales, tl.sum(x_sums, axis=1), scales_ptr, mins_ptr,
        row_groups + groups[None, :], mask, OFFSET, HAS_MINS, EVEN,
    )  # fmt: skip


@triton.jit
def _two_groups(
    words_a, words_b, SHIFT: tl.constexpr, x_words, x_scales, q_halves, x_halves, first,
    scales_ptr, mins_ptr, row_groups, row_mask, K, OFFSET: tl.constexpr,
    HAS_MINS: tl.constexpr, EVEN: tl.constexpr, EMULATE: tl.constexpr,
):  # fmt: skip
    """float32 [BLOCK_N, G]: a 32-column x group ([G, 8] words, [G] scales, [G, 2] sums
    over its halves) against two 16-column scale groups ``first`` and ``first + 1`` ([G]),
    whose codes ``words_a`` and ``words_b`` hold in place (bytes 0-1 and 2-3, times
    ``2^SHIFT``; other bytes zero)."""
    zero = tl.zeros(words_a.shape, dtype=tl.int32)
    q_a, q_b = tl.split(q_halves)
    sum_a, sum_b = tl.split(x_halves)
    dots_a = tl.sum(dp4a(words_a, x_words[None], zero, EMULATE), axis=2) >> SHIFT
    dots_b = tl.sum(dp4a(words_b, x_words[None], zero, EMULATE), axis=2) >> SHIFT
    at = row_groups + first[None, :]
    out = _group_terms(
        dots_a, q_a, x_scales, sum_a, scales_ptr, mins_ptr, at,
        row_mask[:, None] & (first[None, :] < K // 16), OFFSET, HAS_MINS, EVEN,
    )  # fmt: skip
    out += _group_terms(
        dots_b, q_b, x_scales, sum_b, scales_ptr, mins_ptr, at + 1,
        row_mask[:, None] & (first[None, :] + 1 < K // 16), OFFSET, HAS_MINS, EVEN,
    )  # fmt: skip
    return out


MIN_GPU_BLOCK_K = 512
"""Narrower slices are refused on the GPU: on H100s (sessions 18 and 21) several tiles of
128-256 columns gave relative errors of 0.1-10 ((8, 256, 1, 2), (8, 256, 1, 3),
(8, 128, 1, 3, 3), (16, 256, 2, 3, 2), (8, 256, 2, 3), (32, 256, 2, 3)) while others of
256 were right, and every tile of 512 or 1024 columns was right; the interpreter computes
them all right. A miscompile not pinned down; the default tiles are 512 wide."""


def gguf_gemv_int8(
    x: torch.Tensor,
    weight: PackedGguf,
    bias: torch.Tensor | None = None,
    config: GemvConfig | tuple[int, ...] | None = None,
) -> torch.Tensor:
    """``gguf_gemv``'s contract with x rounded to int8 per 32 columns (the module
    docstring): x [1, K] (unit-stride row) -> [1, N] in x's dtype."""
    cfg = default_gemv_config(weight, int8=True) if config is None else GemvConfig(*config)
    if cfg.block_k < MIN_GPU_BLOCK_K and x.is_cuda:
        raise ValueError(
            f"gguf_gemv_int8 has computed wrong sums on the GPU with slices under "
            f"{MIN_GPU_BLOCK_K} columns; use block_k >= {MIN_GPU_BLOCK_K} (got {tuple(cfg)})."
        )
    return launch_gemv("gguf_gemv_int8", _slice_terms, x, weight, bias, cfg)
