"""Latent attention (DeepSeek's multi-head latent attention, MLA) over a latent paged cache.

A latent layer caches one vector of ``head_dim`` features per token (DeepSeek: the 512
compressed KV features, then the 64 rotary features of the shared key) and every query
head attends over it: a key is the whole vector, its value its first ``value_dim``
features. The general kernels would pad the 576 features to 1,024 and read the same key
once per head; these split each key into its value part ``[0, value_dim)`` and its tail
``[value_dim, head_dim)``, each padded to a power of two (576 = 512 + 64 exactly), and read
every key tile once for all the query rows of a program:
``scores = q_main @ k_main^T + q_tail @ k_tail^T``, ``acc += p @ k_main``.

Cache layout: the Triton backend's ``[num_blocks, 1, block_size, head_dim]`` (one kv head).

One kernel, two configurations (``latent_config``):

- split (steps of at most ``MAX_SPLIT_QUERY_LEN`` tokens per request: decodes and
  speculative verifications): grid (request, query tile, head block x split). A program's
  ``SPLIT_ROWS`` rows are (token, head) pairs of one request, heads fastest (a decode with
  16 heads or more: one token's 16 heads; fewer heads: several tokens), over one of
  ``num_splits`` contiguous key ranges of the sequence (each a multiple of ``BLOCK_N``).
  Each split stores its partial output and log-sum-exp; a merge kernel, one program per
  (token, head), combines them in split order. The split count comes from the batch's
  CUDA-graph bucket, the heads and ``max_query_len`` only (never from ``max_seq_len``), so
  the grid does not grow with ``max_model_len`` under a graph, the partials stay small,
  and a graph replay and an eager step of the same bucket and query length give the same
  bits. A decode step may pass its new keys (``new_key``): the split holding the last
  position attends to it from there (after its cached keys) rather than from the cache,
  and that split's first head block writes it at its slot, which saves the write launch.
- prefill (longer queries: prompts, chunks, mixed steps): one split, so programs store
  the output directly; ``PREFILL_ROWS`` query rows of one head per program, walking the
  keys up to the tile's last causal position. The keys must be in the cache already
  (``write_latent_cache``).

Causality per row: row ``i`` of a request of ``q`` tokens over ``seq_len`` positions sees
keys ``0 .. seq_len - q + i``. A row that sees nothing in a tile or a split keeps a -inf
max (a finite stand-in is subtracted) and a zero sum; every real row sees key 0, which
lies in split 0, so the merge's max is finite. Padding rows (``seq_len`` 0, slot -1) get
zeros and write nothing.

FP8 cache (constexpr): tiles are cast to float16 after loading, the query too (clamped to
its range); ``k_scale`` is folded into the scores' scale and the output is multiplied by it
(``v_scale is k_scale``); a new key is quantized on write and attended from its quantized
value, as a later step reads it.

Not timed on a GPU yet: tile sizes, warps, stages and ``SPLIT_PROGRAMS`` are first
guesses (16 x 32 tiles at 4 warps is what the Triton MLA decode kernels of SGLang/vLLM
run), to be swept on an H100 at DeepSeek-V2-Lite's shape. What was measured is what
Triton 3.6's ``ptxas`` reports for sm_90a at 576 = 512 + 64 features (compiled without a
GPU, as ``tests/cuda/ptxas_decode_attention.py`` does): the bf16 decode (16 rows, 32-key
tiles, 4 warps, the new key written) 240 registers, no spills, 54 KiB of shared memory,
two programs per SM; it spilled 488 bytes while the new key was loaded before the key
loop, which is why it is read after it, and the query again with it. An FP8 cache's
decode spilled 68 bytes at 32-key tiles and none at 16 (252 registers).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from pagedlm.kv_cache.fp8 import is_fp8
from pagedlm_cuda.kernels.decode_config import batch_bucket
from pagedlm_cuda.kernels.kv_tile import fp8_store_value

MAX_SPLIT_QUERY_LEN = 8
"""Tokens per request up to which a step takes the split configuration (1 + 7 drafts)."""

SPLIT_ROWS = 16
"""(token, head) rows per program of a split step: ``tl.dot``'s smallest M."""

PREFILL_ROWS = 32
"""Query rows per program of a prefill step: a [32, 512] float32 accumulator is 64
registers per thread at 8 warps (244 in all at 576 = 512 + 64 features in bf16, no spills;
4 warps spilled 196 bytes, 64 rows 132)."""

SPLIT_PROGRAMS = 512
"""Programs a split step aims at (about four per SM of an H100) before splitting no more."""

MAX_SPLITS = 32
MERGE_CHUNK = 4
"""Splits the merge reads per iteration (independent loads in flight)."""


class LatentConfig(NamedTuple):
    tokens: int
    """Query tokens per program."""
    heads: int
    """Query heads per program (``tokens * heads`` rows, heads fastest)."""
    block_n: int
    """Keys per tile."""
    num_splits: int
    """Key ranges per request (1: the output is stored directly, no merge)."""
    num_warps: int
    num_stages: int


def latent_config(
    num_reqs: int,
    num_heads: int,
    max_query_len: int,
    value_dim: int,
    element_size: int,
    fp8: bool = False,
) -> LatentConfig:
    """The launch configuration of a step: split for short queries, prefill for long.
    ``element_size``: the query's bytes per element; ``fp8``: the cache is float8."""
    value_block = triton.next_power_of_2(value_dim)
    # 16-key tiles where 32 spill at 512 value features (sm_90a, ptxas): an FP8 cache's
    # tiles are converted in registers, and float32 tiles are twice as wide.
    block_n = 16 if value_block >= 256 and (fp8 or element_size > 2) else 32
    if max_query_len > MAX_SPLIT_QUERY_LEN:
        return LatentConfig(PREFILL_ROWS, 1, block_n, 1, num_warps=8 if value_block >= 256 else 4,
                            num_stages=2)  # fmt: skip
    heads = min(triton.next_power_of_2(num_heads), SPLIT_ROWS)
    tokens = SPLIT_ROWS // heads
    programs = batch_bucket(num_reqs) * triton.cdiv(num_heads, heads)
    programs *= triton.cdiv(max_query_len, tokens)
    splits = 1
    while splits < MAX_SPLITS and 2 * splits * programs <= SPLIT_PROGRAMS:
        splits *= 2
    return LatentConfig(tokens, heads, block_n, splits, num_warps=4, num_stages=2)


@triton.jit
def _split_range(seq_len, split, NUM_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr):
    """(keys per split, first key, end) of ``split``: contiguous ranges of whole tiles."""
    per_split = tl.cdiv(tl.cdiv(tl.maximum(seq_len, 1), NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * per_split
    return per_split, start, tl.minimum(start + per_split, seq_len)


@triton.jit
def _load_query(
    q_rows, row_mask, v_dims, v_mask, t_dims, t_mask, value_dim, FP8: tl.constexpr,
    COMPUTE_DTYPE: tl.constexpr,
):  # fmt: skip
    """The rows' queries (value part, tail) in the dtype of the dots: an FP8 cache's are
    float16, clamped to its range."""
    main_mask = row_mask[:, None] & v_mask[None, :]
    q_main = tl.load(q_rows + v_dims[None, :], mask=main_mask, other=0.0)
    tail_mask = row_mask[:, None] & t_mask[None, :]
    q_tail = tl.load(q_rows + value_dim + t_dims[None, :], mask=tail_mask, other=0.0)
    if FP8:
        q_main = tl.clamp(q_main.to(tl.float32), -65504.0, 65504.0)
        q_tail = tl.clamp(q_tail.to(tl.float32), -65504.0, 65504.0)
    return q_main.to(COMPUTE_DTYPE), q_tail.to(COMPUTE_DTYPE)


@triton.jit
def _write_and_attend_new_key(
    m, denom, acc, q_rows, row_mask, score_scale, k_scale, new_key_ptr, new_key_stride,
    slot_mapping_ptr, token, cache_ptr, cache_stride_block, cache_stride_slot, writes,
    v_dims, v_mask, t_dims, t_mask, value_dim, BLOCK_SIZE: tl.constexpr, FP8: tl.constexpr,
    COMPUTE_DTYPE: tl.constexpr,
):  # fmt: skip
    """A decode's new key (row ``token`` of ``new_key``): stored at its slot when
    ``writes`` (one program of the split that holds it; a slot of -1 stores nothing), and
    one more online-softmax step for every row, in float32, over the value as stored (a
    later step reads it so). The query is read again rather than kept through the loop
    in a second layout (registers)."""
    key_row = new_key_ptr + token.to(tl.int64) * new_key_stride
    cache_dtype = cache_ptr.dtype.element_ty
    main = tl.load(key_row + v_dims, mask=v_mask, other=0.0)
    main = fp8_store_value(main, k_scale, cache_dtype, FP8)
    tail = tl.load(key_row + value_dim + t_dims, mask=t_mask, other=0.0)
    tail = fp8_store_value(tail, k_scale, cache_dtype, FP8)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if writes & (slot >= 0):
        row = (slot // BLOCK_SIZE) * cache_stride_block + (slot % BLOCK_SIZE) * cache_stride_slot
        tl.store(cache_ptr + row + v_dims, main, mask=v_mask)
        tl.store(cache_ptr + row + value_dim + t_dims, tail, mask=t_mask)
    q_main, q_tail = _load_query(
        q_rows, row_mask, v_dims, v_mask, t_dims, t_mask, value_dim, FP8, COMPUTE_DTYPE
    )
    main = main.to(tl.float32)
    dots = tl.sum(q_main.to(tl.float32) * main[None, :], axis=1)
    dots += tl.sum(q_tail.to(tl.float32) * tail.to(tl.float32)[None, :], axis=1)
    s_new = dots * score_scale
    m_new = tl.maximum(m, s_new)
    p_new = tl.exp2(s_new - m_new)
    alpha = tl.exp2(m - m_new)
    return m_new, denom * alpha + p_new, acc * alpha[:, None] + p_new[:, None] * main[None, :]


# The block-table width changes from step to step: not specialized on, so it never
# triggers a compile mid-run.
@triton.jit(do_not_specialize=["block_table_stride"])
def _latent_kernel(
    q_ptr, cache_ptr, block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
    new_key_ptr, slot_mapping_ptr, k_scale_ptr, out_ptr, partial_out_ptr, partial_lse_ptr,
    q_stride_token, q_stride_head, out_stride_token, out_stride_head, new_key_stride,
    cache_stride_block, cache_stride_slot, block_table_stride,
    num_heads, value_dim, tail_dim, score_scale,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, TOKENS: tl.constexpr,
    HEADS: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_T: tl.constexpr,
    NUM_SPLITS: tl.constexpr, WRITE_NEW: tl.constexpr, FP8: tl.constexpr,
    COMPUTE_DTYPE: tl.constexpr,
):  # fmt: skip
    req = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    head_block = tl.program_id(2) // NUM_SPLITS
    split = tl.program_id(2) % NUM_SPLITS
    q_start = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    if tile * TOKENS >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + req)
    per_split, start, end = _split_range(seq_len, split, NUM_SPLITS, BLOCK_N)
    if NUM_SPLITS > 1 and start >= end:
        return  # past the sequence (a padding row: all); the merge reads no such split
    context_len = seq_len - q_len
    # The tile's last row sees keys up to its own position.
    kv_end = tl.minimum(end, context_len + tl.minimum((tile + 1) * TOKENS, q_len))

    row = tl.arange(0, TOKENS * HEADS)
    token = tile * TOKENS + row // HEADS
    head = head_block * HEADS + row % HEADS
    row_mask = (token < q_len) & (head < num_heads)
    position = context_len + token
    tokens = (q_start + token).to(tl.int64)
    v_dims = tl.arange(0, BLOCK_V)
    v_mask = v_dims < value_dim
    t_dims = tl.arange(0, BLOCK_T)
    t_mask = t_dims < tail_dim
    q_rows = q_ptr + tokens[:, None] * q_stride_token + head[:, None] * q_stride_head
    k_scale = 1.0
    if FP8:
        k_scale = tl.load(k_scale_ptr).to(tl.float32)
        score_scale = score_scale * k_scale
    q_main, q_tail = _load_query(
        q_rows, row_mask, v_dims, v_mask, t_dims, t_mask, value_dim, FP8, COMPUTE_DTYPE
    )

    cached_end = kv_end
    if WRITE_NEW:
        # A decode: the last position is not read from the cache but from new_key, after
        # the loop (so the new key holds no registers during it).
        cached_end = tl.minimum(kv_end, seq_len - 1)

    table = block_tables_ptr + req * block_table_stride
    m = tl.full([TOKENS * HEADS], float("-inf"), tl.float32)
    denom = tl.zeros([TOKENS * HEADS], tl.float32)
    acc = tl.zeros([TOKENS * HEADS, BLOCK_V], tl.float32)
    for n0 in range(start, cached_end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        pos_mask = pos < cached_end
        block = tl.load(table + pos // BLOCK_SIZE, mask=pos_mask, other=0).to(tl.int64)
        key_rows = cache_ptr + block * cache_stride_block + (pos % BLOCK_SIZE) * cache_stride_slot
        k_main = tl.load(
            key_rows[:, None] + v_dims[None, :], mask=pos_mask[:, None] & v_mask[None, :],
            other=0.0,
        ).to(COMPUTE_DTYPE)  # fmt: skip
        k_tail = tl.load(
            key_rows[:, None] + value_dim + t_dims[None, :],
            mask=pos_mask[:, None] & t_mask[None, :], other=0.0,
        ).to(COMPUTE_DTYPE)  # fmt: skip
        s = tl.dot(q_tail, tl.trans(k_tail), tl.dot(q_main, tl.trans(k_main))) * score_scale
        visible = pos_mask[None, :] & (pos[None, :] <= position[:, None])
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        # A row may see nothing in this tile (a draft token's split, a verification row
        # before it): subtract a finite stand-in so no -inf - -inf makes a NaN.
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_ref[:, None])
        alpha = tl.exp2(m - m_ref)
        denom = denom * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(COMPUTE_DTYPE), k_main)
        m = m_new
    if WRITE_NEW:  # noqa: SIM102 - a compile-time switch around a runtime test
        if split == tl.where(seq_len > 0, (seq_len - 1) // per_split, -1):
            m, denom, acc = _write_and_attend_new_key(
                m, denom, acc, q_rows, row_mask, score_scale, k_scale, new_key_ptr,
                new_key_stride, slot_mapping_ptr, q_start, cache_ptr, cache_stride_block,
                cache_stride_slot, head_block == 0, v_dims, v_mask, t_dims, t_mask, value_dim,
                BLOCK_SIZE, FP8, COMPUTE_DTYPE,
            )  # fmt: skip

    safe_denom = tl.where(denom > 0, denom, 1.0)
    out = acc / safe_denom[:, None]
    if FP8:
        out = out * k_scale
    mask = row_mask[:, None] & v_mask[None, :]
    if NUM_SPLITS == 1:
        dst = out_ptr + tokens[:, None] * out_stride_token + head[:, None] * out_stride_head
        tl.store(dst + v_dims[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        partial = (tokens * num_heads + head) * NUM_SPLITS + split
        tl.store(partial_out_ptr + partial[:, None] * value_dim + v_dims[None, :], out, mask=mask)
        tl.store(partial_lse_ptr + partial, m + tl.log2(safe_denom), mask=row_mask)


@triton.jit
def _latent_merge_kernel(
    out_ptr, partial_out_ptr, partial_lse_ptr, seq_lens_ptr, query_start_loc_ptr,
    out_stride_token, out_stride_head, num_heads, value_dim,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, NUM_SPLITS: tl.constexpr,
    CHUNK: tl.constexpr,
):  # fmt: skip
    """One (token, head): its splits' partial outputs weighted by their log-sum-exp, in
    split order. A padding row (no split) gets zeros."""
    req = tl.program_id(0).to(tl.int64)
    token = tl.program_id(1)
    head = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + req)
    if token >= tl.load(query_start_loc_ptr + req + 1) - q_start:
        return
    seq_len = tl.load(seq_lens_ptr + req)
    per_split, _start, _end = _split_range(seq_len, 0, NUM_SPLITS, BLOCK_N)
    num_used = tl.cdiv(seq_len, per_split)
    base = ((q_start + token).to(tl.int64) * num_heads + head) * NUM_SPLITS
    splits = tl.arange(0, NUM_SPLITS)
    lse = tl.load(partial_lse_ptr + base + splits, mask=splits < num_used, other=float("-inf"))
    top = tl.max(lse, axis=0)
    top = tl.where(top == float("-inf"), 0.0, top)
    denom = tl.sum(tl.exp2(lse - top), axis=0)
    v_dims = tl.arange(0, BLOCK_V)
    v_mask = v_dims < value_dim
    acc = tl.zeros([BLOCK_V], tl.float32)
    for s0 in range(0, num_used, CHUNK):
        chunk = s0 + tl.arange(0, CHUNK)
        used = chunk < num_used
        weight = tl.exp2(
            tl.load(partial_lse_ptr + base + chunk, mask=used, other=float("-inf")) - top
        )
        partial = tl.load(
            partial_out_ptr + (base + chunk)[:, None] * value_dim + v_dims[None, :],
            mask=used[:, None] & v_mask[None, :], other=0.0,
        )  # fmt: skip
        acc += tl.sum(partial * weight[:, None], axis=0)
    out = acc / tl.where(denom > 0, denom, 1.0)
    dst = out_ptr + (q_start + token).to(tl.int64) * out_stride_token + head * out_stride_head
    tl.store(dst + v_dims, out.to(out_ptr.dtype.element_ty), mask=v_mask)


@triton.jit
def _write_latent_kernel(
    key_ptr, cache_ptr, slot_mapping_ptr, k_scale_ptr, key_stride, cache_stride_block,
    cache_stride_slot, head_dim, BLOCK_SIZE: tl.constexpr, BLOCK_D: tl.constexpr,
    FP8: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return  # a padding row of a CUDA-graph batch has no slot
    dims = tl.arange(0, BLOCK_D)
    mask = dims < head_dim
    key = tl.load(key_ptr + token * key_stride + dims, mask=mask)
    k_scale = 1.0
    if FP8:
        k_scale = tl.load(k_scale_ptr).to(tl.float32)
    dst = (
        cache_ptr
        + (slot // BLOCK_SIZE) * cache_stride_block
        + (slot % BLOCK_SIZE) * cache_stride_slot
    )
    tl.store(dst + dims, fp8_store_value(key, k_scale, cache_ptr.dtype.element_ty, FP8), mask=mask)


def write_latent_cache(
    key: torch.Tensor,
    cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
) -> None:
    """Store ``key[t]`` at slot ``slot_mapping[t]`` of a latent cache, once, in place.

    key: [num_tokens, 1, head_dim] (unit-stride last dim); cache: [num_blocks, 1,
    block_size, head_dim]; a negative slot skips its token. A float8 cache needs
    ``k_scale`` (float32 [1]) and stores ``saturate(key / k_scale)``.
    """
    _check_latent_cache(key, cache)
    fp8 = _fp8_scale(cache, k_scale)
    if key.shape[0] == 0:
        return
    _write_latent_kernel[(key.shape[0],)](
        key, cache, slot_mapping, k_scale if fp8 else slot_mapping, key.stride(0),
        cache.stride(0), cache.stride(2), cache.shape[3], BLOCK_SIZE=cache.shape[2],
        BLOCK_D=triton.next_power_of_2(cache.shape[3]), FP8=fp8,
    )  # fmt: skip


_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


def paged_latent_attention(
    query: torch.Tensor,
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    value_dim: int,
    max_query_len: int,
    out: torch.Tensor | None = None,
    *,
    new_key: torch.Tensor | None = None,
    slot_mapping: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    config: LatentConfig | None = None,
) -> torch.Tensor:
    """Causal latent attention of every scheduled token over its request's cached keys.

    query: [num_tokens, num_heads, head_dim]; cache: [num_blocks, 1, block_size,
    head_dim], a key's first ``value_dim`` features being its value; block_tables:
    [num_reqs, max_blocks] int32; seq_lens: [num_reqs] int32 (0: a padding row, which gets
    zeros); query_start_loc: [num_reqs + 1] int32; max_query_len bounds the query lengths
    (it sizes the grid). Returns [num_tokens, num_heads, value_dim] in the query's dtype.
    ``new_key`` None: every key, this step's included, is in the cache already. Else (a
    decode step, ``max_query_len`` 1) ``new_key`` [num_reqs, 1, head_dim] is each
    request's last key, written here at ``slot_mapping`` (-1: nowhere). A float8 cache
    needs ``k_scale`` (float32 [1]). ``config`` None: ``latent_config``'s for the step.
    """
    num_tokens, num_heads, head_dim = query.shape
    num_reqs = seq_lens.shape[0]
    if not 0 < value_dim < head_dim:
        raise ValueError(f"value_dim must be in 1 .. {head_dim - 1}, got {value_dim}.")
    if query.stride(-1) != 1:
        raise ValueError("the query needs a unit-stride head dim.")
    if cache.shape[1] != 1 or cache.shape[3] != head_dim:
        raise ValueError(
            f"a latent cache is [num_blocks, 1, block_size, {head_dim}], got {tuple(cache.shape)}."
        )
    fp8 = _fp8_scale(cache, k_scale)
    if out is None:
        out = torch.empty(
            (num_tokens, num_heads, value_dim), dtype=query.dtype, device=query.device
        )
    if num_tokens == 0 or num_reqs == 0:
        return out
    if new_key is not None:
        if max_query_len != 1 or slot_mapping is None:
            raise ValueError("new_key is for decode steps (max_query_len 1) with a slot_mapping.")
        _check_latent_cache(new_key, cache)
    if config is None:
        config = latent_config(
            num_reqs, num_heads, max_query_len, value_dim, query.element_size(), fp8
        )
    splits = config.num_splits
    if splits & (splits - 1) or (splits > 1 and max_query_len > MAX_SPLIT_QUERY_LEN):
        raise ValueError(f"num_splits={splits}: a power of two, 1 past short queries.")
    partial_out = partial_lse = out  # unused with one split
    if splits > 1:
        partial_out = torch.empty(
            (num_tokens, num_heads, splits, value_dim), dtype=torch.float32, device=query.device
        )
        partial_lse = torch.empty(
            (num_tokens, num_heads, splits), dtype=torch.float32, device=query.device
        )
    block_v = max(16, triton.next_power_of_2(value_dim))  # tl.dot needs K >= 16
    head_blocks = triton.cdiv(num_heads, config.heads)
    grid = (num_reqs, triton.cdiv(max_query_len, config.tokens), head_blocks * splits)
    key_arg = query if new_key is None else new_key
    _latent_kernel[grid](
        query, cache, block_tables, seq_lens, query_start_loc,
        key_arg, seq_lens if slot_mapping is None else slot_mapping,
        k_scale if fp8 else seq_lens, out, partial_out, partial_lse,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1), key_arg.stride(0),
        cache.stride(0), cache.stride(2), block_tables.stride(0),
        num_heads, value_dim, head_dim - value_dim, scale * 1.4426950408889634,
        BLOCK_SIZE=cache.shape[2], BLOCK_N=config.block_n, TOKENS=config.tokens,
        HEADS=config.heads, BLOCK_V=block_v,
        BLOCK_T=max(16, triton.next_power_of_2(head_dim - value_dim)),
        NUM_SPLITS=splits, WRITE_NEW=new_key is not None, FP8=fp8,
        COMPUTE_DTYPE=tl.float16 if fp8 else _TL_DTYPES[query.dtype],
        num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
    if splits > 1:
        _latent_merge_kernel[(num_reqs, max_query_len, num_heads)](
            out, partial_out, partial_lse, seq_lens, query_start_loc,
            out.stride(0), out.stride(1), num_heads, value_dim,
            BLOCK_N=config.block_n, BLOCK_V=block_v, NUM_SPLITS=splits,
            CHUNK=min(MERGE_CHUNK, splits),
        )  # fmt: skip
    return out


def _check_latent_cache(key: torch.Tensor, cache: torch.Tensor) -> None:
    if key.dim() != 3 or key.shape[1] != 1 or key.stride(-1) != 1:
        raise ValueError(f"latent keys are [num_tokens, 1, head_dim], got {tuple(key.shape)}.")
    if cache.dim() != 4 or cache.shape[1] != 1 or cache.shape[3] != key.shape[2]:
        raise ValueError(
            f"a latent cache is [num_blocks, 1, block_size, {key.shape[2]}], got "
            f"{tuple(cache.shape)}; allocate it with TritonAttentionBackend.kv_cache_shape."
        )
    if not cache.is_contiguous():
        raise ValueError("the latent cache must be contiguous.")


def _fp8_scale(cache: torch.Tensor, k_scale: torch.Tensor | None) -> bool:
    """Whether ``cache`` is float8, whose reads and writes need ``k_scale``."""
    fp8 = is_fp8(cache.dtype)
    if fp8 and k_scale is None:
        raise ValueError("an FP8 latent cache needs k_scale.")
    return fp8
