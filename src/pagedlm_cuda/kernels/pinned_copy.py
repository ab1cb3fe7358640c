"""Copies between pinned host memory and the device by a kernel, not the copy engine.

A decode step at batch 1 moves a few hundred bytes each way: the sampled ids to the host,
the next step's layout and gather indices to the device. Queued as ``copy_`` on the
compute stream, each such copy goes to a copy engine, which starts only after the kernel
before it completes, and the kernel after it starts only after the copy completes: on
W2's H200 timeline (session 26) the sampled ids' copy and the next step's two input
copies spanned 22-31 us between the last kernel before them and the first after, for
about 5 us of transfers.

Pinned memory is mapped into the device's address space (unified addressing), so a
kernel reads and writes it directly over PCIe; on the compute stream it queues like any
other kernel. Each program copies ``BLOCK`` 32-bit words (bytes where a tensor's size or
address is not a multiple of four), so one launch moves a step's inputs whatever their
size. Ordering is the stream's: the copy starts after every kernel queued before it has
completed and the kernels after it see its writes, as with ``copy_`` (the kernel is
launched without programmatic dependent launch).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024
"""32-bit words per program."""

MAX_KERNEL_BYTES = 64 * 1024
"""Larger copies (a long prefill's gather indices) go to the copy engine (``copy_``): a
kernel's reads over PCIe are bound by the requests it keeps in flight, the engine's DMA
is not. A guess, not measured: a decode step's copies are a few hundred bytes to a few
kB, far from it either way."""


# The length and the addresses change every step: no specialization on them, so no new
# length or offset compiles a kernel mid-run (a warp's 32-bit words still coalesce).
@triton.jit(do_not_specialize=["n"], do_not_specialize_on_alignment=["src_ptr", "dst_ptr"])
def _copy_kernel(src_ptr, dst_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    tl.store(dst_ptr + offsets, tl.load(src_ptr + offsets, mask=mask), mask=mask)


def _words(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s bytes as 32-bit words where they can be, else as bytes."""
    flat = tensor.reshape(-1).view(torch.uint8)
    if flat.numel() % 4 == 0 and flat.data_ptr() % 4 == 0:
        return flat.view(torch.int32)
    return flat


def pinned_copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Queue ``dst.copy_(src)`` on the current stream, where each of them is on the device
    or in pinned host memory (``pagedlm.worker.host_to_device.PinnedCopy``): same dtype
    and number of elements, both contiguous. Returns at once; the caller keeps both alive
    until the copy is done (an event recorded after it). Up to ``MAX_KERNEL_BYTES`` by
    the kernel, larger ones by ``copy_``."""
    if dst.dtype != src.dtype or dst.numel() != src.numel():
        raise ValueError(
            f"pinned_copy needs the same dtype and size, got {dst.dtype} x {dst.numel()} "
            f"and {src.dtype} x {src.numel()}."
        )
    if not (dst.is_contiguous() and src.is_contiguous()):
        raise ValueError("pinned_copy needs contiguous tensors.")
    if src.numel() == 0:
        return
    if src.numel() * src.element_size() > MAX_KERNEL_BYTES:
        dst.copy_(src, non_blocking=True)
        return
    src_words, dst_words = _words(src), _words(dst)
    if src_words.dtype != dst_words.dtype:  # one of them is not word-aligned
        src_words = src.reshape(-1).view(torch.uint8)
        dst_words = dst.reshape(-1).view(torch.uint8)
    n = src_words.numel()
    _copy_kernel[(triton.cdiv(n, BLOCK),)](src_words, dst_words, n, BLOCK=BLOCK)
