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

The PV dot may go the same way (``pv_dot``, ``DecodeConfig.fp8_pv``): ``acc^T = V^T @
P^T`` with the head dims as M, on the E4M3 value tile and the weights times ``P_SCALE``
in E4M3. Otherwise it stays ``P @ V`` in float16 (the values converted in registers).

Status (session 13): opt-in (``PAGEDLM_FP8_DOTS``, ``decode_config.FP8_DOTS_ENV``), NOT
measured on a GPU; no GPU time was left. What was measured, offline (``PYTHONPATH=src
python tests/cuda/ptxas_decode_attention.py``: Triton 3.6 compiling for sm_90a, ptxas -v;
W1's shape, 512-key partitions): today's float16 path with 128-key tiles needs 255
registers per thread (2 programs of 4 warps per SM); with 64-key tiles 180 (2); the bf16
kernel's 64-key tiles 116 (4). E4M3 query dots alone do not help (255 registers, spills:
the values are still converted and held in registers). E4M3 query and PV dots: 128
(one-term query, 128-key tiles, 2 stages), 114 (3 stages), 105 (64-key tiles), 134 / 137
with the two-term query: 3 to 4 programs per SM, as the bf16 kernel has. The key tile
goes from shared memory into the MMA unconverted; the value tile is stored transposed
into shared memory from registers (one E4M3 copy, no float16 one).

Errors (interpreter, ``tests/cuda/test_fp8_kv_kernels.py::test_decode_with_fp8_dots``,
relative to a float64 reference of the dequantized cache; float16 path 2.0e-4): one-term
query 2.3e-3, two-term 2.1e-4, two-term with E4M3 PV 6.1e-3.

Deciding the default on the H200 (W1: today the float16 path is 181 us per call, 1.68
TB/s, against bf16's 185 us):

    python tests/cuda/bench_decode_attention.py --sweep --workloads W1 --num-heads 16
    PAGEDLM_FP8_DOTS=q2pv python -m pagedlm.benchmarks.w1_variants --targets fp8 \
        --output-json w1fp8.json

Prediction (unmeasured): with 3-4 programs per SM the E4M3 kernel keeps as many bytes in
flight as bf16's, so ~100-120 us per call (2.5-3 TB/s) for ``q2pv`` / ``q1pv``, and W1
with an FP8 cache ~1.3-1.45x bf16's. If it wins, set the winner in ``decode_config`` (and
check ``--targets logprobs`` for the end-to-end error).
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
