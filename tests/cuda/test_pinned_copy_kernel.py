"""The pinned copy kernel (``pinned_copy``) against the conformance kit's check, both ways
between pinned host memory and the device (plain host tensors under the interpreter), and
the check failing a copy that drops the last bytes."""

from __future__ import annotations

import pytest
import torch
from triton_env import DEVICE

from pagedlm.testing import ConformanceFailure
from pagedlm.testing.platform_checks import check_pinned_copy
from pagedlm_cuda.kernels.pinned_copy import BLOCK, pinned_copy


def test_pinned_copy_passes_the_check() -> None:
    assert BLOCK < 3001 * 2  # the check's int64 case (as words) spans several programs
    check_pinned_copy(pinned_copy, DEVICE)


def test_the_check_fails_a_copy_that_drops_the_last_element() -> None:
    def short(dst: torch.Tensor, src: torch.Tensor) -> None:
        if src.numel() > 1:
            pinned_copy(dst[:-1], src[:-1])

    with pytest.raises(ConformanceFailure, match="pinned_copy"):
        check_pinned_copy(short, DEVICE)


def test_mismatched_tensors_are_refused() -> None:
    with pytest.raises(ValueError, match="same dtype and size"):
        pinned_copy(torch.zeros(3, dtype=torch.int32), torch.zeros(4, dtype=torch.int32))
    with pytest.raises(ValueError, match="contiguous"):
        pinned_copy(torch.zeros(3, dtype=torch.int32), torch.zeros(6, dtype=torch.int32)[::2])
