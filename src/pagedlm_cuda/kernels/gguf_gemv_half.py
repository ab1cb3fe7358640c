"""The batch-1 GEMV of 4-bit GGUF codes (scale per 32 columns: Q4_0, Q4_1, Q4_K) with
float16 products: two codes per instruction. The default batch-1 kernel for those layers.

Why: ``gguf_gemv`` turns each code into a float32 and multiplies it by x one weight at a
time (a logic op, an add and an FMA per weight: 4.7 loop instructions per weight in sm_90
SASS). An H200 streaming 4-bit codes at 4.8 TB/s reads ~8.5 G weights per ms, against
~33 G warp-lane instructions per ms it can issue, so that kernel cannot keep up with the
bytes there. On an H100 (session 33, Nsight Compute, llama-3-8b's gate/up projection) it
kept 49% of its issue slots busy and read 63% of the bandwidth.

Here a word's eight codes become four float16 pairs by the trick of ``slot_codes`` (a
code masked in place and OR-ed into the bits of 1024.0 is the float16 ``1024 + code``:
one ``lop3`` per pair), one ``sub``/``fma`` per pair leaves ``code - offset`` exactly, and
two pair multiply-adds per scale group take them against x: 13 instructions per eight
weights (``_WORD_PAIRS``). The pairs of ``WORDS_PER_SUM`` consecutive words (held by one
thread) are added in float16, then converted to float32 once, scaled and accumulated in
float32. 2.9-3.6 loop instructions per weight at the default tiles
(``tests/cuda/sass_gguf_gemv.py --half``).

Rounding: a lane's 8 products are summed by a multiply, multiply-adds and adds that each
round to float16 (11 significant bits); everything after is float32. x is scaled by 2^-8 on its
way to float16 (the scales take 2^8 back), so the sums cannot overflow below |x| = 1.3e5,
and x under 0.016 in magnitude, where float16 turns subnormal, keeps an absolute error
under 8e-6. The result, rounded to bf16, is as close to the float64 product as the exact
kernel's (``tests/cuda/test_gguf_gpu_kernels.py``: within 1.5e-3 relative of its error);
in float16 output the difference shows (a few of the output's units). Only 16-bit x takes
this path: float32 x (a float32 model) keeps the exact products, and so does any layer
with ``PAGEDLM_GGUF_EXACT_GEMV=1``.

Measured (session 33, H100, ``python tests/cuda/bench_gemv.py --kinds gguf4 gguf4h``, us
per call, weights past the L2): q/k/v 9.81 -> 8.04, o 8.06 -> 5.91, gate/up 31.72 ->
26.86 (82% of the H100's 3.35 TB/s), down 20.13 -> 15.45, LM head 115.25 -> 108.18; W2
on an 8B-shaped Q4_0 file (``python -m pagedlm.benchmarks.quantized_gpu --parts gguf``)
353.2 -> 431.8 tok/s, 1.86x -> 2.28x bf16's 189.8.
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
    gguf_gemv,
    launch_gemv,
    load_groups,
    slot_codes,
)

EXACT_GEMV_ENV = "PAGEDLM_GGUF_EXACT_GEMV"
"""Set to 1 to keep batch-1 GGUF layers on ``gguf_gemv``'s exact float32 products."""

X_SCALE = tl.constexpr(2.0**-8)
"""x's factor on its way to float16 (exact: a power of two); the scales take 2^8 back."""

WORDS_PER_SUM = tl.constexpr(4)
"""Consecutive words of a lane group whose float16 pair sums add up before float32."""

# One word's eight 4-bit codes against x: slot i of byte b (low nibble: slot b, high
# nibble: slot b + 4; ``gguf_gemv.slot_position``) times x's column of that slot. Masks
# 0x000F000F / 0x00F000F0 pick slots (0, 2) / (4, 6) of the word, and (1, 3) / (5, 7) of
# the word shifted down a byte, one per 16-bit half; OR-ed into 0x6400 (float16 1024.0)
# they are the float16 pairs 1024 + code and 1024 + 16 * code, and one sub / fma leaves
# code - offset. $0 and $1: float16 pairs (slots 0 + 1, slots 2 + 3) and (4 + 5, 6 + 7),
# each code times its x (the word's two scale groups); $2 the word, $3-$6 x's float16
# pairs (0, 2), (1, 3), (4, 6), (5, 7), the first of each in the low half.
_WORD_PAIRS = """{
.reg .b32 t, a, b, c, d, low_bias, sixteenth, high_bias;
mov.b32 low_bias, LOW_BIAS;
mov.b32 sixteenth, 0x2C002C00;
mov.b32 high_bias, HIGH_BIAS;
shr.u32 t, $2, 8;
lop3.b32 a, $2, 0x000F000F, 0x64006400, 0xEA;
lop3.b32 b, t, 0x000F000F, 0x64006400, 0xEA;
lop3.b32 c, $2, 0x00F000F0, 0x64006400, 0xEA;
lop3.b32 d, t, 0x00F000F0, 0x64006400, 0xEA;
sub.f16x2 a, a, low_bias;
sub.f16x2 b, b, low_bias;
fma.rn.f16x2 c, c, sixteenth, high_bias;
fma.rn.f16x2 d, d, sixteenth, high_bias;
mul.rn.f16x2 $0, a, $3;
fma.rn.f16x2 $0, b, $4, $0;
mul.rn.f16x2 $1, c, $5;
fma.rn.f16x2 $1, d, $6, $1;
}"""
# float16 bits: 1024 + offset (0x6400 + offset, the pair to subtract) and -(64 + offset)
# (what is left to subtract once 1024 + 16 * code is divided by 16).
_WORD_PAIRS_OFFSET_8 = tl.constexpr(
    _WORD_PAIRS.replace("LOW_BIAS", "0x64086408").replace("HIGH_BIAS", "0xD480D480")
)
_WORD_PAIRS_OFFSET_0 = tl.constexpr(
    _WORD_PAIRS.replace("LOW_BIAS", "0x64006400").replace("HIGH_BIAS", "0xD400D400")
)


@triton.jit
def _half_pairs(first, second):
    """float32 -> float16 pairs in int32 (``first`` in the low half), rounded to nearest."""
    return tl.inline_asm_elementwise(
        "cvt.rn.f16x2.f32 $0, $2, $1;", "=r,f,f", [first, second], dtype=tl.int32,
        is_pure=True, pack=1,
    )  # fmt: skip


@triton.jit
def _add_pairs(a, b):
    """float16 pairs (int32) added lane by lane, rounded to nearest."""
    return tl.inline_asm_elementwise(
        "add.rn.f16x2 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.int32, is_pure=True, pack=1
    )


@triton.jit
def _pair_total(pairs):
    """The float32 sum of a float16 pair's two lanes (int32 in)."""
    return tl.inline_asm_elementwise(
        """{
        .reg .b16 l, h;
        .reg .f32 a, b;
        mov.b32 {l, h}, $1;
        cvt.f32.f16 a, l;
        cvt.f32.f16 b, h;
        add.f32 $0, a, b;
        }""",
        "=f,r", [pairs], dtype=tl.float32, is_pure=True, pack=1,
    )  # fmt: skip


@triton.jit
def _to_half(values):
    """float32 rounded to float16 and back (the interpreter's float16 rounding)."""
    return values.to(tl.float16).to(tl.float32)


@triton.jit
def _add_halves(a, b):
    return _to_half(a + b)


@triton.jit
def _lane_sums(codes_a, x_a, codes_b, x_b, N: tl.constexpr, G: tl.constexpr):
    """The interpreter's float16 lane: ``fma(b, x_b, a * x_a)`` per word ([N, G, 8]),
    rounded as ``_WORD_PAIRS`` rounds, then summed over runs of ``WORDS_PER_SUM`` words
    in float16 as ``_add_pairs`` does: float32 [N, G, 8 / WORDS_PER_SUM]."""
    first = _to_half(codes_a * _to_half(x_a))
    lane = _to_half(first + codes_b * _to_half(x_b))
    runs = tl.reshape(lane, (N, G, LANES // WORDS_PER_SUM, WORDS_PER_SUM))
    return tl.reduce(runs, 3, _add_halves)


@triton.jit
def _slice_sums(
    words, x0, x1, x2, x3, x4, x5, x6, x7, OFFSET: tl.constexpr, EMULATE: tl.constexpr
):  # fmt: skip
    """float32 [N, G, 8 / WORDS_PER_SUM] twice: per run of ``WORDS_PER_SUM`` words
    (``words`` [N, G, 8]), the sums over slots 0-3 and over 4-7 of ``code - OFFSET`` times
    x (``x0`` .. ``x7``: the slots' x, float32 [G, 8], already times ``X_SCALE``), with
    ``_WORD_PAIRS``' float16 roundings and the runs' float16 sums."""
    N: tl.constexpr = words.shape[0]
    G: tl.constexpr = words.shape[1]
    RUNS: tl.constexpr = LANES // WORDS_PER_SUM
    if EMULATE:  # no inline assembly in the interpreter: the same roundings in tl ops
        magic = tl.full(words.shape, 0x4B000000, tl.int32)
        c0 = slot_codes(words, magic, 0, OFFSET, 4)
        c1 = slot_codes(words, magic, 1, OFFSET, 4)
        c2 = slot_codes(words, magic, 2, OFFSET, 4)
        c3 = slot_codes(words, magic, 3, OFFSET, 4)
        c4 = slot_codes(words, magic, 4, OFFSET, 4)
        c5 = slot_codes(words, magic, 5, OFFSET, 4)
        c6 = slot_codes(words, magic, 6, OFFSET, 4)
        c7 = slot_codes(words, magic, 7, OFFSET, 4)
        low = _lane_sums(c0, x0, c1, x1, N, G) + _lane_sums(c2, x2, c3, x3, N, G)
        high = _lane_sums(c4, x4, c5, x5, N, G) + _lane_sums(c6, x6, c7, x7, N, G)
        return low, high
    p02 = _half_pairs(x0, x2)
    p13 = _half_pairs(x1, x3)
    p46 = _half_pairs(x4, x6)
    p57 = _half_pairs(x5, x7)
    tl.static_assert(OFFSET == 0 or OFFSET == 8, "half products take offsets 0 and 8")
    if OFFSET == 8:
        low, high = tl.inline_asm_elementwise(
            _WORD_PAIRS_OFFSET_8, "=r,=r,r,r,r,r,r", [words, p02, p13, p46, p57],
            dtype=(tl.int32, tl.int32), is_pure=True, pack=1,
        )  # fmt: skip
    else:
        low, high = tl.inline_asm_elementwise(
            _WORD_PAIRS_OFFSET_0, "=r,=r,r,r,r,r,r", [words, p02, p13, p46, p57],
            dtype=(tl.int32, tl.int32), is_pure=True, pack=1,
        )  # fmt: skip
    low = tl.reduce(tl.reshape(low, (N, G, RUNS, WORDS_PER_SUM)), 3, _add_pairs)
    high = tl.reduce(tl.reshape(high, (N, G, RUNS, WORDS_PER_SUM)), 3, _add_pairs)
    return _pair_total(low), _pair_total(high)


@triton.jit
def _x_slot(x_ptr, columns, slot: tl.constexpr, K, EVEN_K: tl.constexpr):
    """float32 x of ``slot``'s columns ([G, 8]; zeros past K)."""
    cols = columns + 8 * slot
    if EVEN_K:
        return tl.load(x_ptr + cols).to(tl.float32)
    return tl.load(x_ptr + cols, mask=cols < K, other=0.0).to(tl.float32)


@triton.jit
def _slice_half_products(
    words, magic, x_ptr, scales_ptr, mins_ptr, rows, row_mask, g0, K, stride_groups,
    OFFSET: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr, HAS_MINS: tl.constexpr,
    BLOCK_G: tl.constexpr, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr, EMULATE: tl.constexpr,
):  # fmt: skip
    """``gemv_kernel``'s ``SLICE`` with float16 products (4-bit codes, 32 columns per
    scale): float32 [BLOCK_N, BLOCK_G, 8 / WORDS_PER_SUM], per (row, run of words) of the
    slice's ``words`` (lane groups ``g0 ..``), the sum of its weights times x."""
    tl.static_assert(BITS == 4 and GROUP == 32, "half products take 4-bit codes, 32 per scale")
    EVEN: tl.constexpr = EVEN_N and EVEN_K
    lane_groups = g0 + tl.arange(0, BLOCK_G)
    columns = lane_groups[:, None] * 64 + tl.arange(0, LANES)[None, :]  # slot 0, [G, 8]
    x0 = _x_slot(x_ptr, columns, 0, K, EVEN_K)
    x1 = _x_slot(x_ptr, columns, 1, K, EVEN_K)
    x2 = _x_slot(x_ptr, columns, 2, K, EVEN_K)
    x3 = _x_slot(x_ptr, columns, 3, K, EVEN_K)
    x4 = _x_slot(x_ptr, columns, 4, K, EVEN_K)
    x5 = _x_slot(x_ptr, columns, 5, K, EVEN_K)
    x6 = _x_slot(x_ptr, columns, 6, K, EVEN_K)
    x7 = _x_slot(x_ptr, columns, 7, K, EVEN_K)
    low, high = _slice_sums(
        words, x0 * X_SCALE, x1 * X_SCALE, x2 * X_SCALE, x3 * X_SCALE, x4 * X_SCALE,
        x5 * X_SCALE, x6 * X_SCALE, x7 * X_SCALE, OFFSET, EMULATE,
    )  # fmt: skip
    # A lane group's first scale group is its slots 0-3, its second 4-7.
    first = 2 * lane_groups
    at = rows.to(tl.int64)[:, None] * stride_groups + first[None, :]
    mask_a = row_mask[:, None] & (first[None, :] < K // 32)
    mask_b = row_mask[:, None] & (first[None, :] + 1 < K // 32)
    scale_a = load_groups(scales_ptr + at, mask_a, EVEN) * (1.0 / X_SCALE)
    scale_b = load_groups(scales_ptr + at + 1, mask_b, EVEN) * (1.0 / X_SCALE)
    out = low * scale_a[:, :, None] + high * scale_b[:, :, None]
    if HAS_MINS:
        min_a = load_groups(mins_ptr + at, mask_a, EVEN)
        min_b = load_groups(mins_ptr + at + 1, mask_b, EVEN)
        out += min_a[:, :, None] * _run_sums(x0 + x1 + x2 + x3)[None]
        out += min_b[:, :, None] * _run_sums(x4 + x5 + x6 + x7)[None]
    return out


@triton.jit
def _run_sums(values):
    """[G, 8] -> [G, 8 / WORDS_PER_SUM]: sums over runs of ``WORDS_PER_SUM`` words."""
    G: tl.constexpr = values.shape[0]
    runs = tl.reshape(values, (G, LANES // WORDS_PER_SUM, WORDS_PER_SUM))
    return tl.sum(runs, axis=2)


def half_gemv_enabled() -> bool:
    return os.environ.get(EXACT_GEMV_ENV, "0") != "1"


def takes_half_products(x: torch.Tensor, weight: PackedGguf) -> bool:
    """Whether ``gguf_gemv_half`` computes with float16 products (16-bit x, 4-bit codes
    with a scale per 32 columns and an offset of 0 or 8) rather than ``gguf_gemv``'s."""
    return (
        x.dtype in (torch.bfloat16, torch.float16)
        and weight.bits == 4
        and weight.group_size == 32
        and weight.offset in (0, 8)
    )


def gguf_gemv_half(
    x: torch.Tensor,
    weight: PackedGguf,
    bias: torch.Tensor | None = None,
    config: GemvConfig | tuple[int, ...] | None = None,
) -> torch.Tensor:
    """``gguf_gemv``'s contract, with float16 products where ``takes_half_products`` (the
    module docstring); anything else goes to ``gguf_gemv``."""
    if not takes_half_products(x, weight):
        return gguf_gemv(x, weight, bias, config)
    cfg = default_gemv_config(weight, half=True) if config is None else GemvConfig(*config)
    return launch_gemv("gguf_gemv_half", _slice_half_products, x, weight, bias, cfg)
