"""Attention scores from float8 tensor-core dots, for the decode kernel on an FP8 cache.

A decode program's dots have the group's query heads as one dimension (2 to 8 rows,
padded to 16) and a tile's keys as the other. With the heads as M, Triton on Hopper
takes the warp-level MMA (it needs M >= 64 for warpgroup MMA), whose operands live in
registers: every E4M3 key is converted to float16 in registers first, which is most of
the registers a program holds and so caps the programs (and bytes in flight) per SM.
With the keys as M (``scores^T = K @ q^T``) the dot is a warpgroup MMA on float8
operands: the key tile goes from shared memory straight into the tensor cores,
unconverted. That needs the query in E4M3 too:

- ``split = False``: ``q ~= scale * q8``, one E4M3 term per element (3 mantissa bits:
  a relative error of up to 1/16 per query element, as the keys have);
- ``split = True``: ``q ~= scale * (hi + lo / 16)``, a second E4M3 term holding the
  first one's rounding error (about 7 significant bits, near bfloat16's 8). The two
  terms are interleaved as rows ``2 g`` and ``2 g + 1`` of one operand, so one dot of
  twice the width computes both.

``scale`` is per query head: ``amax(|q|) / 448`` (E4M3's largest finite value).
"""

from __future__ import annotations

import triton
import triton.language as tl

E4M3_MAX = tl.constexpr(448.0)
SPLIT_RATIO = tl.constexpr(16.0)
"""``lo = (q / scale - hi) * 16``: the rounding error of ``hi`` (at most half a step, 16
at E4M3's top binade of 256 .. 448) scaled back into range (at most 256 < 448)."""

P_SCALE = tl.constexpr(256.0)
"""Softmax weights (at most 1) times 256 before they become E4M3: E4M3's subnormals end
at 2^-9, so unscaled weights below ~2^-10 would vanish (hundreds of them can carry much
of a flat distribution's mass); scaled, that floor is 2^-17."""


@triton.jit
def quantize_query(q, ROWS: tl.constexpr, DIMS: tl.constexpr, SPLIT: tl.constexpr):
    """``q`` [G, D] (``ROWS`` x ``DIMS``, any float dtype) -> (E4M3 operand [G, D], or
    [2 G, D] with ``SPLIT``; per-row float32 scale [G]). A zero row gets scale 1.0 (and zeros)."""
    q = q.to(tl.float32)
    amax = tl.max(tl.abs(q), axis=1)
    scale = tl.where(amax > 0.0, amax / E4M3_MAX, 1.0)
    scaled = tl.clamp(q / scale[:, None], -E4M3_MAX, E4M3_MAX)
    hi = scaled.to(tl.float8e4nv)
    if SPLIT:
        lo = ((scaled - hi.to(tl.float32)) * SPLIT_RATIO).to(tl.float8e4nv)
        pairs = tl.permute(tl.join(hi, lo), (0, 2, 1))  # [G, 2, D]
        return tl.reshape(pairs, [2 * ROWS, DIMS]), scale
    else:
        return hi, scale


@triton.jit
def keys_major_dots(k, q8, TILE: tl.constexpr, ROWS: tl.constexpr, SPLIT: tl.constexpr):
    """``scores^T`` [N, G] (``TILE`` x ``ROWS``; float32, before the query's and keys'
    scales) of an E4M3 key tile ``k`` [N, D] and ``quantize_query``'s operand."""
    dots = tl.dot(k, tl.trans(q8))  # [N, G] or [N, 2 G]
    if SPLIT:
        hi, lo = tl.split(tl.reshape(dots, [TILE, ROWS, 2]))
        return hi + lo * (1.0 / SPLIT_RATIO)
    else:
        return dots


@triton.jit
def pv_dot(v, p):
    """``V^T @ (P_SCALE * P)^T`` [D, G] (float32) of an E4M3 value tile ``v`` [N, D] and
    the tile's weights ``p`` [N, G] (float32, at most 1), as an E4M3 warpgroup MMA with
    the head dims as M."""
    return tl.dot(tl.trans(v), (p * P_SCALE).to(tl.float8e4nv))
