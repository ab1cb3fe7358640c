"""CpuSdpaBackend with sliding windows, logit soft-capping and bidirectional spans (Gemma 3
images) against a float64 reference."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch

from pagedlm.attention.backend import BatchLayout
from pagedlm_cpu.attention import CpuSdpaBackend

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, NUM_BLOCKS, BLOCK_SIZE = 4, 2, 8, 64, 4
SCALE = HEAD_DIM**-0.5


def reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    context_len: int,
    window: int | None,
    soft_cap: float | None,
    spans: list[tuple[int, int]] = (),
) -> torch.Tensor:
    """q [query_len, heads, d], k/v [seq_len, kv_heads, d] -> [query_len, heads, d] (float64).
    Key j is visible to position p if j <= p or both sit in one span, and j > p - window."""
    q, k, v = q.double(), k.double(), v.double()
    group = NUM_HEADS // NUM_KV_HEADS
    out = torch.empty_like(q)
    for i in range(q.shape[0]):
        position = context_len + i
        keys = [
            j
            for j in range(k.shape[0])
            if (j <= position or any(a <= j < b and a <= position < b for a, b in spans))
            and (window is None or j > position - window)
        ]
        for h in range(NUM_HEADS):
            scores = (k[keys, h // group] @ q[i, h]) * SCALE
            if soft_cap is not None:
                scores = torch.tanh(scores / soft_cap) * soft_cap
            out[i, h] = torch.softmax(scores, 0) @ v[keys, h // group]
    return out


def run(
    requests: list[tuple[int, int]],
    window: int | None,
    soft_cap: float | None,
    layers: int = 1,
    spans: tuple[tuple[int, int, int], ...] = (),
) -> None:
    """One step over (context_len, query_len) requests; ``layers`` forwards share metadata;
    ``spans``: the layout's bidirectional spans (request row, start, end)."""
    torch.manual_seed(0)
    rng = random.Random(0)
    free = list(range(NUM_BLOCKS))
    rng.shuffle(free)
    shape = CpuSdpaBackend.kv_cache_shape(NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    query_start, seq_lens, tables, slots_all = [0], [], [], []
    per_request = []
    for context_len, query_len in requests:
        seq_len = context_len + query_len
        table = [free.pop() for _ in range(-(-seq_len // BLOCK_SIZE))]
        slots = [table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(seq_len)]
        query_start.append(query_start[-1] + query_len)
        seq_lens.append(seq_len)
        tables.append(table)
        slots_all += slots[context_len:]
        per_request.append((context_len, slots))
    backend = CpuSdpaBackend(torch.device("cpu"))
    layout = BatchLayout.from_lists(query_start, seq_lens, tables, slots_all, BLOCK_SIZE)
    metadata = backend.build_metadata(replace(layout, bidirectional_spans=spans))
    for _ in range(layers):
        key_cache, value_cache = torch.randn(shape), torch.randn(shape)
        queries, keys, values, expected = [], [], [], []
        for row, (context_len, slots) in enumerate(per_request):
            k = torch.randn(len(slots), NUM_KV_HEADS, HEAD_DIM)
            v = torch.randn(len(slots), NUM_KV_HEADS, HEAD_DIM)
            q = torch.randn(len(slots) - context_len, NUM_HEADS, HEAD_DIM)
            key_cache.view(-1, NUM_KV_HEADS, HEAD_DIM)[slots[:context_len]] = k[:context_len]
            value_cache.view(-1, NUM_KV_HEADS, HEAD_DIM)[slots[:context_len]] = v[:context_len]
            queries.append(q)
            keys.append(k[context_len:])
            values.append(v[context_len:])
            own = [(a, b) for r, a, b in spans if r == row]
            expected.append(reference(q, k, v, context_len, window, soft_cap, own))
        kwargs = {}
        if window is not None:
            kwargs["sliding_window"] = window
        if soft_cap is not None:
            kwargs["logits_soft_cap"] = soft_cap
        out = backend.forward(
            torch.cat(queries),
            torch.cat(keys),
            torch.cat(values),
            key_cache,
            value_cache,
            metadata,
            SCALE,
            **kwargs,
        )
        torch.testing.assert_close(out.double(), torch.cat(expected), atol=1e-5, rtol=1e-5)


# (context_len, query_len): decodes far past the window and inside it, chunks with and
# without cached context, a prompt longer than the window in one chunk.
MIXED = [(30, 1), (3, 1), (0, 23), (17, 9), (0, 3), (40, 1), (5, 20)]


@pytest.mark.parametrize("window", [None, 1, 5, 8, 64])
@pytest.mark.parametrize("soft_cap", [None, 2.0])
def test_window_and_soft_cap_match_reference(window, soft_cap):
    run(MIXED, window, soft_cap)


def test_shared_window_masks_stay_right_across_layers():
    run(MIXED, 6, None, layers=3)


@pytest.mark.parametrize("soft_cap", [None, 2.0])
def test_windows_of_decodes_split_by_context_length(monkeypatch, soft_cap):
    """Each decode group gets its own window mask (``decode_partition``)."""
    from pagedlm_cpu import decode_groups

    monkeypatch.setattr(decode_groups, "MIN_DECODE_GROUP", 2)
    decodes = [(30, 1), (3, 1), (40, 1), (0, 1), (12, 1), (25, 1), (7, 1)]
    run(decodes + [(17, 9)], 6, soft_cap, layers=2)


def test_only_decodes_and_only_chunks():
    run([(12, 1), (29, 1)], 7, None)
    run([(0, 19), (8, 12)], 7, 3.0)


# Spans (request row of MIXED, start, end) as a Gemma 3 step sets them: two images in a
# chunk without cached context, one whose start is cached (a prefix hit inside it) and
# one fed whole after a cached prefix, one longer than a window of 5; the decodes beside
# them are unaffected.
SPANS = ((2, 3, 7), (2, 10, 14), (3, 14, 20), (3, 21, 25), (6, 8, 16))


@pytest.mark.parametrize("window", [None, 5, 64])
@pytest.mark.parametrize("soft_cap", [None, 2.0])
def test_bidirectional_spans_match_reference(window, soft_cap):
    run(MIXED, window, soft_cap, spans=SPANS)


def test_attention_layer_refuses_a_backend_without_the_feature():
    from pagedlm.kv_cache.interface import TensorKVCache
    from pagedlm.model_executor.forward_context import ForwardContext
    from pagedlm.model_executor.layers.attention import Attention

    class NoWindowBackend(CpuSdpaBackend):
        name = "no_window"
        supports_sliding_window = False

    backend = NoWindowBackend(torch.device("cpu"))
    layout = BatchLayout.from_lists([0, 2], [2], [[0]], [0, 1], BLOCK_SIZE)
    shape = backend.kv_cache_shape(1, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    cache = TensorKVCache(shape, 1, BLOCK_SIZE, torch.float32, lambda s, d: torch.zeros(s))
    ctx = ForwardContext(backend, backend.build_metadata(layout), cache)
    layer = Attention(0, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, SCALE, sliding_window=4)
    q = torch.randn(2, NUM_HEADS * HEAD_DIM)
    kv = torch.randn(2, NUM_KV_HEADS * HEAD_DIM)
    with pytest.raises(ValueError, match=r"sliding_window=4.*'no_window'"):
        layer(q, kv, kv, ctx)
