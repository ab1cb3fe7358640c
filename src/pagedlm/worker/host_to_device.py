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
"""

from __future__ import annotations

import numpy as np
import torch


class HostToDevice:
    """A device buffer of ``capacity`` elements and the host arrays that fill it.

    Use: ``values = buffer.host(n)`` (a numpy view of ``n`` elements to write), then
    ``buffer.copy(n)``; ``buffer.device[:n]`` holds the values for kernels queued after.
    ``capacity`` grows on demand (``host`` with a larger ``n``), unless ``fixed``: a
    buffer that captured graphs read must keep its address.
    """

    def __init__(
        self, capacity: int, dtype: torch.dtype, device: torch.device, fixed: bool = False
    ) -> None:
        self.dtype = dtype
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
            source = self._pinned[self._next]
            self.device[:n].copy_(source[:n], non_blocking=True)
            event = torch.Event(device=self.device.device)
            event.record()
            self._events[self._next] = event
            self._next = 1 - self._next
        return self.device[:n]
