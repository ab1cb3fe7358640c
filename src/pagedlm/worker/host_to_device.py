"""Host arrays copied into persistent device buffers without making the host wait.

A copy from pageable host memory waits for every kernel already queued, so the runner fills
pinned host buffers and queues asynchronous copies instead. Asynchronous scheduling keeps a
step in flight while the host fills the next one's values, so each device buffer has two
pinned host buffers that alternate, each guarded by the event of its last copy: the host
never overwrites values a queued copy has not read yet. The device buffer itself may be
refilled while an earlier step's kernels still wait to read it only because the copy is
queued behind them on the same stream.

Where the device is the host (the CPU platform) the "device" buffer is the host buffer:
nothing is pinned or copied.

A platform may queue these copies its own way (``Platform.pinned_copy``: the CUDA platform
copies by a kernel reading pinned memory, which spares a small copy the copy engine's
hand-offs); the default is ``Tensor.copy_``.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

PinnedCopy = Callable[[torch.Tensor, torch.Tensor], None]
"""``copy(dst, src)``: queue ``dst.copy_(src)`` on the current stream, where one of them is
in pinned host memory and the other on the device (same dtype and size, both
contiguous), without waiting for the device. It is ordered on the stream as ``copy_``
is: after every kernel queued before it, before every kernel queued after it. The caller
keeps both tensors alive, and the host side unchanged, until an event recorded after the
call has completed."""


def queue_copy(copy: PinnedCopy | None, dst: torch.Tensor, src: torch.Tensor) -> None:
    """``copy(dst, src)``, or ``dst.copy_(src, non_blocking=True)`` without one."""
    if copy is None:
        dst.copy_(src, non_blocking=True)
    else:
        copy(dst, src)


class HostToDevice:
    """A device buffer of ``capacity`` elements and the host arrays that fill it.

    Use: ``values = buffer.host(n)`` (a numpy view of ``n`` elements to write), then
    ``buffer.copy(n)``; ``buffer.device[:n]`` holds the values for kernels queued after.
    ``capacity`` grows on demand (``host`` with a larger ``n``), unless ``fixed``: a
    buffer that captured graphs read must keep its address. ``copy``: the platform's
    ``PinnedCopy`` (None: ``Tensor.copy_``).
    """

    def __init__(
        self,
        capacity: int,
        dtype: torch.dtype,
        device: torch.device,
        fixed: bool = False,
        copy: PinnedCopy | None = None,
    ) -> None:
        self.dtype = dtype
        self._copy = copy
        self._device = device
        self.fixed = fixed
        # The CPU is the only device whose memory the host addresses directly.
        self.on_host = device.type == "cpu"
        self._allocate(max(1, capacity))

    def _allocate(self, capacity: int) -> None:
        self.capacity = capacity
        self.device = torch.zeros(capacity, dtype=self.dtype, device=self._device)
        if self.on_host:
            self._pinned = [self.device]
            self._events: list[torch.Event | None] = [None]
        else:
            self._pinned = [
                torch.zeros(capacity, dtype=self.dtype, pin_memory=True) for _ in range(2)
            ]
            self._events = [None, None]
        self._next = 0

    def host(self, n: int) -> np.ndarray:
        """The next host array to fill, ``n`` elements long (waits, if ever, for the copy
        that last read it)."""
        if n > self.capacity:
            if self.fixed:
                raise ValueError(f"{n} values do not fit a fixed device buffer of {self.capacity}")
            self._allocate(max(n, self.capacity * 2))
        event = self._events[self._next]
        if event is not None:
            event.synchronize()
        return self._pinned[self._next].numpy()[:n]

    def copy(self, n: int) -> torch.Tensor:
        """Queue the copy of the array ``host`` returned; returns ``device[:n]``."""
        if not self.on_host:
            queue_copy(self._copy, self.device[:n], self._pinned[self._next][:n])
            event = torch.Event(device=self.device.device)
            event.record()
            self._events[self._next] = event
            self._next = 1 - self._next
        return self.device[:n]
