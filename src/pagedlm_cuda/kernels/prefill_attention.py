"""Varlen attention over the paged cache: prompts, chunked prefills, prefix hits; causal,
or bidirectional for encoders (``causal=False``: every row sees all ``seq_len`` keys of its
request, as BERT's pooling steps need).

Request ``i`` owns query rows ``query_start_loc[i] .. query_start_loc[i+1]-1``; they are
the tokens at positions ``seq_lens[i] - query_len .. seq_lens[i]-1``, and every key they
may see (the cached prefix and the chunk's own tokens, already written) is read from the
paged cache through the block table. Each program handles ``BLOCK_M`` query rows of one
request and one query head, walking key tiles up to the tile's last causal position.
Decode rows (query_len 1) are handled too, so a mixed batch needs this kernel only.

Sliding window ``w`` (constexpr switch): the row at position ``p`` sees keys ``p - w + 1
.. p``; a tile's walk starts at its first row's window, so keys before it are never read.
Soft-cap ``c``: scores become ``c * tanh(s / c)`` before the softmax. Attention sinks
(constexpr switch, gpt-oss): each query head's sink logit joins the softmax's denominator
once the walk is done (``decode_attention.fold_sinks``).

FP8 cache (constexpr switch): tiles are cast to the query's dtype after loading, the dots
are multiplied by ``k_scale`` and the output by ``v_scale`` (both per tensor, so they
commute with the softmax's sums).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedlm.kv_cache.fp8 import is_fp8
from pagedlm_cuda.kernels.decode_attention import check_sinks, fold_sinks
from pagedlm_cuda.kernels.kv_tile import fp8_scales, load_kv_tile
from pagedlm_cuda.kernels.score_mod import scaled_scores, score_args


# The block-table width changes from step to step: not specialized on, so it never
# triggers a compile mid-run.
@triton.jit(do_not_specialize=["block_table_stride"])
def _prefill_kernel(
    q_ptr, key_cache_ptr, value_cache_ptr, block_tables_ptr, seq_lens_ptr,
    query_start_loc_ptr, out_ptr, k_scale_ptr, v_scale_ptr,
    q_stride_token, q_stride_head, out_stride_token, out_stride_head,
    cache_stride_block, cache_stride_head, cache_stride_slot, block_table_stride,
    score_scale, cap_log2e, window, group_size, head_dim,
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, USE_WINDOW: tl.constexpr, USE_SOFT_CAP: tl.constexpr,
    FP8: tl.constexpr, CAUSAL: tl.constexpr, sinks_ptr=None, HAS_SINKS: tl.constexpr = False,
):  # fmt: skip
    req = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    head = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    if tile * BLOCK_M >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + req)
    context_len = seq_len - q_len
    kv_head = head // group_size

    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < q_len
    q_pos = context_len + rows
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < head_dim
    tokens = (q_start + rows).to(tl.int64)
    q = tl.load(
        q_ptr + tokens[:, None] * q_stride_token + head * q_stride_head + dims[None, :],
        mask=row_mask[:, None] & dim_mask[None, :],
        other=0.0,
    )
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)  # noqa: E741 - the softmax denominator's usual name
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    kv_end = seq_len
    if CAUSAL:
        kv_end = tl.minimum(seq_len, context_len + (tile + 1) * BLOCK_M)
    kv_start = 0
    if USE_WINDOW:
        kv_start = tl.maximum(context_len + tile * BLOCK_M - window + 1, 0)
    table = block_tables_ptr + req * block_table_stride
    head_base = kv_head.to(tl.int64) * cache_stride_head
    k_scale, v_scale = fp8_scales(k_scale_ptr, v_scale_ptr, FP8)
    for n0 in range(kv_start, kv_end, BLOCK_N):
        pos, pos_mask, k, v = load_kv_tile(
            key_cache_ptr, value_cache_ptr, table, head_base, n0, kv_end, dims, dim_mask,
            cache_stride_block, cache_stride_slot, BLOCK_SIZE, BLOCK_N, q_ptr.dtype.element_ty,
        )  # fmt: skip
        dots = tl.dot(q, tl.trans(k))
        if FP8:
            dots = dots * k_scale
        s = scaled_scores(dots, score_scale, cap_log2e, USE_SOFT_CAP)
        visible = pos_mask[None, :]
        if CAUSAL:
            visible = visible & (pos[None, :] <= q_pos[:, None])
        if USE_WINDOW:
            visible = visible & (pos[None, :] > q_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        # Without a window key position 0 is visible to every row, so m_new is finite.
        m_ref = m_new
        if USE_WINDOW:
            # A row may see nothing in a tile its window has not reached yet: subtract a
            # finite stand-in so exp2(-inf - -inf) makes no NaN; m itself stays -inf.
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_ref[:, None])
        alpha = tl.exp2(m - m_ref)
        l = l * alpha + tl.sum(p, axis=1)  # noqa: E741
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m = m_new
    if HAS_SINKS:
        heads = tl.full([BLOCK_M], 0, tl.int32) + head
        m, l, acc = fold_sinks(m, l, acc, sinks_ptr, heads, row_mask)  # noqa: E741
    out = acc / tl.where(l > 0, l, 1.0)[:, None]
    if FP8:
        out = out * v_scale
    dst = out_ptr + tokens[:, None] * out_stride_token + head * out_stride_head + dims[None, :]
    tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & dim_mask[None, :])


def paged_prefill_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    max_query_len: int,
    out: torch.Tensor | None = None,
    block_m: int = 64,
    block_n: int | None = None,
    *,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    causal: bool = True,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of every scheduled token over its request's cached keys: causal, or with
    ``causal=False`` over all of them (an encoder's whole prompt; no sliding window).

    query: [num_tokens, num_heads, head_dim]; key_cache, value_cache: [num_blocks,
    num_kv_heads, block_size, head_dim] already holding this step's K/V; block_tables:
    [num_reqs, max_blocks] int32; seq_lens: [num_reqs] int32; query_start_loc:
    [num_reqs + 1] int32; max_query_len: the longest query of the batch (sizes the grid).
    ``sliding_window`` ``w``: row at position ``p`` sees keys ``p - w + 1 .. p`` only;
    ``logits_soft_cap`` ``c``: scores ``c * tanh(s / c)``. ``block_n`` None: 64, or 32
    for head_dim > 128 (shared memory; those also run 8 warps). A float8 cache needs
    ``k_scale``/``v_scale`` (float32 [1]). ``sinks``: [num_heads] logits, each joining
    its head's softmax denominator with no value (gpt-oss). Returns [num_tokens,
    num_heads, head_dim].
    """
    num_tokens, num_heads, head_dim = query.shape
    num_reqs = seq_lens.shape[0]
    if out is None:
        out = torch.empty_like(query)
    if num_tokens == 0 or num_reqs == 0:
        return out
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1, got {sliding_window}.")
    if sliding_window is not None and not causal:
        raise ValueError("a sliding window is causal; bidirectional attention has none.")
    check_sinks(sinks, num_heads)
    if block_n is None:
        block_n = 64 if head_dim <= 128 else 32
    group_size = num_heads // key_cache.shape[1]
    score_scale, cap_log2e = score_args(scale, logits_soft_cap)
    fp8 = is_fp8(key_cache.dtype)
    if fp8 and (k_scale is None or v_scale is None):
        raise ValueError("an FP8 KV cache needs k_scale and v_scale.")
    grid = (num_reqs, triton.cdiv(max_query_len, block_m), num_heads)
    _prefill_kernel[grid](
        query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, out,
        k_scale if fp8 else seq_lens, v_scale if fp8 else seq_lens,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), block_tables.stride(0),
        score_scale, cap_log2e, sliding_window or 0, group_size, head_dim,
        BLOCK_SIZE=key_cache.shape[2], BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),  # tl.dot needs K >= 16
        USE_WINDOW=sliding_window is not None, USE_SOFT_CAP=logits_soft_cap is not None,
        FP8=fp8, CAUSAL=causal, sinks_ptr=sinks, HAS_SINKS=sinks is not None,
        num_warps=4 if head_dim <= 128 else 8,  # a 64 x 256 float32 accumulator needs more
    )  # fmt: skip
    return out
