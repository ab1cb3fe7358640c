"""Paged decode attention: one query token per sequence, grouped-query aware, split-K.

Each program takes one (sequence, kv head, partition of ``PARTITION`` key positions) and
computes attention of all ``num_heads // num_kv_heads`` query heads sharing that kv head
at once (the group is the M dimension of the dot product, so keys are read once per group).
Long contexts are split into partitions that run in parallel, each storing its partial
result and log-sum-exp; the partials are then merged by log-sum-exp in a fixed order:

- small batches (``decode_config``'s ``merge_in_kernel``): in the same kernel. Each
  program takes a ticket from a per-(sequence, kv head) counter after storing; the one
  that draws the last ticket merges the group's partials and resets the counter to 0.
  One launch per layer: at batch 1 a separate merge kernel cost ~4 us per layer.
- large batches: in a merge kernel after it (there, a ticket and fence in every program
  cost more than the launch).

The step's new keys and values may be passed along (``new_kv``): the program whose
partition holds the last position writes them into the cache by slot and attends to that
position from them, which saves the separate KV-write kernel. The cached tiles stop before
that position and the new key is one extra step of the online softmax, so no tile is
edited between its load and its dot (editing them cost 25% of the kernel at batch 256:
the loads stopped being pipelined).

The partition size, tile and merge mode come from ``decode_config``: a function of the
batch size *bucket* (the CUDA-graph capture ladder) and the model's shapes, never of the
data, and so does the merge width. A sequence's result does depend on how many sequences
share its step, but only through the bucket: a graph replayed at padded size ``P`` and an
eager step of any batch that pads to ``P`` agree bit for bit. Small batches get one
program per partition of ``max_seq_len`` (max_model_len under a graph); programs past a
sequence's end exit at once. Large batches get ``config.slots`` programs per (sequence,
kv head), each looping over every slots-th partition, so the grid stays the batch's size
whatever max_model_len is; a partition is computed and merged the same either way, so
the bits do not depend on it.

Rotary embedding (``rotary``, a ``FusedRotary``; the Triton backend passes one at small
batches): every program rotates its query heads after loading them, and the program that
writes the new key rotates it first (both after Qwen3's q/k norms when given), with the
cos/sin row read before the PDL wait. It saves the separate rotary launch per layer.

Sliding window ``w``: the query at position ``seq_len - 1`` sees keys ``seq_len - w ..
seq_len - 1``; partitions wholly before that exit at once and the merge skips them.
Soft-cap ``c``: scores become ``c * tanh(s / c)`` before the softmax. Attention sinks
(gpt-oss: a logit per query head that joins the softmax's denominator with no value) are
one more online-softmax term, folded in where a head's sums are final: by the partition
itself with one partition, else by the merge, so a partial's log-sum-exp stays its keys'
own (``fold_sinks``). All three are constexpr switches, so the common path compiles
without them.

FP8 cache (a third switch): tiles are cast to float16 after loading (one hardware convert
per pair of E4M3 values; bfloat16 takes a longer path, and the bf16 kernel's speed in
bytes was not reached with it), the query too (clamped to float16's range), and both dots
run in float16 with float32 accumulation. ``k_scale`` is folded into the scores' scale
(one multiply per score: 4.52 -> 4.45 loop instructions per K/V element at W1's 64-key
tiles, session 27), each partition's output is multiplied by ``v_scale``, and the value
tiles by a run-time 1.0 that makes the compiler stage them in 16 bits
(``kv_tile.fp8_value_stager``: the loop went from 5.02 to 3.83 instructions per K/V
element at W1's 128-key tiles, and from 255 registers to 211).
The new token's K/V are quantized (saturating) before they are written, and the new key
is attended to from its quantized value, as a later step reads it from the cache.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedlm.attention.backend import FusedRotary
from pagedlm.kv_cache.fp8 import is_fp8
from pagedlm_cuda.kernels import pdl
from pagedlm_cuda.kernels.decode_config import DecodeConfig, decode_config
from pagedlm_cuda.kernels.kv_tile import (
    fp8_scales,
    fp8_store_value,
    fp8_value_stager,
    load_kv_tile,
)
from pagedlm_cuda.kernels.rotary import fused_angles, fused_rotary_args, rotate_loaded
from pagedlm_cuda.kernels.score_mod import scaled_scores, score_args

MERGE_TILE = 16384
"""Most fp32 partials the merging program holds at once (group x partitions x head_dim).
Measured at W2's shape (batch 1, group 4, head_dim 128, 1,280 keys in 40 partitions, 32
layers in a graph): 8,192 (3 chunks) 8.5 us per layer, 16,384 (2 chunks) 6.6, 32,768 (1
chunk, registers spilled) 11.4."""

MERGE_CONTEXT = 2048
"""No more partitions per chunk than a 2k-token context has: with long partitions (large
batches) a wide chunk would only cost registers in the whole kernel."""

_counters: dict[torch.device, torch.Tensor] = {}


def merge_counters(device: torch.device, size: int) -> torch.Tensor:
    """The zeroed int32 ticket counters of ``device`` (at least ``size``). Every decode
    call leaves them at 0 again, so one buffer serves every layer and step; calls on one
    device must not overlap (one stream per device, as the model runner has). It only
    grows, and never while a graph is captured: the CUDA-graph runner runs each size once
    eagerly before capturing it, largest first."""
    counters = _counters.get(device)
    if counters is None or counters.numel() < size:
        counters = torch.zeros(max(size, 1024), dtype=torch.int32, device=device)
        _counters[device] = counters
    return counters


@triton.jit
def fold_sinks(m, denom, acc, sinks_ptr, heads, head_mask):
    """An online softmax's (running max [M], denominator [M], unnormalized output [M, D])
    of query heads ``heads`` [M] (log2 domain) with each head's sink added as one more
    term: its logit (natural units, read from ``sinks_ptr``) joins the max and the
    denominator, and no value joins the output. For sums that are final, right before
    the division."""
    sink = tl.load(sinks_ptr + heads, mask=head_mask, other=0.0).to(tl.float32)
    sink = sink * 1.4426950408889634  # log2(e): scores are in the log2 domain
    m_new = tl.maximum(m, sink)
    alpha = tl.exp2(m - m_new)  # m may be -inf (no key): 0, and m_new is finite
    return m_new, denom * alpha + tl.exp2(sink - m_new), acc * alpha[:, None]


@triton.jit
def _merge_group(
    out_ptr, partial_out_ptr, partial_lse_ptr, seq, kv_head, first, num_parts,
    out_stride_token, out_stride_head, max_partitions, num_heads, group_size, head_dim,
    sinks_ptr, MERGE_G: tl.constexpr, MERGE_P: tl.constexpr, BLOCK_D: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):  # fmt: skip
    """Combine partitions ``first .. num_parts - 1`` of the group's heads by their
    log-sum-exp, ``MERGE_P`` partitions at a time in order, with a running max; then the
    heads' sinks (``HAS_SINKS``)."""
    groups = tl.arange(0, MERGE_G)
    heads = kv_head * group_size + groups
    head_mask = groups < group_size
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < head_dim
    base = (seq * num_heads + heads) * max_partitions  # [G]
    top = tl.full([MERGE_G], float("-inf"), tl.float32)
    denom = tl.zeros([MERGE_G], tl.float32)
    acc = tl.zeros([MERGE_G, BLOCK_D], tl.float32)
    for p0 in range(first, num_parts, MERGE_P):
        parts = p0 + tl.arange(0, MERGE_P)
        mask = head_mask[:, None] & (parts < num_parts)[None, :]  # [G, P]
        rows = base[:, None] + parts[None, :]
        # Other programs wrote these: read through to L2, past this SM's L1.
        lse = tl.load(partial_lse_ptr + rows, mask=mask, other=float("-inf"), cache_modifier=".cg")
        partial = tl.load(
            partial_out_ptr + rows[:, :, None] * head_dim + dims[None, None, :],
            mask=mask[:, :, None] & dim_mask[None, None, :],
            other=0.0,
            cache_modifier=".cg",
        )
        # Every chunk holds at least one real partition per real head, so the new max
        # is finite there; padded head rows stay at -inf and are masked out below.
        new_top = tl.maximum(top, tl.max(lse, axis=1))
        safe_top = tl.where(head_mask, new_top, 0.0)
        alpha = tl.where(head_mask, tl.exp2(top - safe_top), 0.0)
        weight = tl.where(mask, tl.exp2(lse - safe_top[:, None]), 0.0)
        denom = denom * alpha + tl.sum(weight, axis=1)
        acc = acc * alpha[:, None] + tl.sum(partial * weight[:, :, None], axis=1)
        top = new_top
    if HAS_SINKS:
        top, denom, acc = fold_sinks(top, denom, acc, sinks_ptr, heads, head_mask)
    out = acc / tl.where(denom > 0, denom, 1.0)[:, None]
    dst = out_ptr + seq * out_stride_token + heads[:, None] * out_stride_head + dims[None, :]
    tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=head_mask[:, None] & dim_mask[None, :])


@triton.jit
def _partition_bounds(
    part, seq_len, window, PARTITION: tl.constexpr, USE_WINDOW: tl.constexpr,
    WRITE_NEW: tl.constexpr,
):  # fmt: skip
    """Partition ``part``'s first key and the end of its keys read from the cache: with
    ``WRITE_NEW`` the last position is not (it comes from ``new_kv``). Empty (start >=
    end) past the sequence's end."""
    start = part * PARTITION
    end = tl.minimum(start + PARTITION, seq_len)
    if USE_WINDOW:
        start = tl.maximum(start, seq_len - window)
    if WRITE_NEW:
        end = tl.minimum(end, seq_len - 1)
    return start, end


@triton.jit
def _attend_tile(
    q, k, v, pos_mask, m, denom, acc, score_scale, cap_log2e, stager,
    USE_SOFT_CAP: tl.constexpr, FP8: tl.constexpr,
):  # fmt: skip
    """One online-softmax step over a tile; the tile holds at least one visible key.
    ``stager``: an FP8 cache's ``fp8_value_stager``; an FP8 cache's key scale is already
    in ``score_scale``."""
    dots = tl.dot(q, tl.trans(k))
    s = scaled_scores(dots, score_scale, cap_log2e, USE_SOFT_CAP)
    s = tl.where(pos_mask[None, :], s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, axis=1))
    p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m - m_new)
    denom = denom * alpha + tl.sum(p, axis=1)
    if FP8:
        v = v * stager  # exact: for the code it makes (kv_tile)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, denom, acc


@triton.jit
def _attend_partition(
    q, k, v, pos_mask, start, cached_end, key_cache_ptr, value_cache_ptr, table, head_base,
    dims, dim_mask, cache_stride_block, cache_stride_slot, score_scale, cap_log2e, stager,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, COMPUTE_DTYPE: tl.constexpr,
    USE_SOFT_CAP: tl.constexpr, FP8: tl.constexpr, PRELOADED: tl.constexpr,
):  # fmt: skip
    """The online softmax over the cached keys ``start .. cached_end - 1``: (running max,
    denominator, unnormalized output). ``PRELOADED``: ``k``, ``v`` and ``pos_mask`` are
    already the first tile (else they are not used)."""
    m = tl.full([q.shape[0]], float("-inf"), tl.float32)
    denom = tl.zeros([q.shape[0]], tl.float32)
    acc = tl.zeros([q.shape[0], q.shape[1]], tl.float32)
    # Every tile starts at a visible key (start is the window's first when windowed), so
    # each row's running max is finite after the first tile. A partition may have no
    # cached tile (only the new key, or a padding row of the direct path).
    first = start
    if PRELOADED:
        if start < cached_end:
            m, denom, acc = _attend_tile(
                q, k, v, pos_mask, m, denom, acc, score_scale, cap_log2e, stager,
                USE_SOFT_CAP, FP8,
            )  # fmt: skip
        first = start + BLOCK_N
    for n0 in range(first, cached_end, BLOCK_N):
        _pos, pos_mask, k, v = load_kv_tile(
            key_cache_ptr, value_cache_ptr, table, head_base, n0, cached_end, dims, dim_mask,
            cache_stride_block, cache_stride_slot, BLOCK_SIZE, BLOCK_N, COMPUTE_DTYPE,
        )  # fmt: skip
        m, denom, acc = _attend_tile(
            q, k, v, pos_mask, m, denom, acc, score_scale, cap_log2e, stager,
            USE_SOFT_CAP, FP8,
        )  # fmt: skip
    return m, denom, acc


@triton.jit
def _finish_partition(
    m, denom, acc, part, new_part, q, new_k, new_v, score_scale, cap_log2e, v_scale,
    out_ptr, partial_out_ptr, partial_lse_ptr, seq, heads, head_mask, dims, dim_mask,
    out_stride_token, out_stride_head, max_partitions, num_heads, head_dim, sinks_ptr,
    USE_SOFT_CAP: tl.constexpr, FP8: tl.constexpr, DIRECT: tl.constexpr,
    WRITE_NEW: tl.constexpr, HAS_SINKS: tl.constexpr,
):  # fmt: skip
    """Partition ``part``'s result: the new key attended to if it is ``new_part``, then
    stored, as the output (``DIRECT``, the sinks folded in first) or as a partial and its
    log-sum-exp (the merge folds the sinks in)."""
    if WRITE_NEW:  # noqa: SIM102 - a compile-time switch around a runtime test
        if part == new_part:
            # The new key, in float32 (the tiles' dots take bf16 p; here p stays float32).
            dots = tl.sum(q.to(tl.float32) * new_k.to(tl.float32)[None, :], axis=1)
            s_new = scaled_scores(dots, score_scale, cap_log2e, USE_SOFT_CAP)
            m_new = tl.maximum(m, s_new)
            p_new = tl.exp2(s_new - m_new)
            alpha = tl.exp2(m - m_new)
            denom = denom * alpha + p_new
            acc = acc * alpha[:, None] + p_new[:, None] * new_v.to(tl.float32)[None, :]
            m = m_new
    if DIRECT and HAS_SINKS:
        m, denom, acc = fold_sinks(m, denom, acc, sinks_ptr, heads, head_mask)
    safe_denom = tl.where(denom > 0, denom, 1.0)
    out = acc / safe_denom[:, None]
    if FP8:
        out = out * v_scale
    mask = head_mask[:, None] & dim_mask[None, :]
    if DIRECT:
        dst = out_ptr + seq * out_stride_token + heads[:, None] * out_stride_head + dims[None, :]
        tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        row = (seq * num_heads + heads) * max_partitions + part
        tl.store(partial_out_ptr + row[:, None] * head_dim + dims[None, :], out, mask=mask)
        tl.store(partial_lse_ptr + row, m + tl.log2(safe_denom), mask=head_mask)


# Per-step sizes are not specialized on (Triton would compile a variant for each value's
# divisibility by 16), so an eager step never compiles mid-run.
@triton.jit(do_not_specialize=["block_table_stride", "max_partitions", "slots"])
def _decode_kernel(
    q_ptr, key_cache_ptr, value_cache_ptr, block_tables_ptr, seq_lens_ptr,
    new_key_ptr, new_value_ptr, slot_mapping_ptr, k_scale_ptr, v_scale_ptr,
    out_ptr, partial_out_ptr, partial_lse_ptr, counters_ptr,
    positions_ptr, cos_sin_ptr, q_norm_ptr, k_norm_ptr, sinks_ptr,
    q_stride_token, q_stride_head, out_stride_token, out_stride_head,
    new_key_stride_token, new_key_stride_head, new_value_stride_token, new_value_stride_head,
    cache_stride_block, cache_stride_head, cache_stride_slot, block_table_stride,
    max_partitions, slots, num_heads, num_kv_heads, score_scale, cap_log2e, window,
    group_size, head_dim, cos_sin_stride, norm_eps,
    BLOCK_SIZE: tl.constexpr, PARTITION: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, MERGE_G: tl.constexpr,
    MERGE_P: tl.constexpr, MERGE_IN_KERNEL: tl.constexpr, DIRECT: tl.constexpr,
    LOOP: tl.constexpr, WRITE_NEW: tl.constexpr, USE_WINDOW: tl.constexpr, USE_SOFT_CAP: tl.constexpr,
    FP8: tl.constexpr, COMPUTE_DTYPE: tl.constexpr, ROTARY: tl.constexpr,
    IS_NEOX: tl.constexpr, QK_NORM: tl.constexpr, USE_PDL: tl.constexpr,
    HAS_SINKS: tl.constexpr = False,
):  # fmt: skip
    pdl.allow_next(USE_PDL)
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    slot = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    # This program's partitions: first_part + slot, then every slots-th after it.
    first_part = 0
    if USE_WINDOW:
        first_part = tl.maximum(seq_len - window, 0) // PARTITION
    num_parts = tl.cdiv(seq_len, PARTITION)
    if DIRECT:  # one partition, and a padding row (seq_len 0) still gets its zeros
        num_parts = tl.maximum(num_parts, 1)
    part = first_part + slot
    groups = tl.arange(0, BLOCK_G)
    dims = tl.arange(0, BLOCK_D)
    heads = kv_head * group_size + groups
    head_mask = groups < group_size
    dim_mask = dims < head_dim
    if not DIRECT and part >= num_parts:
        if seq_len == 0 and slot == 0:  # a padding row: zeros, as the direct path gives
            pdl.wait_for_previous(USE_PDL)
            dst = out_ptr + seq * out_stride_token + heads[:, None] * out_stride_head
            zeros = tl.zeros([BLOCK_G, BLOCK_D], out_ptr.dtype.element_ty)
            tl.store(dst + dims[None, :], zeros, mask=head_mask[:, None] & dim_mask[None, :])
        return  # the merge reads only partitions that hold a visible key

    # With new_kv the last position comes from there, not from the cache: the tiles stop
    # before it (a tile is never edited between its load and its dot, which keeps the
    # loads pipelined) and it is attended to as one extra key below.
    last_part = num_parts - 1
    # With one partition per program, its first tile's keys and values are read before
    # waiting for the kernel that produced q: the metadata comes from host copies and the
    # cached positions from earlier steps (each forward begins with a torch kernel, which
    # waits for everything before it).
    head_base = kv_head.to(tl.int64) * cache_stride_head
    table = block_tables_ptr + seq * block_table_stride
    compute_dtype = COMPUTE_DTYPE
    start, cached_end = _partition_bounds(part, seq_len, window, PARTITION, USE_WINDOW, WRITE_NEW)
    _pos, pos_mask, k, v = load_kv_tile(
        key_cache_ptr, value_cache_ptr, table, head_base, start, cached_end, dims, dim_mask,
        cache_stride_block, cache_stride_slot, BLOCK_SIZE, BLOCK_N, compute_dtype,
    )  # fmt: skip
    k_scale, v_scale = fp8_scales(k_scale_ptr, v_scale_ptr, FP8)
    stager = 1.0
    if FP8:
        stager = fp8_value_stager(v_scale, compute_dtype)
        # Every score is scaled: the key scale rides on it (one multiply per score, not two).
        score_scale = score_scale * k_scale
    if ROTARY:  # positions come from a host copy, and the table never changes
        position = tl.load(positions_ptr + seq + tl.zeros([1], tl.int64)).to(tl.int64)
        partner, cos, signed_sin = fused_angles(
            cos_sin_ptr, position, cos_sin_stride, dims, BLOCK_D // 2, IS_NEOX
        )  # fmt: skip
    pdl.wait_for_previous(USE_PDL)

    # The partition that attends to the new key (none for a padding row), and whether it
    # is this program's.
    new_part = tl.where(seq_len > 0, last_part, -1)
    owns_last = (new_part >= part) & ((new_part - part) % slots == 0)
    new_k = 0.0  # without new_kv, unused
    new_v = 0.0
    if WRITE_NEW:
        # Only the program holding the new token's partition writes it (no other reads it).
        slot_id = tl.load(slot_mapping_ptr + seq, mask=owns_last, other=-1).to(tl.int64)
        new_k_row = new_key_ptr + seq * new_key_stride_token + kv_head * new_key_stride_head
        new_k = tl.load(new_k_row + dims, mask=dim_mask & owns_last, other=0.0)
        if ROTARY:
            new_k = rotate_loaded(
                new_k[None, :], new_k_row, owns_last, partner, cos, signed_sin, k_norm_ptr,
                norm_eps, dims, head_dim, QK_NORM,
            )  # fmt: skip
            new_k = tl.reshape(new_k, (BLOCK_D,))
        new_k = fp8_store_value(new_k, k_scale, key_cache_ptr.dtype.element_ty, FP8)
        new_v = tl.load(
            new_value_ptr + seq * new_value_stride_token + kv_head * new_value_stride_head + dims,
            mask=dim_mask & owns_last,
            other=0.0,
        )
        new_v = fp8_store_value(new_v, v_scale, value_cache_ptr.dtype.element_ty, FP8)
        slot_row = (
            (slot_id // BLOCK_SIZE) * cache_stride_block
            + head_base
            + (slot_id % BLOCK_SIZE) * cache_stride_slot
        )
        write_mask = dim_mask & (slot_id >= 0)  # a padding row's slot is -1
        tl.store(key_cache_ptr + slot_row + dims, new_k, mask=write_mask)
        tl.store(value_cache_ptr + slot_row + dims, new_v, mask=write_mask)

    q_rows = q_ptr + seq * q_stride_token + heads[:, None] * q_stride_head
    q_mask = head_mask[:, None] & dim_mask[None, :]
    q = tl.load(q_rows + dims[None, :], mask=q_mask, other=0.0)
    if ROTARY:
        q = rotate_loaded(
            q, q_rows, q_mask, partner, cos, signed_sin, q_norm_ptr, norm_eps, dims, head_dim,
            QK_NORM,
        )  # fmt: skip
    if FP8:
        q = tl.clamp(q.to(tl.float32), -65504.0, 65504.0).to(compute_dtype)
    if LOOP:
        # Each partition reads all of its tiles. Without disable_licm the loop over them
        # held 158 registers against 116 (bf16, W1's tiles: 3 programs per SM, not 4), and
        # carrying a prefetched first tile from one partition to the next, 189.
        for p in tl.range(part, num_parts, slots, disable_licm=True):
            start, cached_end = _partition_bounds(
                p, seq_len, window, PARTITION, USE_WINDOW, WRITE_NEW
            )  # fmt: skip
            m, denom, acc = _attend_partition(
                q, k, v, pos_mask, start, cached_end, key_cache_ptr, value_cache_ptr, table,
                head_base, dims, dim_mask, cache_stride_block, cache_stride_slot, score_scale,
                cap_log2e, stager, BLOCK_SIZE, BLOCK_N, compute_dtype, USE_SOFT_CAP, FP8,
                PRELOADED=False,
            )  # fmt: skip
            _finish_partition(
                m, denom, acc, p, new_part, q, new_k, new_v, score_scale, cap_log2e, v_scale,
                out_ptr, partial_out_ptr, partial_lse_ptr, seq, heads, head_mask, dims,
                dim_mask, out_stride_token, out_stride_head, max_partitions, num_heads,
                head_dim, sinks_ptr, USE_SOFT_CAP, FP8, DIRECT, WRITE_NEW, HAS_SINKS,
            )  # fmt: skip
    else:
        m, denom, acc = _attend_partition(
            q, k, v, pos_mask, start, cached_end, key_cache_ptr, value_cache_ptr, table,
            head_base, dims, dim_mask, cache_stride_block, cache_stride_slot, score_scale,
            cap_log2e, stager, BLOCK_SIZE, BLOCK_N, compute_dtype, USE_SOFT_CAP, FP8,
            PRELOADED=True,
        )  # fmt: skip
        _finish_partition(
            m, denom, acc, part, new_part, q, new_k, new_v, score_scale, cap_log2e, v_scale,
            out_ptr, partial_out_ptr, partial_lse_ptr, seq, heads, head_mask, dims, dim_mask,
            out_stride_token, out_stride_head, max_partitions, num_heads, head_dim, sinks_ptr,
            USE_SOFT_CAP, FP8, DIRECT, WRITE_NEW, HAS_SINKS,
        )  # fmt: skip
    if not DIRECT and MERGE_IN_KERNEL:
        # Every thread's stores land before the ticket (release); the last ticket's holder
        # sees all of them (acquire). One ticket per program that had a partition.
        tl.debug_barrier()
        counter = counters_ptr + seq * num_kv_heads + kv_head
        ticket = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
        if ticket == tl.minimum(num_parts - first_part, slots) - 1:
            tl.store(counter, 0)
            _merge_group(
                out_ptr, partial_out_ptr, partial_lse_ptr, seq, kv_head, first_part,
                num_parts, out_stride_token, out_stride_head, max_partitions, num_heads,
                group_size, head_dim, sinks_ptr, MERGE_G=MERGE_G, MERGE_P=MERGE_P,
                BLOCK_D=BLOCK_D, HAS_SINKS=HAS_SINKS,
            )  # fmt: skip


@triton.jit(do_not_specialize=["max_partitions"])
def _decode_merge_kernel(
    out_ptr, partial_out_ptr, partial_lse_ptr, seq_lens_ptr,
    out_stride_token, out_stride_head, max_partitions, num_heads, group_size, head_dim,
    window, PARTITION: tl.constexpr, MERGE_G: tl.constexpr, MERGE_P: tl.constexpr,
    BLOCK_D: tl.constexpr, USE_WINDOW: tl.constexpr, USE_PDL: tl.constexpr,
    sinks_ptr=None, HAS_SINKS: tl.constexpr = False,
):  # fmt: skip
    """The merge as a kernel of its own, one program per (sequence, kv head); a padding
    row (no partitions) gets zeros."""
    pdl.start(USE_PDL)
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq)
    first = 0
    if USE_WINDOW:
        first = tl.maximum(seq_len - window, 0) // PARTITION
    _merge_group(
        out_ptr, partial_out_ptr, partial_lse_ptr, seq, kv_head, first,
        tl.cdiv(seq_len, PARTITION), out_stride_token, out_stride_head, max_partitions,
        num_heads, group_size, head_dim, sinks_ptr, MERGE_G=MERGE_G, MERGE_P=MERGE_P,
        BLOCK_D=BLOCK_D, HAS_SINKS=HAS_SINKS,
    )  # fmt: skip


def register_cap(max_registers: int) -> dict:
    """Launch options capping a kernel's registers per thread (none for 0)."""
    return {"maxnreg": max_registers} if max_registers else {}


_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


def paged_decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_seq_len: int,
    out: torch.Tensor | None = None,
    partition_size: int | None = None,
    block_n: int | None = None,
    *,
    new_kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    config: DecodeConfig | None = None,
    rotary: FusedRotary | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of each sequence's one new token over its cached keys (positions
    ``0 .. seq_lens[i]-1``).

    query: [num_seqs, num_heads, head_dim]; key_cache, value_cache: [num_blocks,
    num_kv_heads, block_size, head_dim]; block_tables: [num_seqs, max_blocks] int32;
    seq_lens: [num_seqs] int32; max_seq_len: an upper bound of ``seq_lens`` (it sizes the
    grid; under a CUDA graph pass max_model_len). Returns [num_seqs, num_heads, head_dim].
    ``new_kv`` None: the new token's K/V must already be in the cache; else ``(key,
    value, slot_mapping)`` ([num_seqs, num_kv_heads, head_dim] each, unit-stride last
    dim; [num_seqs] slots, -1 for none) are written at their slots here and used for
    the last position. A sequence with ``seq_len == 0`` (padding) gets zeros.
    ``sliding_window`` ``w``: only the last ``w`` keys; ``logits_soft_cap`` ``c``: scores
    ``c * tanh(s / c)``. ``partition_size`` / ``block_n`` None: from
    ``decode_config(num_seqs, ...)``; given, they override it (tests), and
    ``partition_size`` must be a multiple of ``block_n``. ``config`` None: the batch
    bucket's; given, every launch uses it whatever the batch (batch-invariant mode). A
    float8 cache needs ``k_scale``/``v_scale`` (float32 [1]).
    ``rotary``: the query and ``new_kv``'s keys are not rotated yet; each program rotates
    (and with ``qk_norm`` first normalizes) its query heads, and the program that writes
    the new key rotates it before storing it (``FusedRotary``; ``positions`` one per
    sequence). Needs ``new_kv`` and a power-of-two ``head_dim`` of at least 16.
    ``sinks``: [num_heads] logits (contiguous, any float dtype), each joining its head's
    softmax denominator with no value (gpt-oss's attention sinks).
    """
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads, block_size = key_cache.shape[1], key_cache.shape[2]
    group_size = num_heads // num_kv_heads
    if out is None:
        out = torch.empty_like(query)
    if num_seqs == 0:
        return out
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1, got {sliding_window}.")
    check_sinks(sinks, num_heads)
    fp8 = is_fp8(key_cache.dtype)
    if config is None:
        config = decode_config(num_seqs, num_kv_heads, head_dim, fp8)
    if fp8 and (k_scale is None or v_scale is None):
        raise ValueError("an FP8 KV cache needs k_scale and v_scale.")
    partition = partition_size or config.partition
    if block_n is None:
        block_n = min(config.block_n, partition)
    if partition % block_n:
        raise ValueError(f"partition_size={partition} must be a multiple of block_n={block_n}.")
    if new_kv is not None:
        new_key, new_value, slot_mapping = new_kv
        if new_key.stride(-1) != 1 or new_value.stride(-1) != 1:
            raise ValueError("new_kv's key and value need a unit-stride head dim.")
    else:
        new_key = new_value = query  # unused
        slot_mapping = seq_lens
    rotary_args, rotary_flags = fused_rotary_args(rotary, head_dim, new_kv is not None, seq_lens)
    positions, cos_sin, q_norm, k_norm, cos_sin_stride, norm_eps = rotary_args
    max_partitions = max(1, triton.cdiv(max_seq_len, partition))
    direct = max_partitions == 1
    # config.slots programs per (sequence, kv head), each looping over its partitions; 0:
    # one per partition (a grid sized by max_seq_len), each reading its first tile early.
    loop = config.slots > 0 and not direct
    slots = min(config.slots, max_partitions) if loop else max_partitions
    counters = seq_lens  # unused unless the kernel merges its own partitions
    if direct:
        partial_out = partial_lse = out  # unused
    else:
        partial_out = torch.empty(
            (num_seqs, num_heads, max_partitions, head_dim),
            dtype=torch.float32,
            device=query.device,
        )
        partial_lse = torch.empty(
            (num_seqs, num_heads, max_partitions), dtype=torch.float32, device=query.device
        )
        if config.merge_in_kernel:
            counters = merge_counters(query.device, num_seqs * num_kv_heads)
    block_d = max(16, triton.next_power_of_2(head_dim))  # q @ k^T is a tl.dot: K >= 16
    merge_g = triton.next_power_of_2(group_size)
    # A function of the config only (not of the grid), so the merge's order is the same
    # in a graph and eagerly.
    merge_p = max(1, min(MERGE_TILE // (merge_g * block_d), MERGE_CONTEXT // partition))
    score_scale, cap_log2e = score_args(scale, logits_soft_cap)
    window = sliding_window or 0
    _decode_kernel[(num_seqs, num_kv_heads, slots)](
        query, key_cache, value_cache, block_tables, seq_lens,
        new_key, new_value, slot_mapping,
        k_scale if fp8 else seq_lens, v_scale if fp8 else seq_lens,
        out, partial_out, partial_lse, counters, positions, cos_sin, q_norm, k_norm, sinks,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        new_key.stride(0), new_key.stride(1), new_value.stride(0), new_value.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), block_tables.stride(0),
        max_partitions, slots, num_heads, num_kv_heads, score_scale, cap_log2e, window,
        group_size, head_dim, cos_sin_stride, norm_eps,
        BLOCK_SIZE=block_size, PARTITION=partition, BLOCK_N=block_n,
        BLOCK_G=max(16, triton.next_power_of_2(group_size)), BLOCK_D=block_d,
        MERGE_G=merge_g, MERGE_P=merge_p, MERGE_IN_KERNEL=config.merge_in_kernel,
        DIRECT=direct, LOOP=loop, WRITE_NEW=new_kv is not None,
        USE_WINDOW=sliding_window is not None, USE_SOFT_CAP=logits_soft_cap is not None,
        FP8=fp8, COMPUTE_DTYPE=tl.float16 if fp8 else _TL_DTYPES[query.dtype],
        HAS_SINKS=sinks is not None, num_warps=config.num_warps,
        num_stages=config.num_stages, **rotary_flags, **pdl.launch_options(),
        **register_cap(config.max_registers),
    )  # fmt: skip
    if not direct and not config.merge_in_kernel:
        _decode_merge_kernel[(num_seqs, num_kv_heads)](
            out, partial_out, partial_lse, seq_lens,
            out.stride(0), out.stride(1), max_partitions, num_heads, group_size, head_dim,
            window, PARTITION=partition, MERGE_G=merge_g, MERGE_P=merge_p, BLOCK_D=block_d,
            USE_WINDOW=sliding_window is not None, sinks_ptr=sinks,
            HAS_SINKS=sinks is not None, **pdl.launch_options(),
        )  # fmt: skip
    return out


def check_sinks(sinks: torch.Tensor | None, num_heads: int) -> None:
    """Refuse sinks the kernels would misread (they index ``sinks_ptr + head``)."""
    if sinks is not None and (sinks.shape != (num_heads,) or not sinks.is_contiguous()):
        raise ValueError(
            f"sinks must be a contiguous [{num_heads}] tensor (one logit per query head), "
            f"got shape {tuple(sinks.shape)}."
        )
