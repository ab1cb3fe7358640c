"""Attention sinks (gpt-oss) in the Triton decode, verification and prefill kernels against
a float64 reference: each query head's sink logit joins its softmax's denominator and
contributes no value. Direct (one partition) and split paths (merged in the kernel or by a
merge kernel), sliding windows, the new K/V passed along; and without sinks (or with sinks
of -inf, which add nothing) the kernels give the same bits as before.

On CPU under ``TRITON_INTERPRET=1`` (small shapes), on a GPU as written.
"""

from __future__ import annotations

import pytest
import torch
from test_attention_kernels import SMALL_BF16, make_cache, take_new_kv, take_step_kv
from triton_env import DEVICE, rel_error, tolerance

from pagedlm_cuda.kernels import (
    paged_decode_attention,
    paged_prefill_attention,
    paged_verify_attention,
)
from pagedlm_cuda.kernels.decode_config import DecodeConfig


def sink_reference(
    query, key_cache, value_cache, tables, seq_lens, query_lens, scale, sinks, window=None
):  # fmt: skip
    """float64 causal attention with ``sinks`` [heads] (None: none) in every softmax,
    one request at a time. query: [T, H, D]."""
    q64 = query.double().cpu()
    kc = key_cache.double().cpu().transpose(1, 2)  # [blocks, block_size, kv_heads, D]
    vc = value_cache.double().cpu().transpose(1, 2)
    num_kv_heads, head_dim = kc.shape[2], kc.shape[3]
    group = q64.shape[1] // num_kv_heads
    outs, row = [], 0
    for table, seq_len, q_len in zip(tables, seq_lens, query_lens, strict=True):
        k = kc[table].reshape(-1, num_kv_heads, head_dim)[:seq_len]
        v = vc[table].reshape(-1, num_kv_heads, head_dim)[:seq_len]
        k = k.repeat_interleave(group, dim=1).transpose(0, 1)  # [H, S, D]
        v = v.repeat_interleave(group, dim=1).transpose(0, 1)
        q = q64[row : row + q_len].transpose(0, 1)  # [H, Q, D]
        scores = q @ k.transpose(1, 2) * scale
        q_pos = torch.arange(seq_len - q_len, seq_len)[:, None]
        k_pos = torch.arange(seq_len)[None, :]
        hidden = k_pos > q_pos
        if window is not None:
            hidden |= k_pos <= q_pos - window
        scores = scores.masked_fill(hidden, float("-inf"))
        if sinks is not None:
            column = sinks.double().cpu()[:, None, None].expand(-1, q_len, 1)
            probs = torch.cat([scores, column], dim=-1).softmax(-1)[..., :-1]
        else:
            probs = scores.softmax(-1)
        outs.append((probs @ v).transpose(0, 1))
        row += q_len
    return torch.cat(outs)


def random_sinks(num_heads: int, seed: int) -> torch.Tensor:
    """Sinks around the scores' log-sum-exp (so they take a visible share), float32."""
    gen = torch.Generator().manual_seed(seed)
    return (2.0 + 2.0 * torch.randn(num_heads, generator=gen)).to(DEVICE)


def _split(partition: int, merge_in_kernel: bool = False) -> DecodeConfig:
    return DecodeConfig(partition, min(partition, 16), 4, 2, merge_in_kernel=merge_in_kernel)


def run_decode(
    block_size, head_dim, num_kv_heads, group, seq_lens, dtype, sinks,
    config=None, window=None, write_new=False, max_seq_len=None,
):  # fmt: skip
    """(decode output, its inputs for the reference)."""
    key_cache, value_cache, table, tables = make_cache(
        seq_lens, block_size, num_kv_heads, head_dim, dtype, seed=sum(seq_lens)
    )
    new_kv = take_new_kv(key_cache, value_cache, tables, seq_lens)[0] if write_new else None
    gen = torch.Generator().manual_seed(len(seq_lens))
    query = torch.randn(len(seq_lens), num_kv_heads * group, head_dim, generator=gen)
    query = query.to(dtype).to(DEVICE)
    scale = head_dim**-0.5
    out = paged_decode_attention(
        query, key_cache, value_cache, table,
        torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE), scale,
        max_seq_len or max(seq_lens), torch.full_like(query, float("nan")),
        new_kv=new_kv, sliding_window=window, config=config, sinks=sinks,
    )  # fmt: skip
    return out, (query, key_cache, value_cache, tables, seq_lens, [1] * len(seq_lens), scale)


DECODE_CASES = [
    # block_size, head_dim, num_kv_heads, group, seq_lens, dtype, config
    (16, 64, 2, 4, [1, 17, 40], torch.float32, None),  # one partition: direct
    (16, 64, 1, 4, [70, 3, 130], torch.float32, _split(32, merge_in_kernel=True)),
    (16, 64, 2, 2, [70, 3, 130], torch.float32, _split(32)),  # a merge kernel
    (32, 128, 1, 8, [64, 33], SMALL_BF16, _split(32, merge_in_kernel=True)),
]


@pytest.mark.parametrize("case", DECODE_CASES)
@pytest.mark.parametrize("window", [None, 20])
@pytest.mark.parametrize("write_new", [False, True])
def test_decode_attention_with_sinks(case, window, write_new) -> None:
    *shape, dtype, config = case
    num_heads = shape[2] * shape[3]
    sinks = random_sinks(num_heads, seed=len(shape[4]))
    out, args = run_decode(*shape, dtype, sinks, config=config, window=window, write_new=write_new)
    ref = sink_reference(*args, sinks, window=window)
    assert rel_error(out, ref) < tolerance(dtype)
    assert rel_error(ref, sink_reference(*args, None, window=window)) > 0.05


def test_decode_attention_sinks_in_bfloat16_and_padding_rows() -> None:
    """Sinks in the model's dtype (bf16 parameters) read as float32; a padding row
    (seq_len 0) still gets zeros, split or not."""
    key_cache, value_cache, table, tables = make_cache([40], 16, 1, 64, torch.float32, seed=1)
    query = torch.randn(2, 4, 64, device=DEVICE)
    seq = torch.tensor([40, 0], dtype=torch.int32, device=DEVICE)
    sinks = random_sinks(4, seed=3).to(torch.bfloat16)
    for max_len in (40, 4096):  # direct (the default split at one sequence) and split
        out = paged_decode_attention(
            query, key_cache, value_cache, torch.cat([table, table]), seq, 0.125, max_len,
            config=None if max_len == 40 else _split(16), sinks=sinks,
        )  # fmt: skip
        assert torch.equal(out[1], torch.zeros_like(out[1]))
        ref = sink_reference(query[:1], key_cache, value_cache, tables, [40], [1], 0.125, sinks)
        assert rel_error(out[:1], ref) < tolerance(torch.float32)  # tf32 dots on a GPU


def run_prefill(block_size, head_dim, num_kv_heads, group, chunks, dtype, sinks, window=None):
    query_lens = [q for q, _ in chunks]
    seq_lens = [q + c for q, c in chunks]
    key_cache, value_cache, table, tables = make_cache(
        seq_lens, block_size, num_kv_heads, head_dim, dtype, seed=sum(seq_lens)
    )
    gen = torch.Generator().manual_seed(len(chunks))
    query = torch.randn(sum(query_lens), num_kv_heads * group, head_dim, generator=gen)
    query = query.to(dtype).to(DEVICE)
    starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    scale = head_dim**-0.5
    out = paged_prefill_attention(
        query, key_cache, value_cache, table,
        torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE), starts.to(DEVICE), scale,
        max(query_lens), torch.full_like(query, float("nan")), block_m=16, block_n=16,
        sliding_window=window, sinks=sinks,
    )  # fmt: skip
    return out, (query, key_cache, value_cache, tables, seq_lens, query_lens, scale)


PREFILL_CASES = [
    # block_size, head_dim, num_kv_heads, group, chunks (query_len, context), dtype
    (16, 64, 2, 2, [(37, 0), (1, 20), (5, 0)], torch.float32),
    (16, 64, 1, 4, [(20, 35), (3, 0)], torch.float32),
    (32, 64, 1, 8, [(20, 13)], SMALL_BF16),
]


@pytest.mark.parametrize("case", PREFILL_CASES)
@pytest.mark.parametrize("window", [None, 7])
def test_prefill_attention_with_sinks(case, window) -> None:
    *shape, dtype = case
    sinks = random_sinks(shape[2] * shape[3], seed=len(shape[4]))
    out, args = run_prefill(*shape, dtype, sinks, window=window)
    ref = sink_reference(*args, sinks, window=window)
    assert rel_error(out, ref) < tolerance(dtype)
    assert rel_error(ref, sink_reference(*args, None, window=window)) > 0.05


def run_verify(
    block_size, head_dim, num_kv_heads, group, chunks, dtype, sinks,
    config=None, window=None, write_new=False,
):  # fmt: skip
    query_lens = [q for q, _ in chunks]
    seq_lens = [q + c for q, c in chunks]
    key_cache, value_cache, table, tables = make_cache(
        seq_lens, block_size, num_kv_heads, head_dim, dtype, seed=sum(seq_lens) + len(chunks)
    )
    new_kv = None
    if write_new:
        new_kv = take_step_kv(key_cache, value_cache, tables, seq_lens, query_lens)[0]
    gen = torch.Generator().manual_seed(len(chunks))
    query = torch.randn(sum(query_lens), num_kv_heads * group, head_dim, generator=gen)
    query = query.to(dtype).to(DEVICE)
    starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    scale = head_dim**-0.5
    out = paged_verify_attention(
        query, key_cache, value_cache, table,
        torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE), starts.to(DEVICE), scale,
        max(query_lens), max(seq_lens), torch.full_like(query, float("nan")),
        new_kv=new_kv, sliding_window=window, config=config, sinks=sinks,
    )  # fmt: skip
    return out, (query, key_cache, value_cache, tables, seq_lens, query_lens, scale)


VERIFY_CASES = [
    # block_size, head_dim, num_kv_heads, group, chunks, dtype, config
    (16, 64, 2, 2, [(5, 20), (3, 4)], torch.float32, None),  # one partition: direct
    (16, 64, 1, 4, [(5, 60), (2, 31), (4, 0)], torch.float32, _split(16)),
    (32, 64, 1, 8, [(4, 60), (4, 1)], SMALL_BF16, _split(32)),
]


@pytest.mark.parametrize("case", VERIFY_CASES)
@pytest.mark.parametrize("window", [None, 9])
def test_verify_attention_with_sinks(case, window) -> None:
    *shape, dtype, config = case
    sinks = random_sinks(shape[2] * shape[3], seed=len(shape[4]))
    out, args = run_verify(*shape, dtype, sinks, config=config, window=window, write_new=True)
    ref = sink_reference(*args, sinks, window=window)
    assert rel_error(out, ref) < tolerance(dtype)
    assert rel_error(ref, sink_reference(*args, None, window=window)) > 0.05


def test_sinks_of_minus_infinity_give_the_bits_of_no_sinks() -> None:
    """exp(-inf) adds nothing: the sink fold multiplies by exactly 1 and adds exactly 0, so
    every kernel (direct and split) returns the bits it returns without sinks, which
    the kernel tests of ``test_attention_kernels.py`` check against the reference."""
    absent = torch.full((8,), float("-inf"), device=DEVICE)
    for config in (None, _split(16, merge_in_kernel=True), _split(16)):
        plain, _ = run_decode(16, 64, 2, 4, [45, 3], torch.float32, None, config=config)
        folded, _ = run_decode(16, 64, 2, 4, [45, 3], torch.float32, absent, config=config)
        assert torch.equal(plain, folded)
        plain, _ = run_verify(16, 64, 2, 4, [(5, 40)], torch.float32, None, config=config)
        folded, _ = run_verify(16, 64, 2, 4, [(5, 40)], torch.float32, absent, config=config)
        assert torch.equal(plain, folded)
    plain, _ = run_prefill(16, 64, 2, 4, [(20, 13)], torch.float32, None, window=5)
    folded, _ = run_prefill(16, 64, 2, 4, [(20, 13)], torch.float32, absent, window=5)
    assert torch.equal(plain, folded)


def test_sinks_of_the_wrong_shape_are_refused() -> None:
    with pytest.raises(ValueError, match=r"contiguous \[8\] tensor"):
        run_decode(16, 64, 2, 4, [5], torch.float32, torch.zeros(4, device=DEVICE))


@pytest.mark.parametrize(
    "chunks",
    [[(1, 30), (1, 5), (1, 0)], [(5, 20), (3, 0)], [(20, 10), (1, 7)]],
    ids=["decodes", "verification", "prefill"],
)
@pytest.mark.parametrize("batch_invariant", [False, True])
@pytest.mark.parametrize("window", [None, 6])
def test_triton_backend_passes_sinks_to_every_kernel(chunks, batch_invariant, window) -> None:
    """Decode-only, verification-sized and prefill steps (and batch-invariant mode, all
    through the decode kernel) against the CPU backend with the same sinks."""
    from test_triton_backend import HEADS, make_layout, run_backend, to_triton_layout

    from pagedlm.attention.backend import AttentionBackend
    from pagedlm_cpu.attention import CpuSdpaBackend
    from pagedlm_cuda.attention import TritonAttentionBackend

    torch.manual_seed(len(chunks))
    layout = make_layout(chunks, 16, 40)
    shape = CpuSdpaBackend.kv_cache_shape(40, 16, 2, 64)
    caches = torch.randn(shape), torch.randn(shape)
    q = torch.randn(layout.num_tokens, HEADS, 64)
    k, v = torch.randn(2, layout.num_tokens, 2, 64)
    sinks = random_sinks(HEADS, seed=1).cpu()
    features = {} if window is None else {"sliding_window": window}

    def run(backend: AttentionBackend, device: torch.device, sinks: torch.Tensor | None):
        backend.set_batch_invariant(batch_invariant)
        moved = [t.to(device) for t in (q, k, v)]
        layout_caches = caches
        if isinstance(backend, TritonAttentionBackend):
            layout_caches = tuple(to_triton_layout(c) for c in caches)
        given = dict(features) if sinks is None else {**features, "sinks": sinks.to(device)}
        cache_pair = [c.to(device) for c in layout_caches]
        return run_backend(backend, layout, *moved, *cache_pair, **given)[0]

    cpu = torch.device("cpu")
    ref = run(CpuSdpaBackend(cpu), cpu, sinks)
    out = run(TritonAttentionBackend(DEVICE), DEVICE, sinks)
    assert rel_error(out, ref) < 2e-3
    assert rel_error(run(CpuSdpaBackend(cpu), cpu, None), ref) > 0.05
