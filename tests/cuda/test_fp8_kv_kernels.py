"""The Triton kernels on an FP8 (E4M3) cache against a float64 reference, and the Triton
backend's batch-invariant mode.

Interpreted on CPU (``TRITON_INTERPRET=1``) at small sizes, on the GPU under ``-m cuda``
(the same cases; the interpreter multiplies bf16 dots as raw bits, so interpreted cases
compute in float16/float32). The reference dequantizes the stored bytes (``stored *
scale`` in float64): what is checked is the kernels' reading and writing of the format,
not the format's own rounding (``tests/kv_cache/test_fp8_kv.py`` bounds that end to end).
"""

from __future__ import annotations

import pytest
import torch
from test_attention_kernels import make_cache, reference
from test_triton_backend import make_layout, on_device, run_backend, to_triton_layout
from triton_env import DEVICE, ON_GPU, rel_error, tolerance

from pagedlm.attention.backend import BatchLayout
from pagedlm.kv_cache import fp8
from pagedlm_cpu.attention import CpuSdpaBackend
from pagedlm_cuda.attention import TritonAttentionBackend
from pagedlm_cuda.kernels import paged_decode_attention, paged_prefill_attention, write_kv_cache

COMPUTE = torch.bfloat16 if ON_GPU else torch.float16
K_SCALE, V_SCALE = 0.02, 0.03


def _scales() -> dict[str, torch.Tensor]:
    return dict(
        k_scale=torch.tensor([K_SCALE], device=DEVICE),
        v_scale=torch.tensor([V_SCALE], device=DEVICE),
    )


def fp8_cache(seq_lens, block_size, num_kv_heads, head_dim, seed):
    """Random FP8 caches (values spread over the format's range) and their tables."""
    key_cache, value_cache, table, tables = make_cache(
        seq_lens, block_size, num_kv_heads, head_dim, torch.float32, seed
    )
    scales = _scales()
    key_cache = fp8.quantize(key_cache * K_SCALE * 60, scales["k_scale"])
    value_cache = fp8.quantize(value_cache * V_SCALE * 60, scales["v_scale"])
    return key_cache, value_cache, table, tables


def dequantized(key_cache, value_cache):
    return key_cache.double() * K_SCALE, value_cache.double() * V_SCALE


def test_write_quantizes_with_saturation():
    num_tokens, kv_heads, head_dim, block_size = 5, 2, 32, 4
    shape = (4, kv_heads, block_size, head_dim)
    key_cache = torch.zeros(shape, dtype=fp8.FP8_DTYPE, device=DEVICE)
    value_cache = torch.zeros_like(key_cache)
    key = torch.randn(num_tokens, kv_heads, head_dim, device=DEVICE)
    key[0, 0, :4] = torch.tensor([1e4, -1e4, 9.0, 0.0])  # past 448 * K_SCALE both ways
    value = torch.randn(num_tokens, kv_heads, head_dim, device=DEVICE)
    slots = torch.tensor([3, 0, 9, -1, 14], dtype=torch.int32, device=DEVICE)
    write_kv_cache(key.to(COMPUTE), value.to(COMPUTE), key_cache, value_cache, slots, **_scales())
    scales = _scales()
    for token, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        block, offset = divmod(slot, block_size)
        expected_k = fp8.quantize(key[token].to(COMPUTE), scales["k_scale"])
        expected_v = fp8.quantize(value[token].to(COMPUTE), scales["v_scale"])
        assert torch.equal(
            key_cache[block, :, offset].view(torch.uint8), expected_k.view(torch.uint8)
        )
        assert torch.equal(
            value_cache[block, :, offset].view(torch.uint8), expected_v.view(torch.uint8)
        )
    assert not torch.isnan(key_cache.float()).any()
    assert key_cache[0, 0, 3, :2].float().tolist() == [448.0, -448.0]
    with pytest.raises(ValueError, match="k_scale"):
        write_kv_cache(key, value, key_cache, value_cache, slots)


@pytest.mark.parametrize("window", [None, 9])
def test_prefill_on_fp8_cache(window):
    seq_lens, query_lens = [20, 7, 33], [6, 7, 1]
    key_cache, value_cache, table, tables = fp8_cache(seq_lens, 16, 2, 32, seed=3)
    query = torch.randn(sum(query_lens), 4, 32, device=DEVICE).to(COMPUTE)
    qsl = torch.tensor([0, 6, 13, 14], dtype=torch.int32, device=DEVICE)
    seq = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    out = paged_prefill_attention(
        query, key_cache, value_cache, table, seq, qsl, 0.2, max(query_lens),
        block_m=16, block_n=16, sliding_window=window, **_scales(),
    )  # fmt: skip
    kc, vc = dequantized(key_cache, value_cache)
    ref = reference(query, kc, vc, tables, seq_lens, query_lens, 0.2, window=window)
    assert rel_error(out, ref) < tolerance(COMPUTE)


# (128, 128): the 128-key tiles decode_config gives an FP8 cache in long partitions.
@pytest.mark.parametrize(("partition", "block_n"), [(16, 16), (128, 16), (128, 128)])
def test_decode_on_fp8_cache_writes_and_reads_the_new_kv(partition, block_n):
    seq_lens = [1, 17, 40]
    key_cache, value_cache, table, tables = fp8_cache(seq_lens, 16, 2, 32, seed=4)
    num_seqs = len(seq_lens)
    query = torch.randn(num_seqs, 8, 32, device=DEVICE).to(COMPUTE)
    new_k = (torch.randn(num_seqs, 2, 32, device=DEVICE) * 3).to(COMPUTE)
    new_v = torch.randn(num_seqs, 2, 32, device=DEVICE).to(COMPUTE)
    slots = torch.tensor(
        [t[(n - 1) // 16] * 16 + (n - 1) % 16 for t, n in zip(tables, seq_lens)],
        dtype=torch.int32, device=DEVICE,
    )  # fmt: skip
    seq = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    out = paged_decode_attention(
        query, key_cache, value_cache, table, seq, 0.15, 64, partition_size=partition,
        block_n=block_n, new_kv=(new_k, new_v, slots), **_scales(),
    )  # fmt: skip
    scales = _scales()
    for i, slot in enumerate(slots.tolist()):  # written quantized
        block, offset = divmod(slot, 16)
        stored = key_cache[block, :, offset].view(torch.uint8)
        assert torch.equal(stored, fp8.quantize(new_k[i], scales["k_scale"]).view(torch.uint8))
    # The new token was attended to as stored: the reference reads the written cache.
    kc, vc = dequantized(key_cache, value_cache)
    ref = reference(query, kc, vc, tables, seq_lens, [1] * num_seqs, 0.15)
    assert rel_error(out, ref) < tolerance(COMPUTE)


@pytest.mark.parametrize(
    "chunks",
    [[(1, 30), (20, 0), (7, 33), (1, 0)], [(1, 100), (1, 5), (1, 40)], [(5, 90), (3, 0), (1, 7)]],
)
def test_triton_backend_matches_cpu_backend_on_fp8_caches(chunks):
    """Mixed, decode-only and verification batches: the same stored bytes (after the layout change) and
    the same outputs as the CPU backend's emulation, both quantizing with the same scales."""
    block_size, num_blocks, kv_heads, heads, head_dim = 16, 40, 2, 8, 64
    torch.manual_seed(len(chunks))
    layout = make_layout(chunks, block_size, num_blocks)
    scales = {name: t.cpu() for name, t in _scales().items()}
    shape = CpuSdpaBackend.kv_cache_shape(num_blocks, block_size, kv_heads, head_dim)
    key_cache = fp8.quantize(torch.randn(shape) * 2, scales["k_scale"])
    value_cache = fp8.quantize(torch.randn(shape) * 2, scales["v_scale"])
    q = torch.randn(layout.num_tokens, heads, head_dim)
    k = torch.randn(layout.num_tokens, kv_heads, head_dim) * 2
    v = torch.randn(layout.num_tokens, kv_heads, head_dim) * 2
    cpu = CpuSdpaBackend(torch.device("cpu"))
    ref, ref_kc, ref_vc = run_backend(cpu, layout, q, k, v, key_cache, value_cache, **scales)
    tensors = [t.to(DEVICE) for t in (q, k, v)]
    caches = [
        to_triton_layout(c.view(torch.uint8)).view(c.dtype).to(DEVICE)
        for c in (key_cache, value_cache)
    ]
    out, kc, vc = run_backend(
        TritonAttentionBackend(DEVICE), layout, *tensors, *caches, **_scales()
    )
    assert rel_error(out, ref) < 2e-3
    for got, expected in ((kc, ref_kc), (vc, ref_vc)):
        assert torch.equal(
            got.cpu().view(torch.uint8), to_triton_layout(expected.view(torch.uint8))
        )


def _invariant_backend() -> TritonAttentionBackend:
    backend = TritonAttentionBackend(DEVICE)
    backend.set_batch_invariant(True)
    return backend


@pytest.mark.parametrize("cache_dtype", [COMPUTE, fp8.FP8_DTYPE])
def test_batch_invariant_backend_prefill_equals_decodes(cache_dtype):
    """A request's tokens computed as one prefill chunk (beside another request) and
    then one by one as decodes give the same bits, FP8 cache or not."""
    block_size, num_blocks, kv_heads, heads, head_dim = 16, 24, 2, 4, 32
    torch.manual_seed(0)
    shape = TritonAttentionBackend.kv_cache_shape(num_blocks, block_size, kv_heads, head_dim)
    dtype, compute = cache_dtype, COMPUTE
    chunk_len, context_len = 7, 20
    layout = on_device(
        make_layout([(chunk_len, context_len), (3, 0)], block_size, num_blocks), DEVICE
    )
    q = torch.randn(layout.num_tokens, heads, head_dim, device=DEVICE).to(compute)
    k = torch.randn(layout.num_tokens, kv_heads, head_dim, device=DEVICE).to(compute)
    v = torch.randn(layout.num_tokens, kv_heads, head_dim, device=DEVICE).to(compute)
    scales = _scales() if dtype == fp8.FP8_DTYPE else {}
    base = torch.randn(shape, device=DEVICE)
    if dtype == fp8.FP8_DTYPE:
        key_cache, value_cache = (
            fp8.quantize(base * 0.5, scales["k_scale"]),
            fp8.quantize(base, scales["v_scale"]),
        )
    else:
        key_cache, value_cache = base.to(dtype), (-base).to(dtype)
    backend = _invariant_backend()
    kc, vc = key_cache.clone(), value_cache.clone()
    metadata = backend.build_metadata(layout)
    prefill = backend.forward(q, k, v, kc, vc, metadata, 0.125, **scales)

    kc, vc = key_cache.clone(), value_cache.clone()
    table = layout.block_table[:1].tolist()[0]
    rows = []
    for offset in range(chunk_len):  # the same tokens, a decode step each
        position = context_len + offset
        slot = table[position // block_size] * block_size + position % block_size
        step = BatchLayout.from_lists([0, 1], [position + 1], [table], [slot], block_size, DEVICE)
        rows.append(
            backend.forward(
                q[offset : offset + 1],
                k[offset : offset + 1],
                v[offset : offset + 1],
                kc,
                vc,
                backend.build_metadata(step),
                0.125,
                **scales,
            )
        )
    assert torch.equal(torch.cat(rows), prefill[:chunk_len])


def test_batch_invariant_graph_capture_is_decode_only():
    backend = _invariant_backend()
    assert backend.supports_graph(1) and not backend.supports_graph(4)
    assert TritonAttentionBackend(DEVICE).supports_graph(4)
