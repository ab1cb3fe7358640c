"""Paged attention for a few query tokens per request: speculative verification steps.

A verification step feeds each request ``1 + k`` tokens (its last sampled token and ``k``
drafts) over a long cached context. The prefill kernel serves such a step correctly but
not fast: it runs one program per (request, query head) and walks the whole context in
each, so at batch 1 an 8B model's step gets 32 programs per layer on a 132-SM GPU (33 us
per layer on the H200, against ~8 us for a decode). This kernel splits the context the way
the decode kernel does, and puts every query row of a request that shares a kv head into
one program: the M dimension of its dots is ``query_len x group`` rows (token ``i``, head
``g`` at row ``i * group + g``), so each key tile is read once for all of them.

Each program takes one (request, kv head, partition of ``PARTITION`` key positions). Row
``i`` of a request of ``q`` tokens over ``seq_len`` positions is the token at position
``seq_len - q + i``: it sees keys up to that position (causal), and with a sliding window
``w`` only the last ``w`` of them. A partition may hold no visible key for some rows (the
last partition, before a row's position); such a row keeps a zero sum there and the merge
never reads it: token ``i``'s partitions are those up to its own position.

The partials are merged by log-sum-exp in a fixed order, per token, as the decode kernel
merges its own (``decode_attention._merge_group``), by a merge kernel after this one with
a program per (request, kv head, token). The decode kernel's alternative, the program
that draws a (request, kv head)'s last ticket merging it, serializes a request's tokens in
one program; it lost here at every batch measured (H100, session 22,
``tests/cuda/bench_verify_attention.py``, 5 tokens over 1,100 keys, with the KV write:
batch 1 11.6 us per call against 7.2 with the merge kernel, batch 4 17.0 against 13.6),
and was removed. The split comes from ``verify_config``: the decode kernel's
``decode_config`` of the number of requests with partitions of at least
``MIN_PARTITION`` keys, so the result depends on the batch only through its CUDA-graph
bucket.

The step's keys and values may be passed along (``new_kv``): each program then first
writes those at positions of its own partition into the cache by slot (no other program
reads them), which saves the separate KV-write launch, and reads them back with the
rest of its tiles. Padding rows (``seq_len == 0``, a captured graph's) get zeros.

Attention sinks (``HAS_SINKS``, gpt-oss) are folded in as the decode kernel folds them:
by the program itself with one partition, else by the merge (``fold_sinks``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedlm.attention.backend import FusedRotary
from pagedlm.kv_cache.fp8 import is_fp8
from pagedlm_cuda.kernels import pdl
from pagedlm_cuda.kernels.decode_attention import (
    MERGE_CONTEXT,
    MERGE_TILE,
    _merge_group,
    check_sinks,
    fold_sinks,
)
from pagedlm_cuda.kernels.decode_config import DecodeConfig, decode_config
from pagedlm_cuda.kernels.kv_tile import (
    fp8_scales,
    fp8_store_value,
    fp8_value_stager,
    load_kv_tile,
)
from pagedlm_cuda.kernels.rotary import fused_angles, fused_rotary_args, rotate_at, rotate_loaded
from pagedlm_cuda.kernels.score_mod import scaled_scores, score_args

MAX_QUERY_LEN = 8
"""The most tokens per request this kernel takes (1 + k for k <= 7 drafts): its rows are
``query_len x group`` in one program, so longer queries belong to the prefill kernel."""

MIN_PARTITION = 64
"""The shortest partition (``decode_config``'s are longer at larger batches): the merge
reads every token's partials, ``query_len`` times a decode's, so fewer of them pay.
Measured on the H200 (llama-3-8b attention, 5 tokens per request over 1,100 cached, 32
calls from a graph, us per call; ``tests/cuda/bench_verify_attention.py``): batch 1
partitions 32 / 64 / 128: 13.4 / 11.5 / 14.7 (prefill kernel 26.9, a decode 5.3); batch 4
64 / 128: 16.6 / 20.5 (prefill 28.2); batch 16, 256: 41.8 (prefill 78.7); batch 64, 512:
118.8 (prefill 300.0, a decode 80.1); 8 warps was slower at every batch."""


@triton.jit
def _attend_rows(
    q, k, v, visible, m, denom, acc, score_scale, cap_log2e, k_scale, stager,
    USE_SOFT_CAP: tl.constexpr, FP8: tl.constexpr,
):  # fmt: skip
    """One online-softmax step over a tile, ``visible`` [M, N] per row; a row may see no
    key of the tile (nor of any earlier one): its max stays -inf and its sums zero.
    ``stager``: an FP8 cache's ``fp8_value_stager``."""
    dots = tl.dot(q, tl.trans(k))
    if FP8:
        dots = dots * k_scale
    s = scaled_scores(dots, score_scale, cap_log2e, USE_SOFT_CAP)
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # exp2(-inf - 0) = 0, not NaN
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m - m_safe)
    denom = denom * alpha + tl.sum(p, axis=1)
    if FP8:
        v = v * stager  # exact: for the code it makes (kv_tile)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, denom, acc


@triton.jit
def _visible(pos, pos_mask, visible_end, window, USE_WINDOW: tl.constexpr):
    """[M, N]: which of a tile's keys (``pos``, valid where ``pos_mask``) each row sees:
    those before its own ``visible_end`` (causal), and in a window its last ``window``."""
    visible = pos_mask[None, :] & (pos[None, :] < visible_end[:, None])
    if USE_WINDOW:
        visible &= pos[None, :] >= visible_end[:, None] - window
    return visible


@triton.jit(do_not_specialize=["block_table_stride", "max_partitions"])
def _verify_kernel(
    q_ptr, key_cache_ptr, value_cache_ptr, block_tables_ptr, seq_lens_ptr,
    query_start_loc_ptr, new_key_ptr, new_value_ptr, slot_mapping_ptr, k_scale_ptr, v_scale_ptr,
    out_ptr, partial_out_ptr, partial_lse_ptr,
    positions_ptr, cos_sin_ptr, q_norm_ptr, k_norm_ptr, sinks_ptr,
    q_stride_token, q_stride_head, out_stride_token, out_stride_head,
    new_key_stride_token, new_key_stride_head, new_value_stride_token, new_value_stride_head,
    cache_stride_block, cache_stride_head, cache_stride_slot, block_table_stride,
    max_partitions, num_heads, score_scale, cap_log2e, window, group_size,
    head_dim, cos_sin_stride, norm_eps,
    BLOCK_SIZE: tl.constexpr, PARTITION: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_Q: tl.constexpr,
    DIRECT: tl.constexpr, WRITE_NEW: tl.constexpr, USE_WINDOW: tl.constexpr, USE_SOFT_CAP: tl.constexpr,
    FP8: tl.constexpr, COMPUTE_DTYPE: tl.constexpr, ROTARY: tl.constexpr,
    IS_NEOX: tl.constexpr, QK_NORM: tl.constexpr, USE_PDL: tl.constexpr,
    HAS_SINKS: tl.constexpr = False,
):  # fmt: skip
    pdl.allow_next(USE_PDL)
    req = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    part = tl.program_id(2)
    # Metadata are host copies made before the forward: readable before the wait.
    q_start = tl.load(query_start_loc_ptr + req).to(tl.int64)
    q_len = (tl.load(query_start_loc_ptr + req + 1) - q_start).to(tl.int32)
    seq_len = tl.load(seq_lens_ptr + req)
    context_len = seq_len - q_len

    rows = tl.arange(0, BLOCK_M)
    token_in_req = rows // group_size
    heads = kv_head * group_size + rows % group_size
    row_mask = token_in_req < q_len
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < head_dim
    tokens = q_start + token_in_req
    out_rows = tokens[:, None] * out_stride_token + heads[:, None] * out_stride_head
    mask = row_mask[:, None] & dim_mask[None, :]

    start = part * PARTITION
    end = tl.minimum(start + PARTITION, seq_len)
    if USE_WINDOW:  # the first token's window begins earliest
        start = tl.maximum(start, context_len + 1 - window)
    if seq_len == 0:  # a padding row: zeros, once
        if part == 0:
            pdl.wait_for_previous(USE_PDL)
            tl.store(out_ptr + out_rows + dims[None, :], tl.zeros([BLOCK_M, BLOCK_D],
                     out_ptr.dtype.element_ty), mask=mask)  # fmt: skip
        return
    if start >= end:
        return  # no key of any row here: the merge never reads this partition

    head_base = kv_head.to(tl.int64) * cache_stride_head
    table = block_tables_ptr + req * block_table_stride
    # The first tile is read before waiting for the kernel that produced q when it holds
    # cached positions only (earlier steps wrote them; each forward begins with a torch
    # kernel, which waits for everything before it); else it is empty here, and read
    # with the others once this program has written the step's keys.
    first_end = tl.minimum(start + BLOCK_N, end)
    pre_end = tl.where(first_end <= context_len, first_end, start)
    pos0, pos_mask0, k0, v0 = load_kv_tile(
        key_cache_ptr, value_cache_ptr, table, head_base, start, pre_end, dims, dim_mask,
        cache_stride_block, cache_stride_slot, BLOCK_SIZE, BLOCK_N, COMPUTE_DTYPE,
    )  # fmt: skip
    if ROTARY:  # the query rows' angles: positions are host copies, the table is fixed
        q_positions = tl.load(positions_ptr + tokens, mask=row_mask, other=0).to(tl.int64)
        partner, cos, signed_sin = fused_angles(
            cos_sin_ptr, q_positions, cos_sin_stride, dims, BLOCK_D // 2, IS_NEOX
        )  # fmt: skip
    pdl.wait_for_previous(USE_PDL)
    k_scale, v_scale = fp8_scales(k_scale_ptr, v_scale_ptr, FP8)
    if WRITE_NEW:
        # The step's keys and values at positions this partition holds: written here, by
        # the only program that reads them, and read back from the cache below (the
        # barrier makes every thread's stores visible to the whole program).
        new = tl.arange(0, BLOCK_Q)
        new_pos = context_len + new
        owned = (new < q_len) & (new_pos >= start) & (new_pos < end)
        new_tokens = q_start + new
        slot = tl.load(slot_mapping_ptr + new_tokens, mask=owned, other=-1).to(tl.int64)
        new_mask = owned[:, None] & dim_mask[None, :]
        new_k_rows = (
            new_key_ptr + new_tokens[:, None] * new_key_stride_token + kv_head * new_key_stride_head
        )
        new_k = tl.load(new_k_rows + dims[None, :], mask=new_mask, other=0.0)
        if ROTARY:
            new_positions = tl.load(positions_ptr + new_tokens, mask=owned, other=0).to(tl.int64)
            new_k = rotate_at(
                new_k, new_k_rows, new_mask, new_positions, cos_sin_ptr, cos_sin_stride,
                k_norm_ptr, norm_eps, dims, head_dim, IS_NEOX, QK_NORM,
            )  # fmt: skip
        new_v = tl.load(new_value_ptr + new_tokens[:, None] * new_value_stride_token
                        + kv_head * new_value_stride_head + dims[None, :], mask=new_mask,
                        other=0.0)  # fmt: skip
        slot_rows = (
            (slot // BLOCK_SIZE) * cache_stride_block
            + head_base
            + (slot % BLOCK_SIZE) * cache_stride_slot
        )
        write_mask = new_mask & (slot >= 0)[:, None]
        dst = slot_rows[:, None] + dims[None, :]
        tl.store(key_cache_ptr + dst,
                 fp8_store_value(new_k, k_scale, key_cache_ptr.dtype.element_ty, FP8),
                 mask=write_mask)  # fmt: skip
        tl.store(value_cache_ptr + dst,
                 fp8_store_value(new_v, v_scale, value_cache_ptr.dtype.element_ty, FP8),
                 mask=write_mask)  # fmt: skip
        tl.debug_barrier()
    q_rows = q_ptr + tokens[:, None] * q_stride_token + heads[:, None] * q_stride_head
    q = tl.load(q_rows + dims[None, :], mask=mask, other=0.0)
    if ROTARY:
        q = rotate_loaded(
            q, q_rows, mask, partner, cos, signed_sin, q_norm_ptr, norm_eps, dims, head_dim,
            QK_NORM,
        )  # fmt: skip
    stager = 1.0
    if FP8:
        q = tl.clamp(q.to(tl.float32), -65504.0, 65504.0).to(COMPUTE_DTYPE)
        stager = fp8_value_stager(v_scale, COMPUTE_DTYPE)
    else:
        q = q.to(COMPUTE_DTYPE)
    visible_end = context_len + token_in_req + 1  # [M] one past each row's position
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    denom = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    if pre_end > start:
        visible = _visible(pos0, pos_mask0, visible_end, window, USE_WINDOW)
        m, denom, acc = _attend_rows(
            q, k0, v0, visible, m, denom, acc, score_scale, cap_log2e, k_scale, stager,
            USE_SOFT_CAP, FP8,
        )  # fmt: skip
    for n0 in range(pre_end, end, BLOCK_N):
        pos, pos_mask, k, v = load_kv_tile(
            key_cache_ptr, value_cache_ptr, table, head_base, n0, end, dims, dim_mask,
            cache_stride_block, cache_stride_slot, BLOCK_SIZE, BLOCK_N, COMPUTE_DTYPE,
        )  # fmt: skip
        visible = _visible(pos, pos_mask, visible_end, window, USE_WINDOW)
        m, denom, acc = _attend_rows(
            q, k, v, visible, m, denom, acc, score_scale, cap_log2e, k_scale, stager,
            USE_SOFT_CAP, FP8,
        )  # fmt: skip
    if DIRECT and HAS_SINKS:  # every row's sums are final here
        m, denom, acc = fold_sinks(m, denom, acc, sinks_ptr, heads, row_mask)
    safe_denom = tl.where(denom > 0, denom, 1.0)
    out = acc / safe_denom[:, None]
    if FP8:
        out = out * v_scale
    if DIRECT:
        tl.store(out_ptr + out_rows + dims[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        row = (tokens * num_heads + heads) * max_partitions + part
        tl.store(partial_out_ptr + row[:, None] * head_dim + dims[None, :], out, mask=mask)
        tl.store(partial_lse_ptr + row, m + tl.log2(safe_denom), mask=row_mask)


@triton.jit(do_not_specialize=["max_partitions"])
def _verify_merge_kernel(
    out_ptr, partial_out_ptr, partial_lse_ptr, seq_lens_ptr, query_start_loc_ptr,
    out_stride_token, out_stride_head, max_partitions, num_heads, group_size, head_dim,
    window, PARTITION: tl.constexpr, MERGE_G: tl.constexpr, MERGE_P: tl.constexpr,
    BLOCK_D: tl.constexpr, USE_WINDOW: tl.constexpr,
    USE_PDL: tl.constexpr, sinks_ptr=None, HAS_SINKS: tl.constexpr = False,
):  # fmt: skip
    """The merge as a kernel of its own, one program per (request, kv head, token), so a
    request's tokens merge in parallel; padding rows already hold their zeros."""
    pdl.start(USE_PDL)
    req = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    i = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + req)
    q_start = tl.load(query_start_loc_ptr + req).to(tl.int64)
    q_len = (tl.load(query_start_loc_ptr + req + 1) - q_start).to(tl.int32)
    if seq_len == 0 or i >= q_len:
        return
    visible_end = seq_len - q_len + i + 1
    first = 0
    if USE_WINDOW:
        first = tl.maximum(visible_end - window, 0) // PARTITION
    _merge_group(
        out_ptr, partial_out_ptr, partial_lse_ptr, q_start + i, kv_head, first,
        tl.cdiv(visible_end, PARTITION), out_stride_token, out_stride_head, max_partitions,
        num_heads, group_size, head_dim, sinks_ptr, MERGE_G=MERGE_G, MERGE_P=MERGE_P,
        BLOCK_D=BLOCK_D, HAS_SINKS=HAS_SINKS,
    )  # fmt: skip


def verify_config(
    num_reqs: int, num_kv_heads: int, head_dim: int, fp8: bool = False
) -> DecodeConfig:
    """``decode_config`` of the request count with partitions of at least
    ``MIN_PARTITION`` keys: a function of the batch bucket, like the decode kernel's. Its
    ``merge_in_kernel`` is False: this kernel always merges in a kernel of its own."""
    config = decode_config(num_reqs, num_kv_heads, head_dim, fp8)._replace(merge_in_kernel=False)
    if config.partition >= MIN_PARTITION:
        return config
    return config._replace(
        partition=MIN_PARTITION, block_n=min(64 if head_dim <= 128 else 32, MIN_PARTITION)
    )


_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


def paged_verify_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    max_query_len: int,
    max_seq_len: int,
    out: torch.Tensor | None = None,
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
    """Causal attention of each request's few new tokens over its cached keys.

    query: [num_tokens, num_heads, head_dim]; key_cache, value_cache: [num_blocks,
    num_kv_heads, block_size, head_dim] already holding this step's K/V; block_tables:
    [num_reqs, max_blocks] int32; seq_lens: [num_reqs] int32 (0: a padding row);
    query_start_loc: [num_reqs + 1] int32; ``max_query_len`` bounds every request's
    query length (at most ``MAX_QUERY_LEN``); ``max_seq_len`` bounds ``seq_lens`` (it
    sizes the grid; under a CUDA graph pass max_model_len). ``new_kv`` None: the step's
    K/V must already be in the cache; else ``(key, value, slot_mapping)`` ([num_tokens,
    num_kv_heads, head_dim] each, unit-stride last dim; [num_tokens] slots, -1 for none)
    are written at their slots here first. ``sliding_window``, ``logits_soft_cap``,
    ``k_scale``/``v_scale`` as in ``paged_decode_attention``; ``config`` None:
    ``verify_config`` of the request count (its ``merge_in_kernel`` is not read).
    ``rotary``: as in ``paged_decode_attention`` (``positions`` one per token); ``sinks``
    too. Returns ``out`` ([num_tokens, num_heads, head_dim]).
    """
    num_tokens, num_heads, head_dim = query.shape
    num_reqs = seq_lens.shape[0]
    num_kv_heads, block_size = key_cache.shape[1], key_cache.shape[2]
    group_size = num_heads // num_kv_heads
    if out is None:
        out = torch.empty_like(query)
    if num_tokens == 0 or num_reqs == 0:
        return out
    if not 1 <= max_query_len <= MAX_QUERY_LEN:
        raise ValueError(
            f"paged_verify_attention takes 1..{MAX_QUERY_LEN} tokens per request, got "
            f"max_query_len={max_query_len}; use paged_prefill_attention."
        )
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1, got {sliding_window}.")
    check_sinks(sinks, num_heads)
    fp8 = is_fp8(key_cache.dtype)
    if fp8 and (k_scale is None or v_scale is None):
        raise ValueError("an FP8 KV cache needs k_scale and v_scale.")
    if config is None:
        config = verify_config(num_reqs, num_kv_heads, head_dim, fp8)
    partition, block_n = config.partition, min(config.block_n, config.partition)
    if new_kv is not None:
        new_key, new_value, slot_mapping = new_kv
        if new_key.stride(-1) != 1 or new_value.stride(-1) != 1:
            raise ValueError("new_kv's key and value need a unit-stride head dim.")
    else:
        new_key = new_value = query  # unused
        slot_mapping = seq_lens
    rotary_args, rotary_flags = fused_rotary_args(rotary, head_dim, new_kv is not None, seq_lens)
    max_partitions = max(1, triton.cdiv(max_seq_len, partition))
    direct = max_partitions == 1
    if direct:
        partial_out = partial_lse = out  # unused
    else:
        partial_out = torch.empty(
            (num_tokens, num_heads, max_partitions, head_dim),
            dtype=torch.float32,
            device=query.device,
        )
        partial_lse = torch.empty(
            (num_tokens, num_heads, max_partitions), dtype=torch.float32, device=query.device
        )
    block_d = max(16, triton.next_power_of_2(head_dim))
    block_m = max(16, triton.next_power_of_2(max_query_len * group_size))
    merge_g = triton.next_power_of_2(group_size)
    merge_p = max(1, min(MERGE_TILE // (merge_g * block_d), MERGE_CONTEXT // partition))
    score_scale, cap_log2e = score_args(scale, logits_soft_cap)
    window = sliding_window or 0
    common = dict(PARTITION=partition, BLOCK_D=block_d, USE_WINDOW=sliding_window is not None)
    _verify_kernel[(num_reqs, num_kv_heads, max_partitions)](
        query, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
        new_key, new_value, slot_mapping,
        k_scale if fp8 else seq_lens, v_scale if fp8 else seq_lens,
        out, partial_out, partial_lse, *rotary_args[:4], sinks,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        new_key.stride(0), new_key.stride(1), new_value.stride(0), new_value.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), block_tables.stride(0),
        max_partitions, num_heads, score_scale, cap_log2e, window, group_size,
        head_dim, *rotary_args[4:],
        BLOCK_SIZE=block_size, BLOCK_N=block_n, BLOCK_M=block_m,
        BLOCK_Q=triton.next_power_of_2(max_query_len),
        DIRECT=direct, WRITE_NEW=new_kv is not None,
        USE_SOFT_CAP=logits_soft_cap is not None, FP8=fp8,
        COMPUTE_DTYPE=tl.float16 if fp8 else _TL_DTYPES[query.dtype],
        HAS_SINKS=sinks is not None, num_warps=config.num_warps,
        num_stages=config.num_stages, **common, **rotary_flags, **pdl.launch_options(),
    )  # fmt: skip
    if not direct:
        _verify_merge_kernel[(num_reqs, num_kv_heads, max_query_len)](
            out, partial_out, partial_lse, seq_lens, query_start_loc,
            out.stride(0), out.stride(1), max_partitions, num_heads, group_size, head_dim,
            window, MERGE_G=merge_g, MERGE_P=merge_p, **common, sinks_ptr=sinks,
            HAS_SINKS=sinks is not None, **pdl.launch_options(),
        )  # fmt: skip
    return out
