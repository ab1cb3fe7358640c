"""The CUDA platform's exact pinned host buffers (``CudaPlatform.empty_host``): pinned,
taking their own size of host memory (torch's pinned allocator rounds each request up to
a power of two), copied to and from the device without waiting, and unregistered when
collected."""

from __future__ import annotations

import gc

import pytest
import torch

from pagedlm_cuda.platform import CudaPlatform

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

MIB = 2**20


def _rss_mib() -> int:
    with open("/proc/self/status") as status:
        return int(status.read().split("VmRSS:")[1].split()[0]) // 1024


def test_a_buffer_takes_its_own_size_and_copies_both_ways(monkeypatch) -> None:
    from pagedlm_cuda import platform as cuda_platform

    unregistered = []
    real = cuda_platform._unregister_host
    monkeypatch.setattr(
        cuda_platform, "_unregister_host", lambda ptr: (unregistered.append(ptr), real(ptr))
    )
    platform = CudaPlatform()
    torch.zeros(1, device="cuda")  # the CUDA context's own host memory, outside the window
    size = 640 * MIB  # torch's pinned allocator would take 1 GiB for it
    before = _rss_mib()
    buffer = platform.empty_host((size,), torch.uint8)
    buffer.fill_(0)  # touch every page
    grown = _rss_mib() - before
    assert buffer.is_pinned()
    assert 600 <= grown <= 700, grown
    device = torch.arange(size // 2, device="cuda", dtype=torch.int64).to(torch.uint8)
    buffer[: size // 2].copy_(device, non_blocking=True)
    back = torch.empty_like(device)
    back.copy_(buffer[: size // 2], non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(back, device)
    pointer = buffer.data_ptr()
    del buffer
    gc.collect()
    assert unregistered == [pointer]  # the registration is undone with the buffer


def test_an_empty_buffer_needs_no_registration() -> None:
    assert CudaPlatform().empty_host((0, 4), torch.float16).shape == (0, 4)
