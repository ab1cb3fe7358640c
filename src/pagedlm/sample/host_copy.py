"""Host values to a device tensor without making the host wait for the device.

A copy from pageable host memory to a GPU first waits for every kernel already queued on
the stream. The engine queues a multi-step window while the previous one still runs, so
one such copy while building the window's sampling tensors would stall the host for the
whole previous window. A pinned source lets the copy queue behind those kernels instead
(torch keeps the pinned block alive until the copy has run).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def to_device(values: Sequence, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.tensor(values, dtype=dtype)`` on ``device``, copied asynchronously."""
    host = torch.tensor(values, dtype=dtype)
    if device.type == "cpu":
        return host
    return host.pin_memory().to(device, non_blocking=True)
