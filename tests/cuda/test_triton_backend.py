"""The Triton attention backend against the CPU reference backend on mixed batches (each
in its own cache layout), with sliding windows and soft-caps through the attention layer,
and the graph runner's batch-size ladder."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from triton_env import DEVICE, rel_error

from pagedlm.attention.backend import BatchLayout
from pagedlm.kv_cache.interface import TensorKVCache
from pagedlm.model_executor.forward_context import ForwardContext
from pagedlm.model_executor.layers.attention import Attention
from pagedlm_cpu.attention import CpuSdpaBackend
from pagedlm_cuda.attention import TritonAttentionBackend
from pagedlm_cuda.batch_sizes import capture_sizes

BLOCK_SIZE, NUM_BLOCKS, KV_HEADS, HEADS, HEAD_DIM = 16, 40, 2, 8, 64


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
    return BatchLayout.from_lists(qsl, seq_lens, tables, slots, block_size)


def to_triton_layout(cache: torch.Tensor) -> torch.Tensor:
    """[blocks, block_size, kv_heads, d] (CPU backend) -> [blocks, kv_heads, block_size, d]."""
    return cache.transpose(1, 2).contiguous()


def on_device(layout: BatchLayout, device: torch.device) -> BatchLayout:
    """``layout`` with its tensors on ``device`` (the backend's: the GPU's when there is one)."""
    names = ("query_start_loc", "seq_lens", "block_table", "slot_mapping")
    return dataclasses.replace(layout, **{n: getattr(layout, n).to(device) for n in names})


def run_backend(backend, layout, q, k, v, key_cache, value_cache, **features):
    layout = on_device(layout, backend.device)
    kc, vc = key_cache.clone(), value_cache.clone()
    out = backend.forward(q, k, v, kc, vc, backend.build_metadata(layout), 0.125, **features)
    return out, kc, vc


def check_against_cpu(chunks: list[tuple[int, int]], **features) -> None:
    torch.manual_seed(len(chunks))
    layout = make_layout(chunks, BLOCK_SIZE, NUM_BLOCKS)
    shape = CpuSdpaBackend.kv_cache_shape(NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    key_cache, value_cache = torch.randn(shape), torch.randn(shape)
    q = 3 * torch.randn(layout.num_tokens, HEADS, HEAD_DIM)  # scores past a cap of 2
    k = torch.randn(layout.num_tokens, KV_HEADS, HEAD_DIM)
    v = torch.randn(layout.num_tokens, KV_HEADS, HEAD_DIM)
    ref, ref_kc, ref_vc = run_backend(
        CpuSdpaBackend(torch.device("cpu")), layout, q, k, v, key_cache, value_cache, **features
    )
    tensors = [t.to(DEVICE) for t in (q, k, v)]
    caches = [to_triton_layout(c).to(DEVICE) for c in (key_cache, value_cache)]
    out, kc, vc = run_backend(TritonAttentionBackend(DEVICE), layout, *tensors, *caches, **features)
    assert rel_error(out, ref) < 2e-3
    assert torch.equal(kc.cpu(), to_triton_layout(ref_kc))
    assert torch.equal(vc.cpu(), to_triton_layout(ref_vc))
    if features:  # the features change this batch's result, so the check above means something
        plain = run_backend(
            CpuSdpaBackend(torch.device("cpu")), layout, q, k, v, key_cache, value_cache
        )[0]
        assert rel_error(plain, ref) > 0.05


def test_kv_cache_shape_puts_heads_outside_slots() -> None:
    assert TritonAttentionBackend.kv_cache_shape(10, 16, 8, 128) == (10, 8, 16, 128)
    assert TritonAttentionBackend.supports_sliding_window
    assert TritonAttentionBackend.supports_logits_soft_cap


def test_mixed_batch_matches_cpu_backend() -> None:
    check_against_cpu([(1, 30), (20, 0), (7, 33), (1, 0)])


def test_decode_only_batch_matches_cpu_backend() -> None:
    check_against_cpu([(1, 300), (1, 5), (1, 64)])


def test_verification_batch_matches_cpu_backend() -> None:
    """At most 8 tokens per request: the verification kernel, which writes the K/V too."""
    check_against_cpu([(5, 300), (5, 0), (8, 61), (1, 7), (3, 12)])
    check_against_cpu([(5, 300), (5, 0), (8, 61), (1, 7)], sliding_window=9)


@pytest.mark.parametrize(
    "features",
    [
        {"sliding_window": 12},
        {"logits_soft_cap": 2.0},
        {"sliding_window": 5, "logits_soft_cap": 2.0},
    ],
)
def test_window_and_soft_cap_match_cpu_backend(features) -> None:
    check_against_cpu([(1, 30), (20, 0), (7, 33), (1, 0)], **features)
    check_against_cpu([(1, 100), (1, 5), (1, 40)], **features)


def test_attention_layer_runs_windowed_soft_capped_layers_on_triton() -> None:
    """The attention layer refuses a backend without the features; Triton now has them,
    and the layer's output through it matches the CPU backend's."""
    torch.manual_seed(0)
    layout = make_layout([(9, 20), (1, 50)], BLOCK_SIZE, NUM_BLOCKS)
    layer = Attention(0, HEADS, KV_HEADS, HEAD_DIM, 0.125, sliding_window=7, logits_soft_cap=2.0)
    q = 3 * torch.randn(layout.num_tokens, HEADS * HEAD_DIM)
    k = torch.randn(layout.num_tokens, KV_HEADS * HEAD_DIM)
    v = torch.randn(layout.num_tokens, KV_HEADS * HEAD_DIM)
    cpu_cache = torch.randn(
        CpuSdpaBackend.kv_cache_shape(NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    )
    outs = []
    for backend, cache in (
        (CpuSdpaBackend(torch.device("cpu")), cpu_cache),
        (TritonAttentionBackend(DEVICE), to_triton_layout(cpu_cache).to(DEVICE)),
    ):
        kv = TensorKVCache(
            tuple(cache.shape), 1, BLOCK_SIZE, cache.dtype, lambda s, d, c=cache: c.clone()
        )
        ctx = ForwardContext(backend, backend.build_metadata(on_device(layout, backend.device)), kv)
        device = cache.device
        outs.append(layer(q.to(device), k.to(device), v.to(device), ctx).cpu())
    assert rel_error(outs[1], outs[0]) < 2e-3


def test_capture_sizes_ladder() -> None:
    assert capture_sizes(1) == [1]
    assert capture_sizes(12) == [1, 2, 4, 8, 12]
    sizes = capture_sizes(512)
    assert sizes[:5] == [1, 2, 4, 8, 16] and sizes[-1] == 512
    assert sizes == sorted(set(sizes))
    assert 264 not in sizes and 272 in sizes  # steps of 16 above 256


@pytest.mark.parametrize(
    "chunks",
    [
        [(1, 40), (1, 3), (1, 90)],
        [(6, 20), (1, 50), (5, 0)],
        [(12, 20), (1, 50)],
        [(1, 9 + 3 * i) for i in range(9)],
    ],
    ids=["decode", "verification", "prefill", "large-decode"],
)
@pytest.mark.parametrize("qk_norm", [False, True])
def test_attention_layer_hands_short_steps_their_rotation(chunks, qk_norm: bool) -> None:
    """Steps of at most 8 requests of at most 8 tokens: the layer hands the rotation to
    the Triton backend, whose decode and verification kernels rotate (and first normalize)
    the query and new keys themselves (the rotary kernel is not called); other steps rotate
    first. All match the CPU backend with the torch norms and rotation."""
    from pagedlm.model_executor.layers.layernorm import RMSNorm
    from pagedlm.model_executor.layers.rotary_embedding import PendingRotation, RotaryEmbedding
    from pagedlm_cuda.fused_layers import _rms_norm_kernel, _rotary_kernel

    torch.manual_seed(1)
    layout = make_layout(chunks, BLOCK_SIZE, NUM_BLOCKS)
    layer = Attention(0, HEADS, KV_HEADS, HEAD_DIM, 0.125)
    q = torch.randn(layout.num_tokens, HEADS * HEAD_DIM)
    k = torch.randn(layout.num_tokens, KV_HEADS * HEAD_DIM)
    v = torch.randn(layout.num_tokens, KV_HEADS * HEAD_DIM)
    positions = torch.tensor([c - 1 + i for (n, c) in chunks for i in range(1, n + 1)])
    cpu_cache = torch.randn(
        CpuSdpaBackend.kv_cache_shape(NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    )
    kernel_calls = []

    def counted_kernel(*args, **kwargs):
        kernel_calls.append(1)
        return _rotary_kernel(*args, **kwargs)

    outs, caches = [], []
    for backend, cache, kernel in (
        (CpuSdpaBackend(torch.device("cpu")), cpu_cache, None),
        (TritonAttentionBackend(DEVICE), to_triton_layout(cpu_cache).to(DEVICE), counted_kernel),
    ):
        device = cache.device
        rotary = RotaryEmbedding(HEAD_DIM, 256, 10000.0).to(device)
        rotary.set_kernel(kernel)
        kv = TensorKVCache(
            tuple(cache.shape), 1, BLOCK_SIZE, cache.dtype, lambda s, d, c=cache: c.clone()
        )
        metadata = backend.build_metadata(on_device(layout, device))
        ctx = ForwardContext(backend, metadata, kv)
        norms = None
        if qk_norm:
            norms = (RMSNorm(HEAD_DIM, 1e-6).to(device), RMSNorm(HEAD_DIM, 1e-6).to(device))
            for norm, seed in zip(norms, (5, 6)):
                weight = torch.randn(HEAD_DIM, generator=torch.Generator().manual_seed(seed))
                norm.weight.data.copy_(1 + 0.3 * weight)
                if kernel is not None:
                    norm.set_kernel(_rms_norm_kernel)
        rotation = PendingRotation(rotary, positions.to(device), norms)
        tensors = [t.clone().to(device) for t in (q, k, v)]
        outs.append(layer(*tensors, ctx, rotation).cpu())
        caches.append(kv.layer(0)[0].cpu())
    fused = all(n <= 8 for n, _ in chunks) and len(chunks) <= 8
    assert kernel_calls == ([] if fused else [1])
    assert rel_error(outs[1], outs[0]) < 2e-3
    assert rel_error(caches[1], to_triton_layout(caches[0])) < 1e-5
