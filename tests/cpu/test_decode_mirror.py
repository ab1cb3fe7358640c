"""The CPU backend's decode mirror: decodes read from it attend exactly as decodes gathered
from the cache, step after step, while requests come and go, contexts cross blocks, chunks
join the step and the group moves between SDPA and the batched matmuls."""

from __future__ import annotations

import gc
import random

import pytest
import torch

from pagedlm.attention.backend import BatchLayout
from pagedlm_cpu import decode_mirror
from pagedlm_cpu.attention import CpuSdpaBackend

BLOCK_SIZE = 4
NUM_BLOCKS = 2048
KV_HEADS, GROUP, HEAD_DIM = 2, 3, 8


class Request:
    def __init__(self, rng: random.Random, free: list[int], seq_len: int) -> None:
        self.blocks: list[int] = []
        self.free = free
        self.seq_len = 0
        self.rng = rng
        self.grow(seq_len)

    def grow(self, seq_len: int) -> list[int]:
        """Slots of positions ``self.seq_len .. seq_len - 1``, taking blocks as needed
        (at random from the free list: tables are never consecutive)."""
        slots = []
        for position in range(self.seq_len, seq_len):
            if position // BLOCK_SIZE == len(self.blocks):
                self.blocks.append(self.free.pop(self.rng.randrange(len(self.free))))
            slots.append(self.blocks[position // BLOCK_SIZE] * BLOCK_SIZE + position % BLOCK_SIZE)
        self.seq_len = seq_len
        return slots


def _step(backends, caches, requests, query_lens, dtype, generator):
    """One step of every backend on its own caches; returns their outputs."""
    starts, seq_lens, tables, slots = [0], [], [], []
    for request, query_len in zip(requests, query_lens):
        slots += request.grow(request.seq_len + query_len)
        starts.append(starts[-1] + query_len)
        seq_lens.append(request.seq_len)
        tables.append(request.blocks)
    width = max(map(len, tables))
    tables = [table + [0] * (width - len(table)) for table in tables]
    layout = BatchLayout.from_lists(starts, seq_lens, tables, slots, BLOCK_SIZE)
    tokens = starts[-1]
    query = torch.randn(tokens, KV_HEADS * GROUP, HEAD_DIM, generator=generator).to(dtype)
    key = torch.randn(tokens, KV_HEADS, HEAD_DIM, generator=generator).to(dtype)
    value = torch.randn(tokens, KV_HEADS, HEAD_DIM, generator=generator).to(dtype)
    outs = []
    for index, (backend, (key_cache, value_cache)) in enumerate(zip(backends, caches)):
        metadata = backend.build_metadata(layout)
        # The first backend's steps of decodes only go as the decoder layer's kernel takes
        # them: through ``decode_only_step``, which hands the mirror the new keys.
        step = backend.decode_only_step(metadata, tokens) if index == 0 else None
        if step is None:
            out = backend.forward(query, key, value, key_cache, value_cache, metadata, 0.35)
        else:
            grouped = query.view(tokens, KV_HEADS, GROUP, HEAD_DIM)
            out = step(grouped, key, value, key_cache, value_cache, 0.35).reshape(query.shape)
        outs.append(out)
    return outs


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_decodes_read_from_the_mirror_match_decodes_gathered_from_the_cache(monkeypatch, dtype):
    calls = {"rebuild": 0, "read": 0}
    rebuild, read = decode_mirror.DecodeMirror._rebuild, decode_mirror.DecodeMirror.read

    def counting_rebuild(*args):
        calls["rebuild"] += 1
        return rebuild(*args)

    def counting_read(self, *args):
        calls["read"] += 1
        return read(self, *args)

    monkeypatch.setattr(decode_mirror.DecodeMirror, "_rebuild", staticmethod(counting_rebuild))
    monkeypatch.setattr(decode_mirror.DecodeMirror, "read", counting_read)
    mirrored = CpuSdpaBackend(torch.device("cpu"))
    gathered = CpuSdpaBackend(torch.device("cpu"))
    gathered._mirror = None
    assert mirrored._mirror is not None
    shape = (NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    first = (torch.randn(shape).to(dtype), torch.randn(shape).to(dtype))
    caches = [first, (first[0].clone(), first[1].clone())]
    rng, generator = random.Random(0), torch.Generator().manual_seed(0)
    free = list(range(NUM_BLOCKS))
    requests = [Request(rng, free, rng.randint(1, 30)) for _ in range(20)]

    def step(query_lens=None):
        outs = _step([mirrored, gathered], caches, requests, query_lens or [1] * len(requests),
                     dtype, generator)  # fmt: skip
        assert torch.equal(outs[0], outs[1])
        assert torch.equal(caches[0][0], caches[1][0])

    def widest():
        return max(-(-r.seq_len // BLOCK_SIZE) for r in requests)

    step()
    for _ in range(8):  # 20 decodes (the matmuls in bf16), crossing blocks
        before, rebuilds = widest(), calls["rebuild"]
        step()
        # A steady group only appends, unless its longest context took a block (the
        # mirror is exactly as wide as the step's blocks: then every row is gathered).
        assert calls["rebuild"] == rebuilds + (2 if widest() != before else 0)
    del requests[7]  # a request leaves: the rows after it move up
    step()
    requests.append(Request(rng, free, 0))  # one joins, its prompt a chunk of the step
    step([1] * (len(requests) - 1) + [9])
    step()
    for _ in range(3):  # a prefill chunk beside the decodes
        requests.append(Request(rng, free, 0))
        step([1] * (len(requests) - 1) + [5])
    step([5] * len(requests))  # no decodes at all: the mirror forgets its rows
    step()
    while len(requests) > 3:  # down to SDPA's range, then one decode
        del requests[rng.randrange(len(requests))]
        step()
    del requests[1:]
    for _ in range(5):
        step()
    assert calls["read"] > 0 and calls["rebuild"] < calls["read"]


def _against_gathering(seed: int):
    """(a backend with its mirror, one without, each one's float32 caches (equal), the
    request rng, the tensors' generator, the free block ids)."""
    backend = CpuSdpaBackend(torch.device("cpu"))
    reference = CpuSdpaBackend(torch.device("cpu"))
    reference._mirror = None
    shape = (NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    cache = (torch.randn(shape), torch.randn(shape))
    caches = [cache, (cache[0].clone(), cache[1].clone())]
    generator = torch.Generator().manual_seed(seed)
    return backend, reference, caches, random.Random(seed), generator, list(range(NUM_BLOCKS))


def test_a_mirror_over_its_share_of_the_cache_falls_back_to_gathering(monkeypatch):
    monkeypatch.setattr(decode_mirror, "MAX_FRACTION", 1e-4)
    backend, reference, caches, rng, generator, free = _against_gathering(seed=1)
    requests = [Request(rng, free, 12) for _ in range(4)]
    for _ in range(3):
        outs = _step([backend, reference], caches, requests, [1] * 4, torch.float32, generator)
        assert torch.equal(outs[0], outs[1])
    assert not backend._mirror._buffers


def test_the_mirror_goes_with_the_cache():
    """A worker put to sleep drops its KV cache: the mirror's copies of it go too."""
    backend = CpuSdpaBackend(torch.device("cpu"))
    shape = (NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    caches = [(torch.randn(shape), torch.randn(shape))]
    rng, generator = random.Random(2), torch.Generator().manual_seed(2)
    free = list(range(NUM_BLOCKS))
    requests = [Request(rng, free, 7) for _ in range(3)]
    _step([backend], caches, requests, [1] * 3, torch.float32, generator)
    assert len(backend._mirror._buffers) == 2
    del caches
    gc.collect()
    assert not backend._mirror._buffers


@pytest.mark.parametrize("fits", [True, False])
def test_ragged_decodes_go_as_one_mirrored_group_where_the_mirror_holds_them(monkeypatch, fits):
    """Decodes that ``decode_partition`` splits by length are one group read from the
    mirror once the backend has seen the cache and the mirror fits its share of it."""
    monkeypatch.setattr("pagedlm_cpu.decode_groups.MIN_DECODE_GROUP", 2)
    if not fits:
        monkeypatch.setattr(decode_mirror, "MAX_FRACTION", 1e-4)
    backend, reference, caches, rng, generator, free = _against_gathering(seed=3)
    # Contexts 3 to 60: one call would pad them 5x, so the partition splits them.
    requests = [Request(rng, free, length) for length in [3, 60, 5, 41, 7, 9, 2, 33] * 2]

    def step() -> list[int]:
        """One decode step of both backends; how many decode groups each made."""
        outs = _step([backend, reference], caches, requests, [1] * 16, torch.float32, generator)
        torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)
        return [len(b._last_groups) for b in (backend, reference)]

    groups = []
    real_build = CpuSdpaBackend.build_metadata

    def recording_build(self, layout):
        metadata = real_build(self, layout)
        self._last_groups = metadata.decode_groups
        return metadata

    monkeypatch.setattr(CpuSdpaBackend, "build_metadata", recording_build)
    # The first step's decodes: the backend has not seen the cache yet (no prompt ran).
    groups.append(step())
    for _ in range(4):
        groups.append(step())
    assert all(reference > 1 for _, reference in groups)
    assert groups[0][0] > 1
    if fits:
        assert all(ours == 1 for ours, _ in groups[1:])
        assert backend._last_groups[0].mirror is not None
    else:  # the mirror would exceed its share: the groups stay, gathered
        assert all(ours > 1 for ours, _ in groups)
