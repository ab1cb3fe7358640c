"""Reading a tile of keys and values from the paged cache, shared by both attention kernels.

The cache layout is ``[num_blocks, num_kv_heads, block_size, head_dim]``; position ``p`` of
a sequence lives at offset ``p % block_size`` of block ``table[p // block_size]``. An FP8
cache's tiles are converted to the compute dtype in registers right after the load; the
kernels fold the per-tensor scales into the scores and the output (``fp8_scales``).

The decode and verification kernels also multiply an FP8 value tile by a run-time 1.0
before P @ V (``fp8_value_stager``): arithmetic that changes nothing, for the code it
makes. A tile cast straight from E4M3 reaches the dot through shared memory still in
E4M3, and P @ V's operand wants consecutive keys in each register while the cache holds
consecutive head dims; ``ldmatrix`` transposes only 16-bit elements, so Triton read the
values a byte at a time (``LDS.U8``) and packed them in pairs. A multiply it cannot see
through makes it stage the converted 16-bit tile instead and read it with a transposing
``ldmatrix``: the decode kernel's loop at W1's tiles went from 5.02 to 3.83
instructions per K/V element and from 255 registers to 211
(``tests/cuda/ptxas_decode_attention.py --sass``; a bf16 cache: 2.78). The prefill
kernel never read bytes there, and the multiply added 4% to its loop, so it has none.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def load_kv_tile(
    key_cache_ptr, value_cache_ptr, table, head_base, n0, end, dims, dim_mask,
    cache_stride_block, cache_stride_slot, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    COMPUTE_DTYPE: tl.constexpr,
):  # fmt: skip
    """Positions ``n0 .. n0 + BLOCK_N - 1``, which of them are below ``end``, and their
    keys and values ([BLOCK_N, BLOCK_D] in ``COMPUTE_DTYPE``, the query's; zeros at or
    past ``end``) of the kv head whose offset in a block is ``head_base``; ``table``
    points at the sequence's block ids. An FP8 cache's raw (unscaled) values are cast."""
    pos = n0 + tl.arange(0, BLOCK_N)
    pos_mask = pos < end
    block = tl.load(table + pos // BLOCK_SIZE, mask=pos_mask, other=0).to(tl.int64)
    rows = block * cache_stride_block + head_base + (pos % BLOCK_SIZE) * cache_stride_slot
    offsets = rows[:, None] + dims[None, :]
    kv_mask = pos_mask[:, None] & dim_mask[None, :]
    k = tl.load(key_cache_ptr + offsets, mask=kv_mask, other=0.0)
    v = tl.load(value_cache_ptr + offsets, mask=kv_mask, other=0.0)
    return pos, pos_mask, k.to(COMPUTE_DTYPE), v.to(COMPUTE_DTYPE)


@triton.jit
def fp8_scales(k_scale_ptr, v_scale_ptr, FP8: tl.constexpr):
    """(k_scale, v_scale) as float32 scalars for an FP8 cache; (1.0, 1.0) otherwise
    (nothing is loaded, and the kernels skip the multiplies under ``FP8`` anyway)."""
    if FP8:
        return tl.load(k_scale_ptr).to(tl.float32), tl.load(v_scale_ptr).to(tl.float32)
    else:
        return 1.0, 1.0


@triton.jit
def fp8_value_stager(v_scale, dtype: tl.constexpr):
    """1.0 in ``dtype``, computed at run time from the value scale (``v_scale /
    v_scale``) so the compiler cannot drop the multiply by it (the module docstring says
    why a kernel wants one). Multiplying a converted E4M3 value by it is exact."""
    return (v_scale / v_scale).to(dtype)


@triton.jit
def fp8_store_value(x, scale, out_dtype: tl.constexpr, FP8: tl.constexpr):
    """A new key or value as the cache stores it: ``saturate(x / scale)`` in float8 for an
    FP8 cache (E4M3FN has no infinity: an unclamped cast of a large value is NaN)."""
    if FP8:
        return tl.clamp(x.to(tl.float32) / scale, -448.0, 448.0).to(out_dtype)
    else:
        return x.to(out_dtype)
