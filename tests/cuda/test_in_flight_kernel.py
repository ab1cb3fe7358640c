"""The in-flight correction kernel (``correct_in_flight``) against ``correct_on_device``'s
torch ops (the conformance kit's check): requests with and without rejections or drafts in
flight, a chunk longer than the kernel's loop step, padding tokens left alone."""

from __future__ import annotations

import pytest
from triton_env import DEVICE

from pagedlm.testing import ConformanceFailure
from pagedlm.testing.platform_checks import check_in_flight_corrector
from pagedlm_cuda.kernels.in_flight import BLOCK_T, correct_in_flight


def test_correct_in_flight_matches_the_torch_ops() -> None:
    assert BLOCK_T < 71  # the check's long chunk takes two loop iterations
    check_in_flight_corrector(correct_in_flight, DEVICE)


def test_the_check_fails_a_corrector_that_forgets_the_lengths() -> None:
    def forgetful(**buffers):
        seq_lens = buffers["seq_lens"].clone()
        correct_in_flight(**buffers)
        buffers["seq_lens"].copy_(seq_lens)

    with pytest.raises(ConformanceFailure, match="seq_lens"):
        check_in_flight_corrector(forgetful, DEVICE)
