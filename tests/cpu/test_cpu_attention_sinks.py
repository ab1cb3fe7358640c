"""CpuSdpaBackend with attention sinks (gpt-oss: a logit per query head in every softmax's
denominator, no value) against a float64 reference: chunks and decodes, sliding windows,
decodes split into groups, batch-invariant mode, many bf16 decodes (whose matmul path
takes no sinks and must be declined); and the attention layer passing its sinks, or
refusing a backend without them."""

from __future__ import annotations

import random

import pytest
import torch

from pagedlm.attention.backend import BatchLayout
from pagedlm.kv_cache.interface import TensorKVCache
from pagedlm.model_executor.forward_context import ForwardContext
from pagedlm.model_executor.layers.attention import Attention
from pagedlm_cpu import decode_groups, decode_matmuls
from pagedlm_cpu.attention import CpuSdpaBackend

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, NUM_BLOCKS, BLOCK_SIZE = 4, 2, 16, 96, 4
SCALE = HEAD_DIM**-0.5
SINKS = torch.tensor([2.5, -1.0, 0.5, 4.0])
"""Around the scores' log-sum-exp, so each takes a visible share of its softmax."""


def reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    context_len: int,
    window: int | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """q [query_len, heads, d], k/v [seq_len, kv_heads, d] -> [query_len, heads, d]
    float64: causal (within ``window``), ``exp(sinks[h])`` added to head h's denominator."""
    q, k, v = q.double(), k.double(), v.double()
    group = NUM_HEADS // NUM_KV_HEADS
    out = torch.empty_like(q)
    for i in range(q.shape[0]):
        end = context_len + i + 1
        start = 0 if window is None else max(0, end - window)
        for h in range(NUM_HEADS):
            scores = (k[start:end, h // group] @ q[i, h]) * SCALE
            if sinks is not None:
                scores = torch.cat([scores, sinks[h : h + 1].double()])
            probs = torch.softmax(scores, 0)[: end - start]
            out[i, h] = probs @ v[start:end, h // group]
    return out


def run(
    requests: list[tuple[int, int]],
    window: int | None = None,
    sinks: torch.Tensor | None = SINKS,
    dtype: torch.dtype = torch.float32,
    backend: CpuSdpaBackend | None = None,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One step over (context_len, query_len) requests: (output, float64 reference)."""
    torch.manual_seed(seed)
    rng = random.Random(seed)
    free = list(range(NUM_BLOCKS))
    rng.shuffle(free)
    shape = CpuSdpaBackend.kv_cache_shape(NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    key_cache, value_cache = torch.randn(shape).to(dtype), torch.randn(shape).to(dtype)
    starts, seq_lens, tables, slot_mapping = [0], [], [], []
    queries, keys, values, expected = [], [], [], []
    for context_len, query_len in requests:
        seq_len = context_len + query_len
        table = [free.pop() for _ in range(-(-seq_len // BLOCK_SIZE))]
        slots = [table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(seq_len)]
        k = torch.randn(seq_len, NUM_KV_HEADS, HEAD_DIM).to(dtype)
        v = torch.randn(seq_len, NUM_KV_HEADS, HEAD_DIM).to(dtype)
        q = torch.randn(query_len, NUM_HEADS, HEAD_DIM).to(dtype)
        key_cache.view(-1, NUM_KV_HEADS, HEAD_DIM)[slots[:context_len]] = k[:context_len]
        value_cache.view(-1, NUM_KV_HEADS, HEAD_DIM)[slots[:context_len]] = v[:context_len]
        starts.append(starts[-1] + query_len)
        seq_lens.append(seq_len)
        tables.append(table)
        slot_mapping += slots[context_len:]
        queries.append(q)
        keys.append(k[context_len:])
        values.append(v[context_len:])
        expected.append(reference(q, k, v, context_len, window, sinks))
    backend = backend or CpuSdpaBackend(torch.device("cpu"))
    layout = BatchLayout.from_lists(starts, seq_lens, tables, slot_mapping, BLOCK_SIZE)
    kwargs: dict[str, object] = {}
    if window is not None:
        kwargs["sliding_window"] = window
    if sinks is not None:
        kwargs["sinks"] = sinks.to(dtype)
    out = backend.forward(
        torch.cat(queries),
        torch.cat(keys),
        torch.cat(values),
        key_cache,
        value_cache,
        backend.build_metadata(layout),
        SCALE,
        **kwargs,
    )
    return out, torch.cat(expected)


# (context_len, query_len): decodes past the window and inside it, chunks with and
# without cached context, a prompt longer than the window, a single-token prompt.
MIXED = [(30, 1), (3, 1), (0, 23), (17, 9), (0, 1), (40, 1), (5, 20)]
DECODES = [(30, 1), (3, 1), (17, 1), (0, 1), (40, 1)]
ONE_DECODE = [(21, 1)]  # one decode: its keys cut to its length, no mask


@pytest.mark.parametrize("requests", [MIXED, DECODES, ONE_DECODE], ids=["mixed", "decodes", "one"])
@pytest.mark.parametrize("window", [None, 1, 6])
def test_sinks_match_the_reference(requests, window) -> None:
    out, expected = run(requests, window)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
    _, without = run(requests, window, sinks=None)
    assert (expected - without).abs().max() > 0.05  # the sinks matter here


def test_sinks_with_decodes_split_into_groups(monkeypatch) -> None:
    monkeypatch.setattr(decode_groups, "MIN_DECODE_GROUP", 2)
    requests = [(c, 1) for c in (0, 40, 3, 22, 9, 1, 33, 5)] + [(20, 7)]
    backend = CpuSdpaBackend(torch.device("cpu"))
    assert len(backend.build_metadata(_layout(requests)).decode_groups) > 1
    out, expected = run(requests, backend=backend, seed=3)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


def test_sinks_in_batch_invariant_mode() -> None:
    backend = CpuSdpaBackend(torch.device("cpu"))
    backend.set_batch_invariant(True)
    for window in (None, 6):
        out, expected = run(MIXED, window, backend=backend, seed=1)
        torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


def test_many_bf16_decodes_with_sinks_decline_the_matmuls(monkeypatch) -> None:
    """``decode_matmuls`` has no sinks: a group large enough for it goes through the
    explicit path instead, and still matches the reference."""
    calls = []
    monkeypatch.setattr(decode_matmuls, "attend_decodes", lambda *a: calls.append(a))
    requests = [(c, 1) for c in range(3, 3 + 2 * decode_matmuls.MIN_DECODES, 2)]
    out, expected = run(requests, dtype=torch.bfloat16, seed=2)
    assert calls == []
    torch.testing.assert_close(out.double(), expected, atol=3e-2, rtol=3e-2)


def _layout(requests: list[tuple[int, int]]) -> BatchLayout:
    starts, seq_lens, tables, slots = [0], [], [], []
    for i, (context_len, query_len) in enumerate(requests):
        seq_len = context_len + query_len
        table = [i * 12 + j for j in range(-(-seq_len // BLOCK_SIZE))]
        starts.append(starts[-1] + query_len)
        seq_lens.append(seq_len)
        tables.append(table)
        slots += [table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
                  for p in range(context_len, seq_len)]  # fmt: skip
    return BatchLayout.from_lists(starts, seq_lens, tables, slots, BLOCK_SIZE)


def _layer_step(backend: CpuSdpaBackend, layer: Attention, length: int) -> torch.Tensor:
    layout = BatchLayout.from_lists([0, length], [length], [[0, 1, 2, 3]], range(length), 4)
    shape = backend.kv_cache_shape(4, 4, NUM_KV_HEADS, HEAD_DIM)
    cache = TensorKVCache(shape, 1, 4, torch.float32, lambda s, d: torch.zeros(s, dtype=d))
    ctx = ForwardContext(backend, backend.build_metadata(layout), cache)
    torch.manual_seed(4)
    q = torch.randn(length, NUM_HEADS * HEAD_DIM)
    k, v = torch.randn(2, length, NUM_KV_HEADS * HEAD_DIM)
    return layer(q, k, v, ctx).view(length, NUM_HEADS, HEAD_DIM), q, k, v


def test_attention_layer_passes_its_sinks_and_loads_them() -> None:
    layer = Attention(0, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, SCALE, sliding_window=5, sinks=True)
    layer.sinks.weight_loader(layer.sinks, SINKS)
    assert torch.equal(layer.sinks, SINKS) and "sinks=True" in repr(layer)
    out, q, k, v = _layer_step(CpuSdpaBackend(torch.device("cpu")), layer, 11)
    heads = (11, NUM_HEADS, HEAD_DIM)
    kv_heads = (11, NUM_KV_HEADS, HEAD_DIM)
    expected = reference(q.view(heads), k.view(kv_heads), v.view(kv_heads), 0, 5, SINKS)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


def test_attention_layer_refuses_a_backend_without_sinks() -> None:
    class NoSinksBackend(CpuSdpaBackend):
        name = "no_sinks"
        supports_sinks = False

    layer = Attention(0, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, SCALE, sinks=True)
    with pytest.raises(ValueError, match=r"sinks=\[4\].*'no_sinks'"):
        _layer_step(NoSinksBackend(torch.device("cpu")), layer, 3)
    # A layer without sinks still runs on it.
    _layer_step(NoSinksBackend(torch.device("cpu")), Attention(0, 4, 2, HEAD_DIM, SCALE), 3)
