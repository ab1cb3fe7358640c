"""Paged decode attention: one query token per sequence, grouped-query aware, split-K.

Each program takes one (sequence, kv head, partition of ``PARTITION`` key positions) and
computes attention of all ``num_heads // num_kv_heads`` query heads sharing that kv head
at once (the group is the M dimension of the dot product, so keys are read once per group).
Long contexts are split into partitions that run in parallel; a second kernel merges the
partial results by their log-sum-exp.

The partition size and tile come from ``decode_config``: a function of the batch size
*bucket* (the CUDA-graph capture ladder) and the model's shapes, never of the data. So a
sequence's result does depend on how many sequences share its step, but only through the
bucket: a graph replayed at padded size ``P`` and an eager step of any batch that pads to
``P`` agree bit for bit. The grid is sized by ``max_seq_len`` (max_model_len under a
graph); partitions past a sequence's end exit at once.

Sliding window ``w``: the query at position ``seq_len - 1`` sees keys ``seq_len - w ..
seq_len - 1``; partitions wholly before that exit at once and the merge skips them.
Soft-cap ``c``: scores become ``c * tanh(s / c)`` before the softmax. Both are constexpr
switches, so the common path compiles without them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedlm_cuda.kernels import pdl
from pagedlm_cuda.kernels.decode_config import decode_config
from pagedlm_cuda.kernels.score_mod import scaled_scores, score_args

MERGE_BLOCK_P = 32
"""Partitions merged per loop iteration: a constant, so the merge's summation order does
not depend on the grid (eager ``max_seq_len`` vs a graph's ``max_model_len``)."""


# Per-step sizes are not specialized on (Triton would compile a variant for each value's
# divisibility by 16), so an eager step never compiles mid-run.
@triton.jit(do_not_specialize=["block_table_stride", "max_partitions"])
def _decode_partition_kernel(
    q_ptr, key_cache_ptr, value_cache_ptr, block_tables_ptr, seq_lens_ptr,
    out_ptr, partial_out_ptr, partial_lse_ptr,
    q_stride_token, q_stride_head, out_stride_token, out_stride_head,
    cache_stride_block, cache_stride_head, cache_stride_slot, block_table_stride,
    max_partitions, num_heads, score_scale, cap_log2e, window, group_size, head_dim,
    BLOCK_SIZE: tl.constexpr, PARTITION: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, DIRECT: tl.constexpr,
    USE_WINDOW: tl.constexpr, USE_SOFT_CAP: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    pdl.start(USE_PDL)
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    part = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    start = part * PARTITION
    end = tl.minimum(start + PARTITION, seq_len)
    if USE_WINDOW:
        start = tl.maximum(start, seq_len - window)
    if not DIRECT and start >= end:
        return  # the merge reads only partitions that hold a visible key

    groups = tl.arange(0, BLOCK_G)
    dims = tl.arange(0, BLOCK_D)
    heads = kv_head * group_size + groups
    head_mask = groups < group_size
    dim_mask = dims < head_dim
    q = tl.load(
        q_ptr + seq * q_stride_token + heads[:, None] * q_stride_head + dims[None, :],
        mask=head_mask[:, None] & dim_mask[None, :],
        other=0.0,
    )
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_G], tl.float32)  # noqa: E741 - the softmax denominator's usual name
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    table = block_tables_ptr + seq * block_table_stride
    head_base = kv_head.to(tl.int64) * cache_stride_head
    # Every tile starts at a visible key (start is the window's first when windowed), so
    # each row's running max is finite after the first tile.
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        pos_mask = pos < end
        block = tl.load(table + pos // BLOCK_SIZE, mask=pos_mask, other=0).to(tl.int64)
        rows = block * cache_stride_block + head_base + (pos % BLOCK_SIZE) * cache_stride_slot
        offsets = rows[:, None] + dims[None, :]
        kv_mask = pos_mask[:, None] & dim_mask[None, :]
        k = tl.load(key_cache_ptr + offsets, mask=kv_mask, other=0.0)
        v = tl.load(value_cache_ptr + offsets, mask=kv_mask, other=0.0)
        s = scaled_scores(tl.dot(q, tl.trans(k)), score_scale, cap_log2e, USE_SOFT_CAP)
        s = tl.where(pos_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m - m_new)
        l = l * alpha + tl.sum(p, axis=1)  # noqa: E741
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m = m_new
    safe_l = tl.where(l > 0, l, 1.0)
    out = acc / safe_l[:, None]
    mask = head_mask[:, None] & dim_mask[None, :]
    if DIRECT:
        dst = out_ptr + seq * out_stride_token + heads[:, None] * out_stride_head + dims[None, :]
        tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        row = (seq * num_heads + heads) * max_partitions + part
        tl.store(partial_out_ptr + row[:, None] * head_dim + dims[None, :], out, mask=mask)
        tl.store(partial_lse_ptr + row, m + tl.log2(safe_l), mask=head_mask)


@triton.jit(do_not_specialize=["max_partitions"])
def _decode_merge_kernel(
    out_ptr, partial_out_ptr, partial_lse_ptr, seq_lens_ptr,
    out_stride_token, out_stride_head, max_partitions, num_heads, head_dim, window,
    PARTITION: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr,
    USE_WINDOW: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    pdl.start(USE_PDL)
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq)
    num_parts = tl.cdiv(seq_len, PARTITION)
    first = 0
    if USE_WINDOW:
        first = tl.maximum(seq_len - window, 0) // PARTITION
    base = (seq * num_heads + head) * max_partitions
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < head_dim
    # Two passes over the partials (max, then weighted sum) rather than an online
    # rescale: the partials are few and cached, and this keeps one rounding per term.
    top = tl.full([BLOCK_P], float("-inf"), tl.float32)
    for p0 in range(first, num_parts, BLOCK_P):
        parts = p0 + tl.arange(0, BLOCK_P)
        lse = tl.load(partial_lse_ptr + base + parts, mask=parts < num_parts, other=float("-inf"))
        top = tl.maximum(top, lse)
    top_all = tl.max(top, axis=0)
    total = tl.zeros([BLOCK_P], tl.float32)
    acc = tl.zeros([BLOCK_D], tl.float32)
    for p0 in range(first, num_parts, BLOCK_P):
        parts = p0 + tl.arange(0, BLOCK_P)
        part_mask = parts < num_parts
        lse = tl.load(partial_lse_ptr + base + parts, mask=part_mask, other=float("-inf"))
        weight = tl.where(part_mask, tl.exp2(lse - top_all), 0.0)
        total += weight
        partial = tl.load(
            partial_out_ptr + (base + parts)[:, None] * head_dim + dims[None, :],
            mask=part_mask[:, None] & dim_mask[None, :],
            other=0.0,
        )
        acc += tl.sum(partial * weight[:, None], axis=0)
    denom = tl.sum(total, axis=0)
    out = acc / tl.where(denom > 0, denom, 1.0)  # an empty (padding) sequence yields zeros
    dst = out_ptr + seq * out_stride_token + head * out_stride_head + dims
    tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=dim_mask)


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
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> torch.Tensor:
    """Attention of each sequence's one new token over its cached keys (positions
    ``0 .. seq_lens[i]-1``, the new token's own K/V already written).

    query: [num_seqs, num_heads, head_dim]; key_cache, value_cache: [num_blocks,
    num_kv_heads, block_size, head_dim]; block_tables: [num_seqs, max_blocks] int32;
    seq_lens: [num_seqs] int32; max_seq_len: an upper bound of ``seq_lens`` (it sizes the
    grid; under a CUDA graph pass max_model_len). Returns [num_seqs, num_heads, head_dim].
    A sequence with ``seq_len == 0`` (padding) gets zeros. ``sliding_window`` ``w``: only
    the last ``w`` keys; ``logits_soft_cap`` ``c``: scores ``c * tanh(s / c)``.
    ``partition_size`` / ``block_n`` None: from ``decode_config(num_seqs, ...)``; given,
    they override it (tests), and ``partition_size`` must be a multiple of ``block_n``.
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
    config = decode_config(num_seqs, num_kv_heads, head_dim)
    partition = partition_size or config.partition
    if block_n is None:
        block_n = min(config.block_n, partition)
    if partition % block_n:
        raise ValueError(f"partition_size={partition} must be a multiple of block_n={block_n}.")
    max_partitions = max(1, triton.cdiv(max_seq_len, partition))
    direct = max_partitions == 1
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
    block_d = triton.next_power_of_2(head_dim)
    score_scale, cap_log2e = score_args(scale, logits_soft_cap)
    window = sliding_window or 0
    _decode_partition_kernel[(num_seqs, num_kv_heads, max_partitions)](
        query, key_cache, value_cache, block_tables, seq_lens,
        out, partial_out, partial_lse,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), block_tables.stride(0),
        max_partitions, num_heads, score_scale, cap_log2e, window, group_size, head_dim,
        BLOCK_SIZE=block_size, PARTITION=partition, BLOCK_N=block_n,
        BLOCK_G=max(16, triton.next_power_of_2(group_size)), BLOCK_D=block_d, DIRECT=direct,
        USE_WINDOW=sliding_window is not None, USE_SOFT_CAP=logits_soft_cap is not None,
        num_warps=config.num_warps, num_stages=config.num_stages, **pdl.launch_options(),
    )  # fmt: skip
    if not direct:
        _decode_merge_kernel[(num_seqs, num_heads)](
            out, partial_out, partial_lse, seq_lens,
            out.stride(0), out.stride(1), max_partitions, num_heads, head_dim, window,
            PARTITION=partition, BLOCK_P=MERGE_BLOCK_P, BLOCK_D=block_d,
            USE_WINDOW=sliding_window is not None, **pdl.launch_options(),
        )  # fmt: skip
    return out
