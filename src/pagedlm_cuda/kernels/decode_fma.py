"""Paged decode attention by float32 multiply-adds, one warp per program: the large-batch
variant of ``decode_attention``'s kernel (``DecodeConfig.fma_keys``).

Why: at large batches the decode kernel is meant to be bound by reading the cache, but its
tensor-core dots pad a group of ``num_heads // num_kv_heads`` query heads (2 for
Qwen3-0.6B) to 16 rows, and its four warps split each tile's keys, so every tile crosses
warps: the running max and sum through shared memory, P and the value tile staged there
for the second dot (11 barriers per 64-key tile on an FP8 cache, sm_90 SASS, session 29).
An FP8 tile's work then outlasts its bytes: the kernel took the same time per call on an
H100 and an H200 (docs/performance.md, session 29).

Here a program is one warp and a tile is ``[1, LANES, KEYS, head_dim]``: Triton lays it
out as each thread holding ``KEYS`` keys of one lane and 16 contiguous bytes of their
head dims, the warp's threads covering the lanes and the rest of the head dims. The
scores ``[group, LANES, KEYS]`` are float32 multiply-adds reduced over a thread's own dims
and then across the few threads sharing a key (shuffles); ``P @ V`` sums a thread's own
keys in the thread into an accumulator per lane, and the lanes meet once per partition.
No barrier, no shared memory in the key loop: on an FP8 cache 6.11 sm_90 instructions
per K/V element at 2 keys per thread (5.67 at 4), against the dot kernel's 4.63 of which
11 are barriers per tile (``tests/cuda/ptxas_decode_attention.py --fma-keys 1 2 4``). A
Gluon sketch of the same layout (``tests/cuda/gluon_decode_sketch.py``) took 128.7 us per
call at W1's shape on an H100 against the dot kernel's 143.5 (session 30). Triton keeps
this layout only because every tensor of the loop is the tile or the query broadcast to
four dimensions: with a 2-d tile and a 3-d product it chose layouts that reduce across
threads (12-44 instructions per element, session 29).

The programs and partitions are the dot kernel's at large batches: ``slots`` programs per
(sequence, kv head), program ``i`` taking partitions ``i, i + slots, ...`` (from the
sliding window's first), each partition's output and log2-sum-exp stored as a partial and
merged by ``_decode_merge_kernel``, which also gives padding rows (``seq_len == 0``) their
zeros. With ``new_kv`` the program holding the last position writes the step's key and
value (quantized for an FP8 cache) and attends to that position from them, as the dot
kernel does. An FP8 cache's key scale rides on the scores' scale and its value scale on
each partition's output. No fused rotary: the backend fuses it at small batches only.
"""

from __future__ import annotations

import triton
import triton.language as tl

from pagedlm_cuda.kernels import pdl
from pagedlm_cuda.kernels.kv_tile import fp8_scales, fp8_store_value
from pagedlm_cuda.kernels.score_mod import scaled_scores


def fma_lanes(head_dim: int, element_size: int) -> int:
    """Lanes of keys across a warp: the threads left once a key's head dims are spread
    over threads 16 bytes each (Triton's vector loads), at least 1."""
    threads_per_key = triton.cdiv(triton.next_power_of_2(head_dim) * element_size, 16)
    return max(1, 32 // threads_per_key)


@triton.jit
def _fma_bounds(
    p, seq_len, window, PARTITION: tl.constexpr, USE_WINDOW: tl.constexpr,
    WRITE_NEW: tl.constexpr,
):  # fmt: skip
    """Partition ``p``'s first key and the end of its keys read from the cache (the last
    position comes from ``new_kv`` when ``WRITE_NEW``)."""
    start = p * PARTITION
    end = tl.minimum(start + PARTITION, seq_len)
    if USE_WINDOW:
        start = tl.maximum(start, seq_len - window)
    if WRITE_NEW:
        end = tl.minimum(end, seq_len - 1)
    return start, end


@triton.jit
def _fma_tile(
    key_cache_ptr, value_cache_ptr, table, head_base, n0, cached_end, key_index, dims,
    dim_mask, cache_stride_block, cache_stride_slot, BLOCK_SIZE: tl.constexpr,
):  # fmt: skip
    """Keys and values ``n0 ..`` of a tile as stored ([1, LANES, KEYS, BLOCK_D], zeros at
    or past ``cached_end``) and which of them are visible ([1, LANES, KEYS])."""
    pos = (n0 + key_index)[None, :, :]
    visible = pos < cached_end
    block = tl.load(table + pos // BLOCK_SIZE, mask=visible, other=0).to(tl.int64)
    rows = block * cache_stride_block + head_base + (pos % BLOCK_SIZE) * cache_stride_slot
    offsets = rows[:, :, :, None] + dims
    tile_mask = visible[:, :, :, None] & dim_mask
    k = tl.load(key_cache_ptr + offsets, mask=tile_mask, other=0.0)
    v = tl.load(value_cache_ptr + offsets, mask=tile_mask, other=0.0)
    return k, v, visible


# Per-step sizes are not specialized on, so an eager step never compiles mid-run.
@triton.jit(do_not_specialize=["block_table_stride", "max_partitions", "slots"])
def _decode_fma_kernel(
    q_ptr, key_cache_ptr, value_cache_ptr, block_tables_ptr, seq_lens_ptr,
    new_key_ptr, new_value_ptr, slot_mapping_ptr, k_scale_ptr, v_scale_ptr,
    partial_out_ptr, partial_lse_ptr,
    q_stride_token, q_stride_head,
    new_key_stride_token, new_key_stride_head, new_value_stride_token, new_value_stride_head,
    cache_stride_block, cache_stride_head, cache_stride_slot, block_table_stride,
    max_partitions, slots, num_heads, score_scale, cap_log2e, window, group_size, head_dim,
    BLOCK_SIZE: tl.constexpr, PARTITION: tl.constexpr, LANES: tl.constexpr,
    KEYS: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
    WRITE_NEW: tl.constexpr, USE_WINDOW: tl.constexpr, USE_SOFT_CAP: tl.constexpr,
    FP8: tl.constexpr, PREFETCH: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    pdl.allow_next(USE_PDL)
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    slot = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    first_part = 0
    if USE_WINDOW:
        first_part = tl.maximum(seq_len - window, 0) // PARTITION
    num_parts = tl.cdiv(seq_len, PARTITION)
    part = first_part + slot
    if part >= num_parts:
        return  # the merge reads only partitions that hold a visible key

    # [BLOCK_G, 1, 1, BLOCK_D] query rows against [1, LANES, KEYS, BLOCK_D] tiles: every
    # tensor of the loop is one of these two shapes broadcast or reduced, so Triton keeps
    # the tile's layout (a key's dims in one thread, reduced there) for all of them.
    groups = tl.arange(0, BLOCK_G)[:, None, None, None]
    dims = tl.arange(0, BLOCK_D)[None, None, None, :]
    # Key ``key * LANES + lane`` of a tile sits at [0, lane, key].
    key_index = tl.arange(0, KEYS)[None, :] * LANES + tl.arange(0, LANES)[:, None]
    head_mask = groups < group_size
    dim_mask = dims < head_dim
    heads = kv_head * group_size + groups
    head_base = kv_head.to(tl.int64) * cache_stride_head
    table = block_tables_ptr + seq * block_table_stride
    k_scale, v_scale = fp8_scales(k_scale_ptr, v_scale_ptr, FP8)
    if FP8:
        score_scale = score_scale * k_scale  # one multiply per score, not one per key
    pdl.wait_for_previous(USE_PDL)

    new_part = num_parts - 1  # the partition that attends to the step's own key
    owns_last = (new_part - part) % slots == 0
    new_k = tl.zeros([1, 1, 1, BLOCK_D], tl.float32)  # without new_kv, unused
    new_v = tl.zeros([1, 1, 1, BLOCK_D], tl.float32)
    if WRITE_NEW:
        slot_id = tl.load(slot_mapping_ptr + seq, mask=owns_last, other=-1).to(tl.int64)
        new_mask = dim_mask & owns_last
        new_k_raw = tl.load(
            new_key_ptr + seq * new_key_stride_token + kv_head * new_key_stride_head + dims,
            mask=new_mask,
            other=0.0,
        )
        new_v_raw = tl.load(
            new_value_ptr + seq * new_value_stride_token + kv_head * new_value_stride_head + dims,
            mask=new_mask,
            other=0.0,
        )
        stored_k = fp8_store_value(new_k_raw, k_scale, key_cache_ptr.dtype.element_ty, FP8)
        stored_v = fp8_store_value(new_v_raw, v_scale, value_cache_ptr.dtype.element_ty, FP8)
        slot_row = (
            (slot_id // BLOCK_SIZE) * cache_stride_block
            + head_base
            + (slot_id % BLOCK_SIZE) * cache_stride_slot
        )
        write_mask = dim_mask & (slot_id >= 0)  # a padding row's slot is -1
        tl.store(key_cache_ptr + slot_row + dims, stored_k, mask=write_mask)
        tl.store(value_cache_ptr + slot_row + dims, stored_v, mask=write_mask)
        # Attended to as stored, as a later step reads it from the cache.
        new_k = stored_k.to(tl.float32)
        new_v = stored_v.to(tl.float32)

    q = tl.load(
        q_ptr + seq * q_stride_token + heads * q_stride_head + dims,
        mask=head_mask & dim_mask,
        other=0.0,
    ).to(tl.float32)
    for p in tl.range(part, num_parts, slots):
        start, cached_end = _fma_bounds(p, seq_len, window, PARTITION, USE_WINDOW, WRITE_NEW)
        m = tl.full([BLOCK_G, 1, 1], float("-inf"), tl.float32)
        denom = tl.zeros([BLOCK_G, 1, 1], tl.float32)
        acc = tl.zeros([BLOCK_G, LANES, 1, BLOCK_D], tl.float32)
        # Each tile starts at a visible key, so the running max is finite after it.
        if PREFETCH:
            k_next, v_next, visible_next = _fma_tile(
                key_cache_ptr, value_cache_ptr, table, head_base, start, cached_end,
                key_index, dims, dim_mask, cache_stride_block, cache_stride_slot, BLOCK_SIZE,
            )  # fmt: skip
        for n0 in range(start, cached_end, LANES * KEYS):
            if PREFETCH:
                k_raw, v_raw, visible = k_next, v_next, visible_next
                k_next, v_next, visible_next = _fma_tile(
                    key_cache_ptr, value_cache_ptr, table, head_base, n0 + LANES * KEYS,
                    cached_end, key_index, dims, dim_mask, cache_stride_block,
                    cache_stride_slot, BLOCK_SIZE,
                )  # fmt: skip
            else:
                k_raw, v_raw, visible = _fma_tile(
                    key_cache_ptr, value_cache_ptr, table, head_base, n0, cached_end,
                    key_index, dims, dim_mask, cache_stride_block, cache_stride_slot,
                    BLOCK_SIZE,
                )  # fmt: skip
            k = k_raw.to(tl.float32)
            v = v_raw.to(tl.float32)
            s = scaled_scores(tl.sum(q * k, axis=3), score_scale, cap_log2e, USE_SOFT_CAP)
            s = tl.where(visible, s, float("-inf"))  # [BLOCK_G, LANES, KEYS]
            tile_max = tl.max(tl.max(s, axis=2, keep_dims=True), axis=1, keep_dims=True)
            m_new = tl.maximum(m, tile_max)
            probs = tl.exp2(s - m_new)
            alpha = tl.exp2(m - m_new)
            lane_sums = tl.sum(probs, axis=2, keep_dims=True)
            denom = denom * alpha + tl.sum(lane_sums, axis=1, keep_dims=True)
            pv = tl.sum(probs[:, :, :, None] * v, axis=2, keep_dims=True)
            acc = acc * alpha[:, :, :, None] + pv
            m = m_new
        if WRITE_NEW:  # noqa: SIM102 - a compile-time switch around a runtime test
            if p == new_part:
                s_new = scaled_scores(
                    tl.sum(q * new_k, axis=3), score_scale, cap_log2e, USE_SOFT_CAP
                )  # [BLOCK_G, 1, 1]
                m_new = tl.maximum(m, s_new)
                p_new = tl.exp2(s_new - m_new)
                alpha = tl.exp2(m - m_new)
                denom = denom * alpha + p_new
                # The new key joins lane 0's sum (the lanes are added up below).
                lane0 = tl.arange(0, LANES)[None, :, None, None] == 0
                pv = tl.where(lane0, p_new[:, :, :, None] * new_v, 0.0)
                acc = acc * alpha[:, :, :, None] + pv
                m = m_new
        safe_denom = tl.where(denom > 0, denom, 1.0)
        out = tl.sum(acc, axis=1, keep_dims=True) / safe_denom[:, :, :, None]
        if FP8:
            out = out * v_scale
        row = (seq * num_heads + heads) * max_partitions + p  # [BLOCK_G, 1, 1, 1]
        tl.store(partial_out_ptr + row * head_dim + dims, out, mask=head_mask & dim_mask)
        lse_heads = kv_head * group_size + tl.arange(0, BLOCK_G)[:, None, None]
        lse_row = (seq * num_heads + lse_heads) * max_partitions + p  # [BLOCK_G, 1, 1]
        lse_mask = tl.arange(0, BLOCK_G)[:, None, None] < group_size
        tl.store(partial_lse_ptr + lse_row, m + tl.log2(safe_denom), mask=lse_mask)
