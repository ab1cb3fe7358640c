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

    prefaulter.advance(0.5)
    resident = _settle(prefaulter, cache, pages // 2 + ahead)
    assert all(resident[: pages // 2 + ahead]) and not any(resident[pages // 2 + ahead :])
    assert not cache.any()  # the pages are zeros: nothing a step reads changed


def test_a_released_cache_is_let_go(monkeypatch) -> None:
    prefaulter = prefault.Prefaulter()
    monkeypatch.setattr(prefault, "PREFAULTER", prefaulter)
    cache = CpuPlatform().zeros((256, 16, 2, 64), torch.bfloat16)
    _settle(prefaulter, cache, 1)
    del cache
    prefaulter.advance(1.0)  # nothing to fault in: the mapping is gone
    deadline = time.monotonic() + 10
    while prefaulter._regions and time.monotonic() < deadline:
        prefaulter.advance(1.0)
        time.sleep(0.01)
    assert not prefaulter._regions


def test_the_attention_backend_advances_past_its_writes(monkeypatch) -> None:
    seen: list[float] = []

    class Recorder(prefault.Prefaulter):
        def advance(self, fraction: float) -> None:
            seen.append(fraction)

    monkeypatch.setattr(prefault, "PREFAULTER", Recorder())
    from pagedlm.attention.backend import BatchLayout
    from pagedlm_cpu.attention import CpuSdpaBackend

    backend = CpuSdpaBackend(torch.device("cpu"))
    backend._cache_slots = 64 * 16  # 64 blocks of 16 slots, as its first forward records
    layout = BatchLayout.from_lists(
        query_start_loc=[0, 1, 2],
        seq_lens=[5, 40],
        block_tables=[[0], [1, 2, 9]],
        slot_mapping=[4, 9 * 16 + 7],
        block_size=16,
    )
    backend.build_metadata(layout)
    assert seen == [10 / 64]  # block 9 is the furthest written: 10 of 64 blocks
