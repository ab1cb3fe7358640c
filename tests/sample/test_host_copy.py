"""Host arrays to the device through one copy (``host_copy.arrays_to_device``)."""

from __future__ import annotations

import numpy as np
import torch

from pagedlm.sample.host_copy import arrays_to_device


def test_arrays_come_back_in_order_as_int64_views_of_one_buffer() -> None:
    parts = [np.array([3, 1], dtype=np.int32), np.array([], dtype=np.int64), [7, 8, 9]]
    out = arrays_to_device(parts, torch.device("cpu"))
    assert [t.tolist() for t in out] == [[3, 1], [], [7, 8, 9]]
    assert all(t.dtype == torch.int64 for t in out)
    assert out[0].untyped_storage().data_ptr() == out[2].untyped_storage().data_ptr()
    assert arrays_to_device([], torch.device("cpu")) == []
