"""The CPU KV cache's pages are faulted in ahead of the step's writes, and only so far."""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import sys
import time

import pytest
import torch

from pagedlm_cpu import prefault
from pagedlm_cpu.platform import CpuPlatform

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or not prefault.Prefaulter().supported,
    reason="MADV_POPULATE_WRITE and mincore are Linux's",
)


def _resident(tensor: torch.Tensor) -> list[bool]:
    """Per page of ``tensor``'s bytes: whether it is in memory (mincore)."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    nbytes = tensor.numel() * tensor.element_size()
    pages = -(-nbytes // mmap.PAGESIZE)
    vector = (ctypes.c_ubyte * pages)()
    assert libc.mincore(ctypes.c_void_p(tensor.data_ptr()), ctypes.c_size_t(nbytes), vector) == 0
    return [bool(v & 1) for v in vector]


def _settle(prefaulter: prefault.Prefaulter, tensor: torch.Tensor, pages: int) -> list[bool]:
    """Residency once the first ``pages`` are in, or after 10 s."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        resident = _resident(tensor)
        if all(resident[:pages]):
            time.sleep(0.05)  # a chunk past the target would show now
            return _resident(tensor)
        time.sleep(0.01)
    return _resident(tensor)


def test_pages_are_faulted_in_ahead_of_the_writes_and_no_further(monkeypatch) -> None:
    prefaulter = prefault.Prefaulter()
    monkeypatch.setattr(prefault, "PREFAULTER", prefaulter)
    cache = CpuPlatform().zeros((1024, 16, 2, 64), torch.bfloat16)  # 4 MiB, 1,024 pages
    pages = len(_resident(cache))
    ahead = int(pages * prefault.LOOKAHEAD)
    resident = _settle(prefaulter, cache, ahead)
    assert all(resident[:ahead]) and not any(resident[ahead:])  # only the lookahead

    prefaulter.advance([cache.data_ptr()], 0.5)
    resident = _settle(prefaulter, cache, pages // 2 + ahead)
    assert all(resident[: pages // 2 + ahead]) and not any(resident[pages // 2 + ahead :])
    assert not cache.any()  # the pages are zeros: nothing a step reads changed


def test_a_released_cache_is_let_go(monkeypatch) -> None:
    prefaulter = prefault.Prefaulter()
    monkeypatch.setattr(prefault, "PREFAULTER", prefaulter)
    cache = CpuPlatform().zeros((256, 16, 2, 64), torch.bfloat16)
    _settle(prefaulter, cache, 1)
    address = cache.data_ptr()
    del cache
    prefaulter.advance([address], 1.0)  # nothing to fault in: the mapping is gone
    deadline = time.monotonic() + 10
    while prefaulter._regions and time.monotonic() < deadline:
        prefaulter.advance([address], 1.0)
        prefaulter._wake.set()
        time.sleep(0.01)
    assert not prefaulter._regions


def test_the_attention_backend_advances_past_its_writes(monkeypatch) -> None:
    seen: list[float] = []

    class Recorder(prefault.Prefaulter):
        def advance(self, addresses, fraction: float) -> None:
            seen.append((set(addresses), fraction))

    monkeypatch.setattr(prefault, "PREFAULTER", Recorder())
    from pagedlm.attention.backend import BatchLayout
    from pagedlm_cpu.attention import CpuSdpaBackend

    backend = CpuSdpaBackend(torch.device("cpu"))
    backend._cache_slots = 64 * 16  # 64 blocks of 16 slots, as its first forward records
    backend._cache_addresses = {1 << 20, 2 << 20}  # and where its caches start
    layout = BatchLayout.from_lists(
        query_start_loc=[0, 1, 2],
        seq_lens=[5, 40],
        block_tables=[[0], [1, 2, 9]],
        slot_mapping=[4, 9 * 16 + 7],
        block_size=16,
    )
    backend.build_metadata(layout)
    assert seen == [({1 << 20, 2 << 20}, 10 / 64)]  # block 9, the furthest: 10 of 64


def test_one_engines_writes_fault_in_only_its_own_caches(monkeypatch) -> None:
    prefaulter = prefault.Prefaulter()
    monkeypatch.setattr(prefault, "PREFAULTER", prefaulter)
    platform = CpuPlatform()
    busy = platform.zeros((1024, 16, 2, 64), torch.bfloat16)
    idle = platform.zeros((1024, 16, 2, 64), torch.bfloat16)
    pages = len(_resident(busy))
    ahead = int(pages * prefault.LOOKAHEAD)
    prefaulter.advance([busy.data_ptr()], 1.0)
    assert all(_settle(prefaulter, busy, pages))
    resident = _settle(prefaulter, idle, ahead)
    assert all(resident[:ahead]) and not any(resident[ahead:])  # its lookahead only


def test_the_backend_names_the_caches_it_wrote() -> None:
    from pagedlm.attention.backend import BatchLayout
    from pagedlm_cpu.attention import CpuSdpaBackend

    backend = CpuSdpaBackend(torch.device("cpu"))
    key_cache = torch.zeros(8, 16, 1, 32)
    value_cache = torch.zeros(8, 16, 1, 32)
    layout = BatchLayout.from_lists(
        query_start_loc=[0, 3], seq_lens=[3], block_tables=[[2]], slot_mapping=[32, 33, 34],
        block_size=16,
    )  # fmt: skip
    metadata = backend.build_metadata(layout)
    q = torch.randn(3, 2, 32)
    kv = torch.randn(3, 1, 32)
    backend.forward(q, kv, kv, key_cache, value_cache, metadata, 0.1)
    assert backend._cache_addresses == {key_cache.data_ptr(), value_cache.data_ptr()}
