"""Paged decode attention: one query token per sequence, grouped-query aware, split-K.

Each program takes one (sequence, kv head, partition of ``PARTITION`` key positions) and
computes attention of all ``num_heads // num_kv_heads`` query heads sharing that kv head
at once (the group is the M dimension of the dot product, so keys are read once per group).
Long contexts are split into partitions that run in parallel; a second kernel merges the
partial results by their log-sum-exp. The partition size is fixed, not derived from the
batch, so a sequence's result does not depend on what else is in the batch or on whether
the step runs eagerly or from a CUDA graph.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
DEFAULT_PARTITION = 256


@triton.jit
def _decode_partition_kernel(
    q_ptr, key_cache_ptr, value_cache_ptr, block_tables_ptr, seq_lens_ptr,
    out_ptr, partial_out_ptr, partial_lse_ptr,
    q_stride_token, q_stride_head, out_stride_token, out_stride_head,
    cache_stride_block, cache_stride_slot, cache_stride_head, block_table_stride,
    max_partitions, num_heads, qk_scale, group_size, head_dim, block_size,
    PARTITION: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr, DIRECT: tl.constexpr,
):  # fmt: skip
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    part = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    start = part * PARTITION
    if not DIRECT and start >= seq_len:
        return  # the merge kernel reads only partitions below cdiv(seq_len, PARTITION)
    end = tl.minimum(start + PARTITION, seq_len)

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
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        pos_mask = pos < end
        block = tl.load(table + pos // block_size, mask=pos_mask, other=0).to(tl.int64)
        rows = block * cache_stride_block + (pos % block_size) * cache_stride_slot
        offsets = rows[:, None] + kv_head * cache_stride_head + dims[None, :]
        kv_mask = pos_mask[:, None] & dim_mask[None, :]
        k = tl.load(key_cache_ptr + offsets, mask=kv_mask, other=0.0)
        v = tl.load(value_cache_ptr + offsets, mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k)) * qk_scale
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


@triton.jit
def _decode_merge_kernel(
    out_ptr, partial_out_ptr, partial_lse_ptr, seq_lens_ptr,
    out_stride_token, out_stride_head, max_partitions, num_heads, head_dim,
    PARTITION: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq)
    num_parts = tl.cdiv(seq_len, PARTITION)
    parts = tl.arange(0, BLOCK_P)
    dims = tl.arange(0, BLOCK_D)
    part_mask = parts < num_parts
    row = (seq * num_heads + head) * max_partitions + parts
    lse = tl.load(partial_lse_ptr + row, mask=part_mask, other=float("-inf"))
    top = tl.max(lse, axis=0)
    top = tl.where(num_parts > 0, top, 0.0)  # an empty (padding) sequence yields zeros
    weight = tl.where(part_mask, tl.exp2(lse - top), 0.0)
    total = tl.sum(weight, axis=0)
    weight = weight / tl.where(total > 0, total, 1.0)
    partial = tl.load(
        partial_out_ptr + row[:, None] * head_dim + dims[None, :],
        mask=part_mask[:, None] & (dims[None, :] < head_dim),
        other=0.0,
    )
    out = tl.sum(partial * weight[:, None], axis=0)
    dst = out_ptr + seq * out_stride_token + head * out_stride_head + dims
    tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=dims < head_dim)


# Tile size and pipelining are tuned once per model (the key holds only model constants),
# never per batch: every call of one engine then uses the same configuration, so results
# do not depend on batch size or on graph replay. The partition size stays fixed above.
_TUNING_CONFIGS = [
    triton.Config({"BLOCK_N": block_n}, num_warps=warps, num_stages=stages)
    for block_n, warps, stages in (
        (32, 4, 2), (64, 4, 2), (64, 4, 3), (64, 8, 3), (128, 4, 2), (128, 8, 2),
    )
]  # fmt: skip
_decode_partition_tuned = triton.autotune(
    configs=_TUNING_CONFIGS, key=["group_size", "head_dim", "block_size"]
)(_decode_partition_kernel)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def paged_decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_seq_len: int,
    out: torch.Tensor | None = None,
    partition_size: int = DEFAULT_PARTITION,
    block_n: int | None = None,
) -> torch.Tensor:
    """Attention of each sequence's one new token over its cached keys (positions
    ``0 .. seq_lens[i]-1``, the new token's own K/V already written).

    query: [num_seqs, num_heads, head_dim]; key_cache, value_cache: [num_blocks,
    block_size, num_kv_heads, head_dim]; block_tables: [num_seqs, max_blocks] int32;
    seq_lens: [num_seqs] int32; max_seq_len: an upper bound of ``seq_lens`` (it sizes the
    grid; under a CUDA graph pass max_model_len). Returns [num_seqs, num_heads, head_dim].
    A sequence with ``seq_len == 0`` (padding) gets zeros. ``block_n`` None: the key tile
    is autotuned on the GPU (64 under the interpreter); ``partition_size`` must be a
    multiple of 128 then.
    """
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    group_size = num_heads // num_kv_heads
    if out is None:
        out = torch.empty_like(query)
    if num_seqs == 0:
        return out
    tuned = block_n is None and not _interpreting()
    if block_n is None:
        block_n = 128 if tuned else 64
    if partition_size % block_n:
        raise ValueError(f"partition_size={partition_size} must be a multiple of {block_n}.")
    max_partitions = max(1, triton.cdiv(max_seq_len, partition_size))
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
    args = (
        query, key_cache, value_cache, block_tables, seq_lens,
        out, partial_out, partial_lse,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), block_tables.stride(0),
        max_partitions, num_heads, scale * LOG2E, group_size, head_dim, key_cache.shape[1],
    )  # fmt: skip
    grid = (num_seqs, num_kv_heads, max_partitions)
    block_g = max(16, triton.next_power_of_2(group_size))
    if tuned:
        _decode_partition_tuned[grid](
            *args, PARTITION=partition_size, BLOCK_G=block_g, BLOCK_D=block_d, DIRECT=direct
        )
    else:
        _decode_partition_kernel[grid](
            *args, PARTITION=partition_size, BLOCK_N=block_n, BLOCK_G=block_g,
            BLOCK_D=block_d, DIRECT=direct,
        )  # fmt: skip
    if not direct:
        _decode_merge_kernel[(num_seqs, num_heads)](
            out, partial_out, partial_lse, seq_lens,
            out.stride(0), out.stride(1), max_partitions, num_heads, head_dim,
            PARTITION=partition_size, BLOCK_P=triton.next_power_of_2(max_partitions),
            BLOCK_D=block_d,
        )  # fmt: skip
    return out
