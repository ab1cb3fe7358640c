"""Host values to a device tensor without making the host wait for the device.

A copy from pageable host memory to a GPU first waits for every kernel already queued on
the stream. Under asynchronous scheduling the engine builds a step's sampling tensors while
the step's forward (and the previous step) still run, so one such copy would stall the host
until they finish. A pinned source lets the copy queue behind those kernels instead
(torch keeps the pinned block alive until the copy has run).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def to_device(values: Sequence, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.tensor(values, dtype=dtype)`` on ``device``, copied asynchronously."""
    return tensor_to_device(torch.tensor(values, dtype=dtype), device)


def tensor_to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device``, copied asynchronously through pinned memory."""
    if device.type == "cpu":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def arrays_to_device(arrays: Sequence[np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """Host integer arrays as int64 tensors on ``device`` through one copy: views of one
    buffer, in order (a step's index arrays, which would otherwise cost a pinned
    allocation and a copy each)."""
    flat = [np.asarray(a, dtype=np.int64).reshape(-1) for a in arrays]
    joined = np.concatenate(flat) if flat else np.empty(0, dtype=np.int64)
    return list(
        torch.split(tensor_to_device(torch.from_numpy(joined), device), [len(a) for a in flat])
    )
