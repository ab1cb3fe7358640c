"""The decode kernel's batch-sized split: it depends on the batch only through the CUDA
graph ladder's bucket, so a graph replay (padded rows, grid sized by max_model_len) and an
eager step (unpadded, grid sized by the batch's longest context) agree bit for bit."""

from __future__ import annotations

import bisect

import pytest
import torch
from test_attention_kernels import make_cache
from triton_env import DEVICE

from pagedlm_cuda.batch_sizes import capture_sizes
from pagedlm_cuda.kernels import paged_decode_attention
from pagedlm_cuda.kernels.decode_config import FP8_MAX_REGISTERS, batch_bucket, decode_config


def test_padding_to_any_captured_size_keeps_the_configuration() -> None:
    """For every ``max_num_seqs`` and every batch it serves, the size the graph runner pads
    to (the smallest capture size >= n) gets the configuration that n gets eagerly."""
    for max_num_seqs in range(1, 600):
        sizes = capture_sizes(max_num_seqs)
        for n in range(1, max_num_seqs + 1):
            padded = sizes[bisect.bisect_left(sizes, n)]
            for kv_heads in (1, 8):
                assert decode_config(n, kv_heads, 128) == decode_config(padded, kv_heads, 128)


def test_partition_shrinks_for_small_batches() -> None:
    assert batch_bucket(1) == 1 and batch_bucket(3) == 4 and batch_bucket(9) == 16
    # llama-3-8b (8 kv heads): batch 1 gets 64-key partitions, 1,100 tokens -> 144 programs.
    assert decode_config(1, 8, 128).partition == 64
    assert decode_config(4, 8, 128).partition == 64
    assert decode_config(32, 8, 128).partition == 512
    assert decode_config(256, 8, 128).partition == 512
    # An FP8 cache: from 1,024 programs on, 1,024-key partitions (W1: batch 256, 8 kv heads).
    assert decode_config(64, 8, 128, fp8=True).partition == 512
    assert decode_config(128, 8, 128, fp8=True).partition == 1024
    assert decode_config(256, 8, 128, fp8=True).partition == 1024
    for n in (1, 2, 5, 16, 100, 256, 512):
        config = decode_config(n, 8, 256)
        assert config.partition % config.block_n == 0 and config.block_n <= 32
    sizes = [decode_config(n, 4, 128).partition for n in range(1, 300)]
    assert sizes == sorted(sizes)


def test_fp8_cache_takes_the_bf16_tiles() -> None:
    """Since session 19's H100 sweep an FP8 cache's tiles are the bf16 ones (64 keys), and
    so is its split below 1,024 programs; where programs loop over partitions (session
    28), its registers are capped."""
    for n in (1, 4, 16, 64):
        for head_dim in (128, 256):
            fp8, bf16 = decode_config(n, 8, head_dim, fp8=True), decode_config(n, 8, head_dim)
            assert fp8._replace(max_registers=0) == bf16 and bf16.max_registers == 0
            assert fp8.max_registers == (FP8_MAX_REGISTERS if fp8.slots else 0)
    assert decode_config(256, 8, 128, fp8=True).block_n == decode_config(256, 8, 128).block_n
    for n in range(1, 600):
        config = decode_config(n, 8, 128, fp8=True)
        assert config.partition % config.block_n == 0


@pytest.mark.parametrize(
    ("seq_lens", "window"),
    [([150, 7, 90], None), ([150, 7, 90], 40), ([20, 7, 32], None), ([20, 7, 32], 9)],
)
def test_graph_padded_call_equals_eager_call_bitwise(seq_lens, window) -> None:
    """Three sequences eagerly vs the same three plus a padding row (bucket 4) with the
    grid sized for a 4,096-token max_model_len, as a graph replay runs them. With every
    context within one 64-key partition the eager call writes its output directly."""
    key_cache, value_cache, table, _ = make_cache(seq_lens, 16, 2, 64, torch.float16, seed=5)
    query = torch.randn(3, 8, 64).to(torch.float16).to(DEVICE)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    eager = paged_decode_attention(
        query, key_cache, value_cache, table, lens, 0.125, max(seq_lens), sliding_window=window
    )
    padded_query = torch.cat([query, torch.randn_like(query[:1])])
    padded_table = torch.cat([table, torch.zeros_like(table[:1])])
    padded_lens = torch.cat([lens, torch.zeros_like(lens[:1])])
    graph = paged_decode_attention(
        padded_query, key_cache, value_cache, padded_table, padded_lens, 0.125, 4096,
        sliding_window=window,
    )  # fmt: skip
    assert torch.equal(graph[:3], eager)
    assert torch.equal(graph[3], torch.zeros_like(graph[3]))
