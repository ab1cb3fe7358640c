"""CpuSdpaBackend against a naive float64 attention over each request's full K/V."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from pagedlm.attention.backend import BatchLayout
from pagedlm_cpu import decode_groups, decode_matmuls
from pagedlm_cpu.attention import CpuSdpaBackend, decode_partition

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, NUM_BLOCKS = 4, 2, 16, 64


def reference_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    context_len: int,
    scale: float,
    causal: bool = True,
) -> torch.Tensor:
    """q: [query_len, heads, d]; k, v: [seq_len, kv_heads, d] -> [query_len, heads, d]."""
    q, k, v = q.double(), k.double(), v.double()
    group = NUM_HEADS // NUM_KV_HEADS
    out = torch.empty_like(q)
    for i in range(q.shape[0]):
        visible = context_len + i + 1 if causal else k.shape[0]
        for h in range(NUM_HEADS):
            scores = (k[:visible, h // group] @ q[i, h]) * scale
            out[i, h] = torch.softmax(scores, 0) @ v[:visible, h // group]
    return out


def run_step(
    requests: list[tuple[int, int]],
    block_size: int,
    seed: int = 0,
    backend: CpuSdpaBackend | None = None,
    dtype: torch.dtype = torch.float32,
    causal: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """Run one step; requests are (context_len, query_len). Returns output, reference,
    the new keys per request, and the key cache. ``causal=False``: bidirectional."""
    torch.manual_seed(seed)
    rng = random.Random(seed)
    free_blocks = list(range(NUM_BLOCKS))
    rng.shuffle(free_blocks)
    cache_shape = CpuSdpaBackend.kv_cache_shape(NUM_BLOCKS, block_size, NUM_KV_HEADS, HEAD_DIM)
    # Garbage in unused slots must not leak in.
    key_cache = torch.randn(cache_shape).to(dtype)
    value_cache = torch.randn(cache_shape).to(dtype)
    flat_k = key_cache.view(-1, NUM_KV_HEADS, HEAD_DIM)
    flat_v = value_cache.view(-1, NUM_KV_HEADS, HEAD_DIM)

    query_start, seq_lens, tables, slot_mapping = [0], [], [], []
    queries, keys, values, full_k, full_v = [], [], [], [], []
    for context_len, query_len in requests:
        seq_len = context_len + query_len
        num_blocks = -(-seq_len // block_size) + rng.randint(0, 1)  # tables may be longer
        table = [free_blocks.pop() for _ in range(num_blocks)]
        slots = [table[p // block_size] * block_size + p % block_size for p in range(seq_len)]
        k_all = torch.randn(seq_len, NUM_KV_HEADS, HEAD_DIM).to(dtype)
        v_all = torch.randn(seq_len, NUM_KV_HEADS, HEAD_DIM).to(dtype)
        flat_k[slots[:context_len]] = k_all[:context_len]
        flat_v[slots[:context_len]] = v_all[:context_len]
        query_start.append(query_start[-1] + query_len)
        seq_lens.append(seq_len)
        tables.append(table)
        slot_mapping += slots[context_len:]
        queries.append(torch.randn(query_len, NUM_HEADS, HEAD_DIM).to(dtype))
        keys.append(k_all[context_len:])
        values.append(v_all[context_len:])
        full_k.append(k_all)
        full_v.append(v_all)

    layout = BatchLayout.from_lists(query_start, seq_lens, tables, slot_mapping, block_size)
    backend = backend or CpuSdpaBackend(torch.device("cpu"))
    scale = HEAD_DIM**-0.5
    metadata = backend.build_metadata(layout)
    out = backend.forward(
        torch.cat(queries),
        torch.cat(keys),
        torch.cat(values),
        key_cache,
        value_cache,
        metadata,
        scale,
        **({} if causal else {"causal": False}),
    )
    reference = torch.cat(
        [
            reference_attention(q, k, v, context_len, scale, causal)
            for q, k, v, (context_len, _) in zip(queries, full_k, full_v, requests, strict=True)
        ]
    )
    return out, reference, keys, key_cache, torch.tensor(slot_mapping)


SCENARIOS = {
    "mixed": [(20, 7), (30, 1), (0, 9), (0, 1), (5, 1), (3, 13)],
    "decodes_first_same_length": [(17, 1), (17, 1), (17, 1), (0, 33)],
    "decodes_only_ragged": [(0, 1), (40, 1), (15, 1), (16, 1)],
    "prompts_only": [(0, 5), (0, 2), (0, 40)],
    "chunk_on_block_boundary": [(16, 16), (8, 4)],
    "decodes_filling_whole_blocks": [(15, 1), (15, 1), (0, 16)],
}


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_bidirectional_matches_float64_reference(scenario: str) -> None:
    """``causal=False``: every row sees all of its request's keys (cached ones too)."""
    out, reference, *_ = run_step(SCENARIOS[scenario], 4, causal=False)
    torch.testing.assert_close(out.double(), reference, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("block_size", [16, 4])
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_matches_float64_reference(scenario: str, block_size: int) -> None:
    out, reference, keys, key_cache, slot_mapping = run_step(SCENARIOS[scenario], block_size)
    assert out.shape == reference.shape
    torch.testing.assert_close(out.double(), reference, atol=1e-5, rtol=1e-5)
    written = key_cache.view(-1, NUM_KV_HEADS, HEAD_DIM)[slot_mapping]
    torch.testing.assert_close(written, torch.cat(keys), atol=0, rtol=0)


RAGGED_DECODES = [(0, 1), (40, 1), (3, 1), (22, 1), (9, 1), (1, 1), (33, 1), (20, 7), (5, 1)]
"""Decodes of contexts 1 to 41 around one chunk: split into groups by context length."""


@pytest.mark.parametrize("block_size", [16, 4])
def test_decodes_split_by_context_length_match_the_reference(monkeypatch, block_size) -> None:
    monkeypatch.setattr(decode_groups, "MIN_DECODE_GROUP", 2)
    backend = CpuSdpaBackend(torch.device("cpu"))
    out, reference, *_ = run_step(RAGGED_DECODES, block_size, seed=3, backend=backend)
    torch.testing.assert_close(out.double(), reference, atol=1e-5, rtol=1e-5)
    only_decodes = [r for r in RAGGED_DECODES if r[1] == 1]
    out, reference, *_ = run_step(only_decodes, block_size, seed=4, backend=backend)
    torch.testing.assert_close(out.double(), reference, atol=1e-5, rtol=1e-5)


def test_the_decode_groups_of_a_ragged_batch(monkeypatch) -> None:
    monkeypatch.setattr(decode_groups, "MIN_DECODE_GROUP", 2)
    requests = RAGGED_DECODES
    tables = [list(range(3 * i, 3 * i + 3)) for i in range(len(requests))]
    layout, _ = _two_layer_step(tables, requests, 16)
    groups = CpuSdpaBackend(torch.device("cpu")).build_metadata(layout).decode_groups
    assert len(groups) == 4  # 8 decodes, at least 2 each
    blocks = [-(-int(s) // 16) for g in groups for s in g.seq_lens]
    assert blocks == sorted(blocks, reverse=True)  # longest contexts first
    rows = sorted(int(r) for g in groups for r in g.token_rows)
    starts = layout.query_start_loc_cpu
    assert rows == [int(starts[i]) for i, (_, q) in enumerate(requests) if q == 1]


def test_decode_partition() -> None:
    # Few decodes, or little padding: one group, in order.
    assert [g.tolist() for g in decode_partition(np.array([1, 9, 3]))] == [[0, 1, 2]]
    even = np.full(256, 7)
    even[3] = 8
    assert len(decode_partition(even)) == 1
    # 256 decodes of 1..32 blocks: 8 groups of 32, longest first, each index once.
    blocks = np.arange(256) % 32 + 1
    groups = decode_partition(blocks)
    assert [len(g) for g in groups] == [32] * 8
    assert sorted(np.concatenate(groups).tolist()) == list(range(256))
    maxima = [int(blocks[g].max()) for g in groups]
    assert maxima == sorted(maxima, reverse=True) and maxima[0] == 32 and maxima[-1] == 4
    # 64 decodes: 2 groups at most (32 each).
    assert len(decode_partition(np.arange(64) % 16 + 1)) == 2


def test_bfloat16_stays_close_to_reference() -> None:
    out, reference, *_ = run_step(SCENARIOS["mixed"], 4, dtype=torch.bfloat16)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), reference, atol=2e-2, rtol=2e-2)


def test_one_backend_serves_steps_of_changing_size() -> None:
    """The gather workspaces are reused and regrown across steps."""
    backend = CpuSdpaBackend(torch.device("cpu"))
    for seed, scenario in enumerate(["prompts_only", "mixed", "decodes_only_ragged", "mixed"]):
        out, reference, *_ = run_step(SCENARIOS[scenario], 4, seed=seed, backend=backend)
        torch.testing.assert_close(out.double(), reference, atol=1e-5, rtol=1e-5)


def test_request_reads_blocks_another_request_writes_in_the_same_step() -> None:
    """A prefix-cache hit on blocks being filled this step sees this step's K/V."""
    torch.manual_seed(0)
    block_size = 4
    shape = CpuSdpaBackend.kv_cache_shape(8, block_size, NUM_KV_HEADS, HEAD_DIM)
    key_cache, value_cache = torch.zeros(shape), torch.zeros(shape)
    # Request 0 computes 8 prompt tokens into blocks [5, 2]; request 1 shares those two
    # blocks as its cached prefix and computes 3 more tokens into block 7.
    prefix_slots = [5 * 4 + i for i in range(4)] + [2 * 4 + i for i in range(4)]
    tail_slots = [7 * 4 + i for i in range(3)]
    layout = BatchLayout.from_lists(
        [0, 8, 11], [8, 11], [[5, 2], [5, 2, 7]], prefix_slots + tail_slots, 4
    )
    q = torch.randn(11, NUM_HEADS, HEAD_DIM)
    k = torch.randn(11, NUM_KV_HEADS, HEAD_DIM)
    v = torch.randn(11, NUM_KV_HEADS, HEAD_DIM)
    backend = CpuSdpaBackend(torch.device("cpu"))
    out = backend.forward(q, k, v, key_cache, value_cache, backend.build_metadata(layout), 0.25)
    expected_tail = reference_attention(q[8:], k, v, 8, 0.25)
    torch.testing.assert_close(out[8:].double(), expected_tail, atol=1e-5, rtol=1e-5)


def test_short_block_table_is_rejected() -> None:
    layout = BatchLayout.from_lists([0, 5], [5], [[0]], [0, 1, 2, 3, 4], 4)
    with pytest.raises(ValueError, match="block table covering every position"):
        CpuSdpaBackend(torch.device("cpu")).build_metadata(layout)


def _two_layer_step(tables: list[list[int]], requests: list[tuple[int, int]], block_size: int):
    """A layout for ``requests`` (context_len, query_len) over ``tables``, and per layer
    (two of them) random caches and q/k/v for that step."""
    seq_lens = [c + q for c, q in requests]
    query_start = [0]
    slot_mapping = []
    for (context_len, query_len), table in zip(requests, tables, strict=True):
        query_start.append(query_start[-1] + query_len)
        for p in range(context_len, context_len + query_len):
            slot_mapping.append(table[p // block_size] * block_size + p % block_size)
    layout = BatchLayout.from_lists(query_start, seq_lens, tables, slot_mapping, block_size)
    shape = CpuSdpaBackend.kv_cache_shape(NUM_BLOCKS, block_size, NUM_KV_HEADS, HEAD_DIM)
    num_tokens = query_start[-1]
    layers = [
        (
            torch.randn(num_tokens, NUM_HEADS, HEAD_DIM),
            torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM),
            torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM),
            torch.randn(shape),
            torch.randn(shape),
        )
        for _ in range(2)
    ]
    return layout, layers


def _per_layer_outputs(layout, layers, shared_metadata: bool) -> list[torch.Tensor]:
    backend = CpuSdpaBackend(torch.device("cpu"))
    metadata = backend.build_metadata(layout)
    outputs = []
    for q, k, v, key_cache, value_cache in layers:
        step_metadata = metadata if shared_metadata else backend.build_metadata(layout)
        outputs.append(
            backend.forward(q, k, v, key_cache.clone(), value_cache.clone(), step_metadata, 0.25)
        )
    return outputs


@pytest.mark.parametrize(
    ("tables", "block_run"),
    [([[9, 10, 11]], 9), ([[9, 11, 10]], None), ([[30]], 30)],
)
def test_one_decode_on_consecutive_blocks_reads_the_cache_in_place(tables, block_run):
    torch.manual_seed(0)
    layout, layers = _two_layer_step(tables, [(4 * len(tables[0]) - 2, 1)], 4)
    metadata = CpuSdpaBackend(torch.device("cpu")).build_metadata(layout)
    (group,) = metadata.decode_groups
    assert group.block_run == block_run
    # One decode reads its keys cut to its length: no padding, so no mask for SDPA.
    assert group.key_mask is None
    assert group.num_key_slots == int(layout.seq_lens_cpu[0])
    q, k, v, key_cache, value_cache = layers[0]
    out = _per_layer_outputs(layout, layers, shared_metadata=True)[0]
    seq_len = int(layout.seq_lens_cpu[0])
    cached_k = key_cache.view(-1, NUM_KV_HEADS, HEAD_DIM)
    cached_v = value_cache.view(-1, NUM_KV_HEADS, HEAD_DIM)
    slots = [tables[0][p // 4] * 4 + p % 4 for p in range(seq_len)]
    full_k, full_v = cached_k[slots].clone(), cached_v[slots].clone()
    full_k[-1], full_v[-1] = k[0], v[0]  # the step's own K/V, written before the read
    expected = reference_attention(q, full_k, full_v, seq_len - 1, 0.25)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


def test_layers_of_one_step_share_the_decodes_gather_views():
    """The decodes' gather views are made by the first layer and reused by the next, also
    when a longer chunk regrows the workspaces in between."""
    torch.manual_seed(1)
    tables = [[3], [7], [20 + i for i in range(12)]]
    layout, layers = _two_layer_step(tables, [(3, 1), (2, 1), (40, 5)], 4)
    shared = _per_layer_outputs(layout, layers, shared_metadata=True)
    fresh = _per_layer_outputs(layout, layers, shared_metadata=False)
    for a, b in zip(shared, fresh, strict=True):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    assert not torch.equal(shared[0], shared[1])


MANY_DECODES = [(c, 1) for c in (0, 40, 3, 22, 9, 1, 33, 5, 17, 12, 2, 7, 30, 11, 4, 19)]
"""Enough decodes in one group for ``decode_matmuls`` (bf16)."""


@pytest.mark.parametrize("block_size", [16, 8])
@pytest.mark.parametrize("with_chunk", [False, True])
def test_many_bf16_decodes_take_the_matmuls_and_match_the_reference(
    monkeypatch, block_size: int, with_chunk: bool
) -> None:
    calls = []
    attend = decode_matmuls.attend_decodes
    monkeypatch.setattr(
        decode_matmuls, "attend_decodes", lambda *a: calls.append(a[0].shape) or attend(*a)
    )
    requests = MANY_DECODES + ([(20, 7)] if with_chunk else [])
    out, reference, *_ = run_step(requests, block_size, seed=5, dtype=torch.bfloat16)
    assert calls == [(len(MANY_DECODES), NUM_KV_HEADS, NUM_HEADS // NUM_KV_HEADS, HEAD_DIM)]
    torch.testing.assert_close(out.double(), reference, atol=2e-2, rtol=2e-2)
    # Fewer decodes, or float32: SDPA, as before.
    calls.clear()
    run_step(MANY_DECODES[: decode_matmuls.MIN_DECODES - 1], block_size, dtype=torch.bfloat16)
    run_step(MANY_DECODES, block_size)
    assert calls == []


def test_layers_of_one_step_share_the_matmul_decodes_gathers() -> None:
    """As the SDPA path's: made by the first layer, reused by the next, also when a longer
    chunk regrows the workspaces in between; the same bits as fresh metadata per layer."""
    torch.manual_seed(2)
    requests = [(3 + i % 9, 1) for i in range(16)] + [(40, 5)]
    tables = [[3 * i, 3 * i + 1, 3 * i + 2] for i in range(16)] + [[50 + i for i in range(12)]]
    layout, layers = _two_layer_step(tables, requests, 4)
    layers = [tuple(t.bfloat16() for t in layer) for layer in layers]
    shared = _per_layer_outputs(layout, layers, shared_metadata=True)
    fresh = _per_layer_outputs(layout, layers, shared_metadata=False)
    for a, b in zip(shared, fresh, strict=True):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    assert not torch.equal(shared[0], shared[1])
