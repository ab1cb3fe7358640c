"""The Triton attention backend against the CPU reference backend on mixed batches, and
the graph runner's host-side pieces (batch-size ladder, packed layout)."""

from __future__ import annotations

import random

import torch
from triton_env import DEVICE, rel_error

from pagedlm.attention.backend import BatchLayout
from pagedlm_cpu.attention import CpuSdpaBackend
from pagedlm_cuda.attention import TritonAttentionBackend, pack_layout, unpack
from pagedlm_cuda.graph_runner import capture_sizes


def make_layout(chunks: list[tuple[int, int]], block_size: int, num_blocks: int) -> BatchLayout:
    """chunks: (query_len, context_len) per request; blocks assigned at random."""
    ids = list(range(num_blocks))
    random.Random(len(chunks)).shuffle(ids)
    qsl, seq_lens, tables, slots = [0], [], [], []
    for q_len, ctx in chunks:
        seq = q_len + ctx
        n = -(-seq // block_size)
        table, ids = ids[:n], ids[n:]
        qsl.append(qsl[-1] + q_len)
        seq_lens.append(seq)
        tables.append(table + [0])  # longer than needed, like a request's reserved blocks
        slots.extend(table[p // block_size] * block_size + p % block_size for p in range(ctx, seq))
    return BatchLayout(qsl, seq_lens, tables, slots, block_size)


def run_backend(backend, layout, q, k, v, key_cache, value_cache):
    kc, vc = key_cache.clone(), value_cache.clone()
    out = backend.forward(q, k, v, kc, vc, backend.build_metadata(layout), 0.125)
    return out, kc, vc


def check_against_cpu(chunks: list[tuple[int, int]]) -> None:
    torch.manual_seed(len(chunks))
    block_size, num_blocks, kv_heads, heads, head_dim = 16, 40, 2, 8, 64
    layout = make_layout(chunks, block_size, num_blocks)
    shape = (num_blocks, block_size, kv_heads, head_dim)
    key_cache, value_cache = torch.randn(shape), torch.randn(shape)
    q = torch.randn(layout.num_tokens, heads, head_dim)
    k = torch.randn(layout.num_tokens, kv_heads, head_dim)
    v = torch.randn(layout.num_tokens, kv_heads, head_dim)
    ref, ref_kc, ref_vc = run_backend(
        CpuSdpaBackend(torch.device("cpu")), layout, q, k, v, key_cache, value_cache
    )
    tensors = [t.to(DEVICE) for t in (q, k, v, key_cache, value_cache)]
    out, kc, vc = run_backend(TritonAttentionBackend(DEVICE), layout, *tensors)
    assert rel_error(out, ref) < 2e-3
    assert torch.equal(kc.cpu(), ref_kc) and torch.equal(vc.cpu(), ref_vc)


def test_mixed_batch_matches_cpu_backend() -> None:
    check_against_cpu([(1, 30), (20, 0), (7, 33), (1, 0)])


def test_decode_only_batch_matches_cpu_backend() -> None:
    check_against_cpu([(1, 300), (1, 5), (1, 64)])


def test_capture_sizes_ladder() -> None:
    assert capture_sizes(1) == [1]
    assert capture_sizes(12) == [1, 2, 4, 8, 12]
    sizes = capture_sizes(512)
    assert sizes[:5] == [1, 2, 4, 8, 16] and sizes[-1] == 512
    assert sizes == sorted(set(sizes))
    assert 264 not in sizes and 272 in sizes  # steps of 16 above 256


def test_pack_layout_pads_rows_as_empty_decodes() -> None:
    layout = BatchLayout([0, 1, 2], [5, 17], [[3], [4, 9]], [3 * 16 + 4, 9 * 16], 16)
    packed = torch.from_numpy(pack_layout(layout, 4, 3))
    slots, qsl, lens, tables = unpack(packed, 4, 4, 3)
    assert slots.tolist() == [52, 144, -1, -1]
    assert qsl.tolist() == [0, 1, 2, 3, 4]
    assert lens.tolist() == [5, 17, 0, 0]
    assert tables.tolist() == [[3, 0, 0], [4, 9, 0], [0, 0, 0], [0, 0, 0]]
