"""The step gather kernel (``gather_step_inputs``) against ``gather_on_device``'s torch ops
(the conformance kit's check): tokens over two programs, a padding row, block tables
wider than the kernel's loop step, and nothing written past the step."""

from __future__ import annotations

import pytest
import torch
from triton_env import DEVICE

from pagedlm.testing import ConformanceFailure
from pagedlm.testing.platform_checks import check_step_gatherer
from pagedlm_cuda.kernels.step_gather import BLOCK_T, BLOCK_W, gather_step_inputs


def test_gather_step_inputs_matches_the_torch_ops() -> None:
    assert BLOCK_T < 300 and BLOCK_W < 600  # the check spans two programs and two loops
    check_step_gatherer(gather_step_inputs, DEVICE)


def test_the_check_fails_a_gatherer_that_forgets_the_offsets() -> None:
    def offsetless(**buffers) -> None:
        gather_step_inputs(**buffers)
        buffers["slot_mapping"].sub_(buffers["block_offset"])

    with pytest.raises(ConformanceFailure, match="slot_mapping"):
        check_step_gatherer(offsetless, DEVICE)


def test_the_check_fails_a_gatherer_that_writes_past_the_step() -> None:
    def overreaching(**buffers) -> None:
        gather_step_inputs(**buffers)
        row_tables = buffers["row_tables"]
        torch.as_strided(row_tables, (1,), (1,), row_tables.numel()).fill_(0)

    with pytest.raises(ConformanceFailure, match="row_tables"):
        check_step_gatherer(overreaching, DEVICE)
