"""Reading a tile of keys and values from the paged cache, shared by both attention kernels.

The cache layout is ``[num_blocks, num_kv_heads, block_size, head_dim]``; position ``p`` of
a sequence lives at offset ``p % block_size`` of block ``table[p // block_size]``.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def load_kv_tile(
    key_cache_ptr, value_cache_ptr, table, head_base, n0, end, dims, dim_mask,
    cache_stride_block, cache_stride_slot, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Positions ``n0 .. n0 + BLOCK_N - 1``, which of them are below ``end``, and their
    keys and values ([BLOCK_N, BLOCK_D]; zeros at or past ``end``) of the kv head whose
    offset in a block is ``head_base``; ``table`` points at the sequence's block ids."""
    pos = n0 + tl.arange(0, BLOCK_N)
    pos_mask = pos < end
    block = tl.load(table + pos // BLOCK_SIZE, mask=pos_mask, other=0).to(tl.int64)
    rows = block * cache_stride_block + head_base + (pos % BLOCK_SIZE) * cache_stride_slot
    offsets = rows[:, None] + dims[None, :]
    kv_mask = pos_mask[:, None] & dim_mask[None, :]
    k = tl.load(key_cache_ptr + offsets, mask=kv_mask, other=0.0)
    v = tl.load(value_cache_ptr + offsets, mask=kv_mask, other=0.0)
    return pos, pos_mask, k, v
