"""Triton paged-attention kernels and the KV write against a float64 reference.

On CPU these run under ``TRITON_INTERPRET=1`` at small sizes; on a GPU (``-m cuda``) the
``full`` cases add long contexts. Every case draws fresh random inputs, scatters the
blocks of each request randomly over the cache and poisons the output first.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
from triton_env import DEVICE, ON_GPU, rel_error, tolerance

from pagedlm_cuda.kernels import paged_decode_attention, paged_prefill_attention, write_kv_cache

# Triton 3.6's interpreter multiplies bf16 operands of tl.dot as raw bits, so interpreted
# cases use float16 instead; on the GPU the small cases run in bf16 as written.
SMALL_BF16 = torch.bfloat16 if ON_GPU else torch.float16

cuda_only = pytest.mark.skipif(not ON_GPU, reason="full sizes need a GPU")


def make_cache(
    seq_lens: list[int], block_size: int, num_kv_heads: int, head_dim: int, dtype, seed: int
):
    """Random caches with each request's blocks at random ids; returns tables too."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_req = [math.ceil(s / block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_req) + 3
    ids = list(range(num_blocks))
    random.Random(seed).shuffle(ids)
    tables, cursor = [], 0
    for n in blocks_per_req:
        tables.append(ids[cursor : cursor + n])
        cursor += n
    width = max(blocks_per_req)
    table_tensor = torch.zeros((len(seq_lens), width), dtype=torch.int32)
    for i, t in enumerate(tables):
        table_tensor[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.randn(shape, generator=gen).to(dtype)
    value_cache = torch.randn(shape, generator=gen).to(dtype)
    return key_cache.to(DEVICE), value_cache.to(DEVICE), table_tensor.to(DEVICE), tables


def reference(query, key_cache, value_cache, tables, seq_lens, query_lens, scale):
    """float64 causal attention, one request at a time. query: [T, H, D] (CPU)."""
    q64 = query.double().cpu()
    kc, vc = key_cache.double().cpu(), value_cache.double().cpu()
    num_kv_heads = kc.shape[2]
    group = q64.shape[1] // num_kv_heads
    outs, row = [], 0
    for table, seq_len, q_len in zip(tables, seq_lens, query_lens):
        k = kc[table].reshape(-1, num_kv_heads, kc.shape[-1])[:seq_len]
        v = vc[table].reshape(-1, num_kv_heads, kc.shape[-1])[:seq_len]
        k = k.repeat_interleave(group, dim=1).transpose(0, 1)  # [H, S, D]
        v = v.repeat_interleave(group, dim=1).transpose(0, 1)
        q = q64[row : row + q_len].transpose(0, 1)  # [H, Q, D]
        scores = q @ k.transpose(1, 2) * scale
        q_pos = torch.arange(seq_len - q_len, seq_len)[:, None]
        scores = scores.masked_fill(torch.arange(seq_len)[None, :] > q_pos, float("-inf"))
        outs.append((scores.softmax(-1) @ v).transpose(0, 1))
        row += q_len
    return torch.cat(outs)


DECODE_CASES = [
    # block_size, head_dim, num_kv_heads, group, seq_lens, dtype
    (16, 64, 2, 1, [1, 17, 40], torch.float32),
    (16, 128, 1, 4, [5, 300, 33], torch.float32),
    (32, 64, 1, 8, [64, 1, 530], SMALL_BF16),
    (32, 128, 2, 4, [290], torch.float16),
]
FULL_DECODE_CASES = [
    (16, 128, 8, 4, [8192, 1, 3000, 4097], torch.bfloat16),
    (32, 64, 8, 8, [7000, 513, 256], torch.bfloat16),
    (16, 128, 8, 1, [2048] * 8, torch.float16),
]


def check_decode(block_size, head_dim, num_kv_heads, group, seq_lens, dtype, partition=256):
    key_cache, value_cache, table, tables = make_cache(
        seq_lens, block_size, num_kv_heads, head_dim, dtype, seed=sum(seq_lens)
    )
    num_heads = num_kv_heads * group
    query = torch.randn(len(seq_lens), num_heads, head_dim).to(dtype).to(DEVICE)
    seq_tensor = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    out = torch.full_like(query, float("nan"))
    scale = head_dim**-0.5
    paged_decode_attention(
        query, key_cache, value_cache, table, seq_tensor, scale, max(seq_lens), out, partition
    )
    ref = reference(query, key_cache, value_cache, tables, seq_lens, [1] * len(seq_lens), scale)
    assert rel_error(out, ref) < tolerance(dtype)


@pytest.mark.parametrize("case", DECODE_CASES)
def test_decode_attention(case) -> None:
    check_decode(*case, partition=128)


def test_decode_attention_single_partition_and_padding_rows() -> None:
    """One partition writes the output directly; a padding row (seq_len 0) yields zeros."""
    check_decode(16, 64, 1, 4, [3, 70], torch.float32, partition=128)
    key_cache, value_cache, table, _ = make_cache([40], 16, 1, 64, torch.float32, seed=1)
    query = torch.randn(2, 4, 64, device=DEVICE)
    seq = torch.tensor([40, 0], dtype=torch.int32, device=DEVICE)
    table = torch.cat([table, table])
    for max_len in (64, 4096):  # direct and split paths
        out = paged_decode_attention(query, key_cache, value_cache, table, seq, 0.1, max_len)
        assert torch.equal(out[1], torch.zeros_like(out[1]))


@cuda_only
@pytest.mark.cuda
@pytest.mark.parametrize("case", FULL_DECODE_CASES)
def test_decode_attention_full(case) -> None:
    check_decode(*case)


PREFILL_CASES = [
    # block_size, head_dim, num_kv_heads, group, (query_len, context_len) per request, dtype
    (16, 64, 2, 1, [(5, 0), (1, 20), (37, 0)], torch.float32),
    (16, 128, 1, 4, [(20, 35), (3, 0)], torch.float32),  # chunked prefill over a prefix
    (32, 64, 1, 8, [(40, 33), (1, 1)], SMALL_BF16),
    (32, 128, 1, 4, [(17, 64)], torch.float16),
]
FULL_PREFILL_CASES = [
    (16, 128, 8, 4, [(1024, 0), (512, 3000), (1, 8191), (777, 7)], torch.bfloat16),
    (32, 64, 8, 8, [(2048, 2048), (100, 0)], torch.bfloat16),
    (16, 128, 4, 1, [(300, 5000)], torch.float16),
]


def check_prefill(block_size, head_dim, num_kv_heads, group, chunks, dtype, block_m=64):
    query_lens = [q for q, _ in chunks]
    seq_lens = [q + c for q, c in chunks]
    key_cache, value_cache, table, tables = make_cache(
        seq_lens, block_size, num_kv_heads, head_dim, dtype, seed=sum(seq_lens)
    )
    num_heads = num_kv_heads * group
    query = torch.randn(sum(query_lens), num_heads, head_dim).to(dtype).to(DEVICE)
    starts = [0]
    for q in query_lens:
        starts.append(starts[-1] + q)
    out = torch.full_like(query, float("nan"))
    scale = head_dim**-0.5
    paged_prefill_attention(
        query,
        key_cache,
        value_cache,
        table,
        torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        torch.tensor(starts, dtype=torch.int32, device=DEVICE),
        scale,
        max(query_lens),
        out,
        block_m=block_m,
        block_n=block_m,
    )
    ref = reference(query, key_cache, value_cache, tables, seq_lens, query_lens, scale)
    assert rel_error(out, ref) < tolerance(dtype)


@pytest.mark.parametrize("case", PREFILL_CASES)
def test_prefill_attention(case) -> None:
    check_prefill(*case, block_m=16)


@cuda_only
@pytest.mark.cuda
@pytest.mark.parametrize("case", FULL_PREFILL_CASES)
def test_prefill_attention_full(case) -> None:
    check_prefill(*case)


@pytest.mark.parametrize("block_size", [16, 32])
def test_write_kv_cache_by_slot(block_size: int) -> None:
    torch.manual_seed(block_size)
    num_blocks, num_kv_heads, head_dim = 6, 2, 64
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.randn(shape, device=DEVICE)
    value_cache = torch.randn(shape, device=DEVICE)
    expected_k, expected_v = key_cache.clone(), value_cache.clone()
    # key/value are column slices of one fused tensor, like the model's qkv split.
    fused = torch.randn(5, 3 * num_kv_heads * head_dim, device=DEVICE)
    key = fused[:, : num_kv_heads * head_dim].view(5, num_kv_heads, head_dim)
    value = fused[:, num_kv_heads * head_dim : 2 * num_kv_heads * head_dim].view(
        5, num_kv_heads, head_dim
    )
    slots = [3 * block_size + 1, 0, -1, 5 * block_size + block_size - 1, block_size]
    write_kv_cache(
        key, value, key_cache, value_cache, torch.tensor(slots, device=DEVICE, dtype=torch.long)
    )
    for t, slot in enumerate(slots):
        if slot < 0:
            continue
        expected_k[slot // block_size, slot % block_size] = key[t]
        expected_v[slot // block_size, slot % block_size] = value[t]
    assert torch.equal(key_cache, expected_k)
    assert torch.equal(value_cache, expected_v)
