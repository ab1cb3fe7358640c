"""Torch tensors as the step protocol's ``TensorData`` and back (no pickling)."""

from __future__ import annotations

import torch

from pagedlm.step.multimodal import TensorData


def to_tensor_data(tensor: torch.Tensor) -> TensorData:
    tensor = tensor.detach().to("cpu").contiguous()
    dtype = str(tensor.dtype).removeprefix("torch.")
    # bytes of the storage as uint8: works for dtypes numpy lacks (bfloat16).
    data = tensor.reshape(-1).view(torch.uint8).numpy().tobytes() if tensor.numel() else b""
    return TensorData(dtype, list(tensor.shape), data)


def from_tensor_data(data: TensorData, device: torch.device | str = "cpu") -> torch.Tensor:
    dtype = getattr(torch, data.dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown tensor dtype {data.dtype!r} in a multimodal feature")
    if not data.data:
        return torch.empty(data.shape, dtype=dtype, device=device)
    flat = torch.frombuffer(bytearray(data.data), dtype=dtype)
    # Not blocking: a copy from pageable host memory is staged before the call returns,
    # and a blocking one would first wait for every kernel queued (the step in flight).
    return flat.reshape(data.shape).to(device, non_blocking=True)
