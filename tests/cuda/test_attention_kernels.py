"""Triton paged-attention kernels and the KV write against a float64 reference.

On CPU these run under ``TRITON_INTERPRET=1`` at small sizes; on a GPU (``-m cuda``) the
``full`` cases add long contexts. Every case draws fresh random inputs, scatters the
blocks of each request randomly over the cache (layout ``[num_blocks, num_kv_heads,
block_size, head_dim]``) and poisons the output first. Sliding windows and soft-caps are
checked against the same reference with the window mask / ``c * tanh(s / c)`` applied.
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
SLOW = () if ON_GPU else pytest.mark.slow
"""Cases slow under the interpreter only (a GPU runs them in the default selection)."""


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
    width = max(max(blocks_per_req), 1)
    table_tensor = torch.zeros((len(seq_lens), width), dtype=torch.int32)
    for i, t in enumerate(tables):
        table_tensor[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
    shape = (num_blocks, num_kv_heads, block_size, head_dim)
    key_cache = torch.randn(shape, generator=gen).to(dtype)
    value_cache = torch.randn(shape, generator=gen).to(dtype)
    return key_cache.to(DEVICE), value_cache.to(DEVICE), table_tensor.to(DEVICE), tables


def reference(
    query, key_cache, value_cache, tables, seq_lens, query_lens, scale, window=None, cap=None,
    causal=True,
):  # fmt: skip
    """float64 attention (causal unless ``causal=False``), one request at a time. query:
    [T, H, D] (CPU)."""
    q64 = query.double().cpu()
    # [blocks, kv_heads, block_size, D] -> [blocks, block_size, kv_heads, D]
    kc = key_cache.double().cpu().transpose(1, 2)
    vc = value_cache.double().cpu().transpose(1, 2)
    num_kv_heads, head_dim = kc.shape[2], kc.shape[3]
    group = q64.shape[1] // num_kv_heads
    outs, row = [], 0
    for table, seq_len, q_len in zip(tables, seq_lens, query_lens):
        k = kc[table].reshape(-1, num_kv_heads, head_dim)[:seq_len]
        v = vc[table].reshape(-1, num_kv_heads, head_dim)[:seq_len]
        k = k.repeat_interleave(group, dim=1).transpose(0, 1)  # [H, S, D]
        v = v.repeat_interleave(group, dim=1).transpose(0, 1)
        q = q64[row : row + q_len].transpose(0, 1)  # [H, Q, D]
        scores = q @ k.transpose(1, 2) * scale
        if cap is not None:
            scores = cap * torch.tanh(scores / cap)
        q_pos = torch.arange(seq_len - q_len, seq_len)[:, None]
        k_pos = torch.arange(seq_len)[None, :]
        hidden = k_pos > q_pos if causal else torch.zeros_like(k_pos > q_pos)
        if window is not None:
            hidden |= k_pos <= q_pos - window
        scores = scores.masked_fill(hidden, float("-inf"))
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
    (16, 128, 8, 4, [1100], torch.bfloat16),  # batch 1: the smallest partitions
    (32, 128, 8, 4, [1100, 37, 2000, 5], torch.bfloat16),
    (16, 128, 8, 4, [700 + 13 * i for i in range(40)], torch.bfloat16),  # bucket 40
    (16, 256, 4, 2, [4000, 1, 900], torch.bfloat16),  # Gemma 2/3 head_dim
    (16, 96, 8, 4, [3000, 17], torch.bfloat16),  # Phi-3 head_dim
]


def take_new_kv(key_cache, value_cache, tables, seq_lens):
    """Each sequence's last K/V moved out of the cache (its slots poisoned with NaN), as a
    decode step's new token: (key, value, slot_mapping), and the intact caches."""
    block_size = key_cache.shape[2]
    slots = [t[(s - 1) // block_size] * block_size + (s - 1) % block_size for t, s in
             zip(tables, seq_lens)]  # fmt: skip
    blocks = torch.tensor([s // block_size for s in slots])
    offsets = torch.tensor([s % block_size for s in slots])
    key = key_cache[blocks, :, offsets].clone()  # [num_seqs, num_kv_heads, head_dim]
    value = value_cache[blocks, :, offsets].clone()
    intact = key_cache.clone(), value_cache.clone()
    key_cache[blocks, :, offsets] = float("nan")
    value_cache[blocks, :, offsets] = float("nan")
    slot_mapping = torch.tensor(slots, dtype=torch.int32, device=DEVICE)
    return (key, value, slot_mapping), intact


def check_decode(
    block_size, head_dim, num_kv_heads, group, seq_lens, dtype,
    partition=None, window=None, cap=None, q_scale=1.0, max_seq_len=None, write_new=False,
):  # fmt: skip
    """Decode attention against the reference; ``write_new``: the last K/V come in as
    ``new_kv`` (the cache holds NaN there) and must land in the cache."""
    key_cache, value_cache, table, tables = make_cache(
        seq_lens, block_size, num_kv_heads, head_dim, dtype, seed=sum(seq_lens)
    )
    new_kv = None
    if write_new:
        new_kv, intact = take_new_kv(key_cache, value_cache, tables, seq_lens)
    num_heads = num_kv_heads * group
    query = (q_scale * torch.randn(len(seq_lens), num_heads, head_dim)).to(dtype).to(DEVICE)
    seq_tensor = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    out = torch.full_like(query, float("nan"))
    scale = head_dim**-0.5
    paged_decode_attention(
        query, key_cache, value_cache, table, seq_tensor, scale,
        max_seq_len or max(seq_lens), out, partition,
        new_kv=new_kv, sliding_window=window, logits_soft_cap=cap,
    )  # fmt: skip
    if write_new:
        assert torch.equal(key_cache, intact[0]) and torch.equal(value_cache, intact[1])
    args = (query, key_cache, value_cache, tables, seq_lens, [1] * len(seq_lens), scale)
    ref = reference(*args, window=window, cap=cap)
    assert rel_error(out, ref) < tolerance(dtype)
    return ref, reference(*args)


@pytest.mark.parametrize("case", DECODE_CASES)
def test_decode_attention(case) -> None:
    check_decode(*case, partition=128)


def test_decode_attention_batch_sized_partitions() -> None:
    """No partition given: small batches split into 32-key partitions (17 of them at 530
    keys). With a group of 8 and head_dim 128 the merge takes 16 partitions at a time, so
    19 of them (and a window's last 13) take more than one chunk."""
    check_decode(32, 64, 2, 4, [530, 3, 77], torch.float32)
    check_decode(16, 64, 1, 4, [600], torch.float32, partition=16)
    check_decode(16, 128, 1, 8, [300, 45], torch.float32, partition=16)
    check_decode(16, 128, 1, 8, [300, 45], torch.float32, partition=16, window=190)


def test_decode_attention_single_partition_and_padding_rows() -> None:
    """One partition writes the output directly; a padding row (seq_len 0) yields zeros."""
    check_decode(16, 64, 1, 4, [3, 70], torch.float32, partition=128)
    key_cache, value_cache, table, _ = make_cache([40], 16, 1, 64, torch.float32, seed=1)
    query = torch.randn(2, 4, 64, device=DEVICE)
    seq = torch.tensor([40, 0], dtype=torch.int32, device=DEVICE)
    table = torch.cat([table, table])
    for max_len in (32, 4096):  # direct and split paths
        for window in (None, 8):
            out = paged_decode_attention(
                query, key_cache, value_cache, table, seq, 0.1, max_len, sliding_window=window
            )
            assert torch.equal(out[1], torch.zeros_like(out[1]))


@pytest.mark.parametrize("partition", [16, 128])
@pytest.mark.parametrize("window", [None, 20])
def test_decode_attention_writes_the_new_kv(partition: int, window: int | None) -> None:
    """The new token's K/V, passed along, are used for the last position and written at
    their slots by the program that holds that position (split and direct paths)."""
    check_decode(16, 64, 2, 4, [1, 17, 40, 90], torch.float32, partition, window, write_new=True)
    check_decode(32, 128, 1, 8, [64, 33], SMALL_BF16, partition, window, write_new=True)
    check_decode(16, 64, 2, 4, [45, 200], torch.float32, partition, window, cap=3.0,
                 q_scale=6, write_new=True)  # fmt: skip


def rotary_inputs(head_dim: int, dtype: torch.dtype, qk_norm: bool, gen: torch.Generator):
    """A cos/sin table for 128 positions and, with ``qk_norm``, (q, k) norm weights and
    epsilon, as ``FusedRotary`` takes them."""
    half = torch.arange(0, head_dim, 2) / head_dim
    angles = torch.outer(torch.arange(128.0), 1.0 / 10000**half)
    cos_sin = torch.cat([angles.cos(), angles.sin()], dim=-1).to(DEVICE)
    if not qk_norm:
        return cos_sin, None
    weights = (1 + 0.3 * torch.randn(2, head_dim, generator=gen)).to(dtype).to(DEVICE)
    return cos_sin, (weights[0], weights[1], 1e-6)


# 16-key partitions take ~7 s a case under the interpreter: one runs by default (both
# options on), the rest with -m slow.
FUSED_ROTARY_CASES = [
    pytest.param(
        neox, qk_norm, partition, marks=() if partition == 128 or (neox and qk_norm) else SLOW
    )
    for partition in (16, 128)
    for qk_norm in (False, True)
    for neox in (True, False)
]


@pytest.mark.parametrize(("neox", "qk_norm", "partition"), FUSED_ROTARY_CASES)
def test_decode_attention_fused_rotary(neox: bool, qk_norm: bool, partition: int) -> None:
    """With ``rotary`` the kernel rotates (after normalizing) the query and the new key
    itself: the cache gets exactly the key the separate rotary kernel makes, and the output
    matches the rotary kernel followed by the plain decode kernel."""
    from pagedlm.attention.backend import FusedRotary
    from pagedlm_cuda.kernels import rotary_embedding

    dtype, head_dim, num_kv_heads, group, seq_lens = SMALL_BF16, 64, 2, 4, [1, 17, 90]
    key_cache, value_cache, table, tables = make_cache(
        seq_lens, 16, num_kv_heads, head_dim, dtype, seed=7
    )
    new_kv, _ = take_new_kv(key_cache, value_cache, tables, seq_lens)
    gen = torch.Generator().manual_seed(3)
    query = torch.randn(len(seq_lens), num_kv_heads * group, head_dim, generator=gen)
    query = query.to(dtype).to(DEVICE)
    positions = torch.tensor([s - 1 for s in seq_lens], device=DEVICE) + 5
    cos_sin, norms = rotary_inputs(head_dim, dtype, qk_norm, gen)
    seq_tensor = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    key, value, slots = new_kv

    # Unfused: the rotary kernel in place on copies, then the decode kernel.
    q_ref, k_ref = query.clone(), key.clone()
    rotary_embedding(
        positions, q_ref.view(len(seq_lens), -1), k_ref.view(len(seq_lens), -1), cos_sin,
        head_dim, neox, qk_norm=norms,
    )  # fmt: skip
    caches_ref = key_cache.clone(), value_cache.clone()
    expected = paged_decode_attention(
        q_ref, *caches_ref, table, seq_tensor, 0.125, 4096, None, partition,
        new_kv=(k_ref, value, slots),
    )  # fmt: skip
    fused = paged_decode_attention(
        query, key_cache, value_cache, table, seq_tensor, 0.125, 4096, None, partition,
        new_kv=new_kv, rotary=FusedRotary(positions, cos_sin, neox, norms),
    )  # fmt: skip
    assert not torch.equal(query, q_ref)  # the query itself is left as it was
    if not qk_norm and not ON_GPU:  # on a GPU the compiler may fuse other products
        assert torch.equal(key_cache, caches_ref[0])
    assert torch.equal(value_cache, caches_ref[1])
    assert rel_error(key_cache.float().nan_to_num(), caches_ref[0].float().nan_to_num()) < 1e-2
    assert rel_error(fused, expected) < tolerance(dtype)


def test_decode_attention_fused_rotary_needs_new_kv() -> None:
    from pagedlm.attention.backend import FusedRotary

    key_cache, value_cache, table, _ = make_cache([8], 16, 1, 64, torch.float32, seed=2)
    query = torch.randn(1, 4, 64, device=DEVICE)
    seq = torch.tensor([8], dtype=torch.int32, device=DEVICE)
    rotary = FusedRotary(seq, torch.zeros(16, 64, device=DEVICE), True)
    with pytest.raises(ValueError, match="needs new_kv"):
        paged_decode_attention(query, key_cache, value_cache, table, seq, 0.1, 64, rotary=rotary)


def test_decode_attention_new_kv_padding_rows_write_nothing() -> None:
    key_cache, value_cache, table, _ = make_cache([40], 16, 1, 64, torch.float32, seed=2)
    before = key_cache.clone(), value_cache.clone()
    query = torch.randn(1, 4, 64, device=DEVICE)
    new = torch.randn(1, 1, 64, device=DEVICE)
    slot = torch.tensor([-1], dtype=torch.int32, device=DEVICE)
    for max_len in (32, 4096):
        out = paged_decode_attention(
            query, key_cache, value_cache, table, torch.zeros(1, dtype=torch.int32, device=DEVICE),
            0.1, max_len, new_kv=(new, new, slot),
        )  # fmt: skip
        assert torch.equal(out, torch.zeros_like(out))
    assert torch.equal(key_cache, before[0]) and torch.equal(value_cache, before[1])


@pytest.mark.parametrize("window", [None, 150])
def test_decode_merge_kernel_and_in_kernel_merge_agree(monkeypatch, window) -> None:
    """Small batches merge in the attention kernel (last ticket), large ones in a merge
    kernel: the same merge code in the same order, so the same bits (padding row too)."""
    from pagedlm_cuda.kernels import decode_config

    seq_lens = [300, 0, 45, 1]
    key_cache, value_cache, table, _ = make_cache(seq_lens, 16, 2, 64, torch.float32, seed=3)
    query = torch.randn(len(seq_lens), 8, 64, device=DEVICE)
    seq = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    outs = []
    for limit in (0, 1 << 30):  # every batch through the merge kernel, then none
        monkeypatch.setattr(decode_config, "MERGE_IN_KERNEL_PROGRAMS", limit)
        decode_config.decode_config.cache_clear()
        assert decode_config.decode_config(4, 2, 64).merge_in_kernel == bool(limit)
        outs.append(paged_decode_attention(
            query, key_cache, value_cache, table, seq, 0.1, 4096, sliding_window=window
        ))  # fmt: skip
    decode_config.decode_config.cache_clear()
    assert torch.equal(outs[0], outs[1])
    assert torch.equal(outs[0][1], torch.zeros_like(outs[0][1]))


@pytest.mark.parametrize(
    ("merge_in_kernel", "window"),
    [  # ~9 s a case under the interpreter: the two corners by default, the rest with -m slow
        (False, None),
        (True, 150),
        pytest.param(True, None, marks=SLOW),
        pytest.param(False, 150, marks=SLOW),
    ],
)
def test_decode_programs_per_sequence_do_not_change_the_bits(merge_in_kernel, window) -> None:
    """With ``slots`` programs per (sequence, kv head), each takes every slots-th
    partition: the same partitions, the same merge, so the same bits for every count
    (fewer than a sequence's partitions, more, and one), the new K/V written once."""
    from pagedlm_cuda.kernels.decode_config import decode_config

    real = [300, 45, 1, 129]
    outs = []
    for slots in (0, 1, 2, 3, 64):
        key_cache, value_cache, table, tables = make_cache(real, 16, 2, 64, torch.float32, seed=4)
        (key, value, slot_mapping), intact = take_new_kv(key_cache, value_cache, tables, real)

        def pad(x, fill):  # a padding row (seq_len 0, slot -1) second
            return torch.cat([x[:1], torch.full_like(x[:1], fill), x[1:]])

        new_kv = pad(key, 0.0), pad(value, 0.0), pad(slot_mapping, -1)
        seq = pad(torch.tensor(real, dtype=torch.int32, device=DEVICE), 0)
        query = torch.randn(len(real) + 1, 8, 64, generator=torch.Generator().manual_seed(5))
        query = query.to(DEVICE)
        config = decode_config(4, 2, 64)._replace(
            partition=32, block_n=16, merge_in_kernel=merge_in_kernel, slots=slots
        )  # fmt: skip
        outs.append(paged_decode_attention(
            query, key_cache, value_cache, pad(table, 0), seq, 0.1, 4096, sliding_window=window,
            new_kv=new_kv, config=config,
        ))  # fmt: skip
        assert torch.equal(key_cache, intact[0]) and torch.equal(value_cache, intact[1])
    for out in outs[1:]:
        assert torch.equal(out, outs[0])
    assert torch.equal(outs[0][1], torch.zeros_like(outs[0][1]))


WINDOW_DECODE_CASES = [
    # block_size, head_dim, num_kv_heads, group, seq_lens, dtype, partition, window
    (16, 64, 2, 1, [1, 17, 40, 90], torch.float32, 32, 5),  # window < block_size
    (16, 128, 1, 4, [300, 33, 100], torch.float32, 32, 100),  # spans 4-5 partitions
    (32, 64, 1, 8, [530, 64, 65], SMALL_BF16, 64, 64),  # window == partition
    (16, 64, 2, 4, [40, 7], torch.float32, 128, 1),  # only the token itself
    (16, 96, 1, 2, [70, 20], torch.float32, 32, 30),  # head_dim not a power of two
]


@pytest.mark.parametrize("case", WINDOW_DECODE_CASES)
def test_decode_attention_sliding_window(case) -> None:
    *shape, partition, window = case
    windowed, full = check_decode(*shape, partition=partition, window=window)
    if window < max(shape[4]):
        assert rel_error(windowed, full) > 0.05  # the window is not a no-op here


@pytest.mark.parametrize("group", [1, 4])
def test_decode_attention_soft_cap_and_window(group: int) -> None:
    # Queries scaled up so scores reach the cap's bend (|s| ~ 6 > c = 3).
    capped, plain = check_decode(16, 64, 2, group, [45, 200], torch.float32, cap=3.0, q_scale=6)
    assert rel_error(capped, plain) > 0.05
    check_decode(32, 128, 1, group, [45, 200], torch.float32, 32, window=50, cap=3.0, q_scale=6)


@cuda_only
@pytest.mark.cuda
@pytest.mark.parametrize("case", FULL_DECODE_CASES)
def test_decode_attention_full(case) -> None:
    check_decode(*case)
    check_decode(*case, window=4096, cap=30.0, q_scale=8)
    check_decode(*case, window=700)
    check_decode(*case, max_seq_len=16384)  # graph-sized grid
    check_decode(*case, max_seq_len=16384, write_new=True)


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
    (16, 256, 4, 2, [(1000, 0), (200, 3000)], torch.bfloat16),
    (16, 96, 8, 4, [(1000, 50), (7, 100)], torch.bfloat16),
]


def check_prefill(
    block_size, head_dim, num_kv_heads, group, chunks, dtype,
    block_m=64, window=None, cap=None, q_scale=1.0, causal=True,
):  # fmt: skip
    query_lens = [q for q, _ in chunks]
    seq_lens = [q + c for q, c in chunks]
    key_cache, value_cache, table, tables = make_cache(
        seq_lens, block_size, num_kv_heads, head_dim, dtype, seed=sum(seq_lens)
    )
    num_heads = num_kv_heads * group
    query = (q_scale * torch.randn(sum(query_lens), num_heads, head_dim)).to(dtype).to(DEVICE)
    starts = [0]
    for q in query_lens:
        starts.append(starts[-1] + q)
    out = torch.full_like(query, float("nan"))
    scale = head_dim**-0.5
    paged_prefill_attention(
        query, key_cache, value_cache, table,
        torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        torch.tensor(starts, dtype=torch.int32, device=DEVICE),
        scale, max(query_lens), out, block_m=block_m, block_n=block_m,
        sliding_window=window, logits_soft_cap=cap, causal=causal,
    )  # fmt: skip
    args = (query, key_cache, value_cache, tables, seq_lens, query_lens, scale)
    ref = reference(*args, window=window, cap=cap, causal=causal)
    assert rel_error(out, ref) < tolerance(dtype)
    return ref, reference(*args)


@pytest.mark.parametrize("case", PREFILL_CASES)
def test_prefill_attention(case) -> None:
    check_prefill(*case, block_m=16)


WINDOW_PREFILL_CASES = [
    # block_size, head_dim, num_kv_heads, group, chunks, dtype, window
    (16, 64, 2, 1, [(37, 0), (1, 20), (5, 0)], torch.float32, 5),  # window < block_size
    (16, 128, 1, 4, [(40, 35), (3, 0)], torch.float32, 20),  # chunk over a prefix
    (32, 64, 1, 8, [(40, 33), (1, 70)], SMALL_BF16, 33),  # spans key tiles and blocks
    (16, 64, 2, 4, [(20, 10)], torch.float32, 1),
    (16, 96, 1, 2, [(20, 10)], torch.float32, 12),
]


@pytest.mark.parametrize("case", WINDOW_PREFILL_CASES)
def test_prefill_attention_sliding_window(case) -> None:
    *shape, window = case
    windowed, full = check_prefill(*shape, block_m=16, window=window)
    assert rel_error(windowed, full) > 0.05


BIDIRECTIONAL_CASES = [
    # block_size, head_dim, num_kv_heads, group, whole prompts (query_len == seq_len), dtype
    (16, 64, 2, 1, [(37, 0), (1, 0), (5, 0)], torch.float32),  # BERT: kv heads = heads
    (16, 32, 4, 1, [(20, 0), (9, 0)], torch.float16),
    (32, 64, 1, 4, [(70, 0)], SMALL_BF16),  # several row tiles and key tiles
]


@pytest.mark.parametrize("case", BIDIRECTIONAL_CASES)
def test_prefill_attention_bidirectional(case) -> None:
    """An encoder's whole prompts: every row sees every key of its request."""
    both_ways, causal = check_prefill(*case, block_m=16, causal=False)
    assert rel_error(both_ways, causal) > 0.05  # the reference differs from causal's
    check_prefill(*case, block_m=16, causal=False, cap=3.0, q_scale=6)


def test_prefill_attention_bidirectional_has_no_window() -> None:
    with pytest.raises(ValueError, match="bidirectional attention has none"):
        check_prefill(16, 32, 1, 1, [(8, 0)], torch.float32, window=4, causal=False)


@pytest.mark.parametrize("group", [1, 4])
def test_prefill_attention_soft_cap_and_window(group: int) -> None:
    chunks = [(30, 0), (12, 25)]
    capped, plain = check_prefill(
        16, 64, 2, group, chunks, torch.float32, block_m=16, cap=3.0, q_scale=6
    )
    assert rel_error(capped, plain) > 0.05
    check_prefill(
        32, 128, 1, group, chunks, torch.float32, block_m=16, window=9, cap=3.0, q_scale=6
    )


@cuda_only
@pytest.mark.cuda
@pytest.mark.parametrize("case", FULL_PREFILL_CASES)
def test_prefill_attention_full(case) -> None:
    check_prefill(*case)
    check_prefill(*case, window=4096, cap=30.0, q_scale=8)
    check_prefill(*case, window=700)
    check_prefill(*case, window=100)


@pytest.mark.parametrize("block_size", [16, 32])
def test_write_kv_cache_by_slot(block_size: int) -> None:
    torch.manual_seed(block_size)
    num_blocks, num_kv_heads, head_dim = 6, 2, 64
    shape = (num_blocks, num_kv_heads, block_size, head_dim)
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
        expected_k[slot // block_size, :, slot % block_size] = key[t]
        expected_v[slot // block_size, :, slot % block_size] = value[t]
    assert torch.equal(key_cache, expected_k)
    assert torch.equal(value_cache, expected_v)


def test_write_kv_cache_refuses_the_slot_major_layout() -> None:
    cache = torch.zeros(4, 16, 2, 64, device=DEVICE)  # [blocks, block_size, heads, dim]
    kv = torch.zeros(1, 2, 64, device=DEVICE)
    with pytest.raises(ValueError, match="kv_cache_shape"):
        write_kv_cache(kv, kv, cache, cache, torch.zeros(1, dtype=torch.long, device=DEVICE))


def take_step_kv(key_cache, value_cache, tables, seq_lens, query_lens):
    """Each request's last ``query_len`` K/V moved out of the cache (their slots poisoned
    with NaN), as a step's new tokens: (key, value, slot_mapping; -1 for padding rows),
    and the intact caches."""
    block_size = key_cache.shape[2]
    slots = []
    for table, seq_len, q_len in zip(tables, seq_lens, query_lens):
        for pos in range(seq_len - q_len, seq_len):
            slots.append(
                table[pos // block_size] * block_size + pos % block_size if pos >= 0 else -1
            )
    real = torch.tensor([s for s in slots if s >= 0], dtype=torch.long)
    shape = (len(slots), key_cache.shape[1], key_cache.shape[3])
    key = torch.zeros(shape, dtype=key_cache.dtype, device=key_cache.device)
    value = torch.zeros_like(key)
    keep = torch.tensor([s >= 0 for s in slots])
    key[keep.to(key.device)] = key_cache[real // block_size, :, real % block_size]
    value[keep.to(key.device)] = value_cache[real // block_size, :, real % block_size]
    intact = key_cache.clone(), value_cache.clone()
    key_cache[real // block_size, :, real % block_size] = float("nan")
    value_cache[real // block_size, :, real % block_size] = float("nan")
    slot_mapping = torch.tensor(slots, dtype=torch.int32, device=DEVICE)
    return (key, value, slot_mapping), intact


def check_verify(
    block_size, head_dim, num_kv_heads, group, chunks, dtype,
    config=None, window=None, cap=None, q_scale=1.0, max_seq_len=None, write_new=False,
):  # fmt: skip
    """The verification kernel against the reference: ``chunks`` are (query_len, context)
    per request, the step's K/V already in the cache (``write_new``: passed as ``new_kv``,
    the cache holding NaN there, and they must land in the cache); (0, 0) chunks of ``q``
    tokens are given as (q, -q): padding rows (seq_len 0), whose outputs must be zeros."""
    from pagedlm_cuda.kernels import paged_verify_attention

    query_lens = [q for q, _ in chunks]
    seq_lens = [q + c for q, c in chunks]
    real = [i for i, s in enumerate(seq_lens) if s > 0]
    key_cache, value_cache, table, tables = make_cache(
        [max(s, 1) for s in seq_lens], block_size, num_kv_heads, head_dim, dtype,
        seed=sum(seq_lens) + len(chunks),
    )  # fmt: skip
    new_kv = None
    if write_new:
        new_kv, intact = take_step_kv(key_cache, value_cache, tables, seq_lens, query_lens)
    num_heads = num_kv_heads * group
    query = (q_scale * torch.randn(sum(query_lens), num_heads, head_dim)).to(dtype).to(DEVICE)
    starts = [0]
    for q in query_lens:
        starts.append(starts[-1] + q)
    out = torch.full_like(query, float("nan"))
    scale = head_dim**-0.5
    paged_verify_attention(
        query, key_cache, value_cache, table,
        torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        torch.tensor(starts, dtype=torch.int32, device=DEVICE),
        scale, max(query_lens), max_seq_len or max(seq_lens), out,
        new_kv=new_kv, sliding_window=window, logits_soft_cap=cap, config=config,
    )  # fmt: skip
    if write_new:
        assert torch.equal(key_cache, intact[0]) and torch.equal(value_cache, intact[1])
    rows = torch.cat([torch.arange(starts[i], starts[i + 1]) for i in real])
    pad_rows = [
        r for i in range(len(chunks)) if i not in real for r in range(starts[i], starts[i + 1])
    ]
    assert torch.equal(out[pad_rows].cpu(), torch.zeros_like(out[pad_rows].cpu()))
    pick = lambda xs: [xs[i] for i in real]  # noqa: E731
    args = (query[rows.to(DEVICE)], key_cache, value_cache, pick(tables), pick(seq_lens),
            pick(query_lens), scale)  # fmt: skip
    ref = reference(*args, window=window, cap=cap)
    assert rel_error(out[rows.to(DEVICE)], ref) < tolerance(dtype)
    return ref, reference(*args)


def _split(partition: int):
    from pagedlm_cuda.kernels.decode_config import DecodeConfig

    return DecodeConfig(partition, min(partition, 16), 4, 2, merge_in_kernel=False)


VERIFY_CASES = [
    # block_size, head_dim, num_kv_heads, group, chunks, dtype
    (16, 64, 2, 1, [(5, 40), (1, 17), (3, 0)], torch.float32),
    (16, 128, 1, 4, [(5, 300), (2, 31)], torch.float32),
    (32, 64, 1, 8, [(4, 60), (4, 1), (4, 527)], SMALL_BF16),  # 32 rows per program
    (16, 64, 2, 4, [(8, 90), (6, 7)], torch.float16),
]


@pytest.mark.parametrize("case", VERIFY_CASES)
def test_verify_attention(case) -> None:
    check_verify(*case, config=_split(32))


def test_verify_attention_single_partition_and_default_split() -> None:
    check_verify(16, 64, 2, 4, [(5, 20), (3, 4)], torch.float32)
    check_verify(16, 64, 2, 4, [(5, 20), (3, 4)], torch.float32, config=_split(64))


def test_verify_attention_partition_with_no_key_for_early_rows() -> None:
    """A last partition shorter than the query: its first rows see none of its keys."""
    check_verify(16, 64, 1, 4, [(5, 30)], torch.float32, config=_split(16))  # 35 keys
    check_verify(16, 64, 1, 4, [(8, 41)], torch.float32, config=_split(16))


def test_verify_attention_padding_rows_under_a_graph_bound() -> None:
    """Padding rows (seq_len 0) get zeros; the grid sized by a larger bound."""
    chunks = [(5, 70), (5, -5), (5, 3), (5, -5)]
    check_verify(16, 64, 2, 2, chunks, torch.float32, config=_split(32), max_seq_len=256)


def test_verify_attention_sliding_window_and_soft_cap() -> None:
    config = _split(16)
    chunks = [(5, 60), (3, 2), (4, 33)]
    windowed, full = check_verify(16, 64, 2, 4, chunks, torch.float32, config=config, window=9)
    assert rel_error(windowed, full) > 0.05
    check_verify(16, 64, 2, 4, chunks, torch.float32, config=config, window=1)
    check_verify(16, 64, 2, 4, chunks, torch.float32, config=config, window=16)
    capped, plain = check_verify(
        16, 64, 2, 4, chunks, torch.float32, config=config, cap=3.0, q_scale=6
    )
    assert rel_error(capped, plain) > 0.05
    check_verify(16, 64, 2, 4, chunks, torch.float32, config=config, window=7, cap=3.0)


def test_verify_attention_writes_the_new_kv() -> None:
    """The step's K/V come in as ``new_kv``: each lands at its slot (some straddle two
    partitions), padding rows (slot -1) write nothing, and the output is as if they had
    been in the cache."""
    config = _split(16)
    check_verify(16, 64, 2, 4, [(5, 30), (3, 0), (8, 60)], torch.float32, config=config,
                 write_new=True)  # fmt: skip
    check_verify(16, 64, 2, 2, [(5, 70), (5, -5), (5, 12)], torch.float32, config=config,
                 max_seq_len=256, write_new=True, window=6)  # fmt: skip
    check_verify(16, 64, 1, 4, [(4, 9)], torch.float32, write_new=True)  # one partition


@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize("qk_norm", [False, True])
def test_verify_attention_fused_rotary(neox: bool, qk_norm: bool) -> None:
    """With ``rotary`` the verification kernel rotates (after normalizing) each row's
    query at its own position and the new keys it writes: the output matches the rotary
    kernel followed by the plain verification kernel (partitions of two tiles, the first
    of them read before the new keys are written)."""
    from pagedlm.attention.backend import FusedRotary
    from pagedlm_cuda.kernels import paged_verify_attention, rotary_embedding

    dtype, head_dim, num_kv_heads, group = SMALL_BF16, 64, 2, 4
    query_lens, seq_lens = [5, 3], [45, 20]
    key_cache, value_cache, table, tables = make_cache(
        seq_lens, 16, num_kv_heads, head_dim, dtype, seed=11
    )
    new_kv, _ = take_step_kv(key_cache, value_cache, tables, seq_lens, query_lens)
    gen = torch.Generator().manual_seed(5)
    num_tokens = sum(query_lens)
    query = torch.randn(num_tokens, num_kv_heads * group, head_dim, generator=gen)
    query = query.to(dtype).to(DEVICE)
    positions = torch.tensor(
        [p for q, s in zip(query_lens, seq_lens) for p in range(s - q, s)], device=DEVICE
    )
    cos_sin, norms = rotary_inputs(head_dim, dtype, qk_norm, gen)
    seq_tensor = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    starts = torch.tensor([0, query_lens[0], num_tokens], dtype=torch.int32, device=DEVICE)
    key, value, slots = new_kv
    q_ref, k_ref = query.clone(), key.clone()
    rotary_embedding(
        positions, q_ref.view(num_tokens, -1), k_ref.view(num_tokens, -1), cos_sin, head_dim,
        neox, qk_norm=norms,
    )  # fmt: skip
    caches_ref = key_cache.clone(), value_cache.clone()
    args = (table, seq_tensor, starts, 0.125, max(query_lens), 64)
    config = _split(32)  # 16-key tiles
    expected = paged_verify_attention(
        q_ref, *caches_ref, *args, new_kv=(k_ref, value, slots), config=config
    )
    fused = paged_verify_attention(
        query, key_cache, value_cache, *args, new_kv=new_kv, config=config,
        rotary=FusedRotary(positions, cos_sin, neox, norms),
    )  # fmt: skip
    assert not torch.equal(query, q_ref)  # the query itself is left as it was
    assert torch.equal(value_cache, caches_ref[1])
    assert rel_error(key_cache.float().nan_to_num(), caches_ref[0].float().nan_to_num()) < 1e-2
    assert rel_error(fused, expected) < tolerance(dtype)


def test_verify_attention_refuses_long_queries() -> None:
    with pytest.raises(ValueError, match="paged_prefill_attention"):
        check_verify(16, 64, 1, 1, [(9, 3)], torch.float32)


FULL_VERIFY_CASES = [
    (16, 128, 8, 4, [(5, 1100)], torch.bfloat16),  # batch 1 of issue 13's shape
    (16, 128, 8, 4, [(5, 1100 + 37 * i) for i in range(8)], torch.bfloat16),
    (16, 128, 8, 4, [(4, 300 + 29 * i) for i in range(64)], torch.bfloat16),
    (32, 64, 8, 8, [(8, 7000), (2, 513), (5, 1)], torch.bfloat16),
    (16, 256, 4, 2, [(5, 4000), (5, 3)], torch.bfloat16),  # Gemma head_dim
]


@cuda_only
@pytest.mark.cuda
@pytest.mark.parametrize("case", FULL_VERIFY_CASES)
def test_verify_attention_full(case) -> None:
    check_verify(*case)
    check_verify(*case, window=4096, cap=30.0, q_scale=8)
    check_verify(*case, window=700)
    check_verify(*case, max_seq_len=8192)
    check_verify(*case, max_seq_len=8192, write_new=True)
