"""``stage_fit.launch``: fewer pipeline stages until a kernel's shared memory fits."""

from __future__ import annotations

import pytest
from triton.runtime.errors import OutOfResources

from pagedlm_cuda.kernels import stage_fit


class FakeKernel:
    """Fits at ``fits`` stages or fewer; records every launch's stages."""

    def __init__(self, fits: int, resource: str = "shared memory") -> None:
        self.fits, self.resource, self.launched = fits, resource, []

    def __call__(self, *args, num_stages: int, **kwargs) -> None:
        self.launched.append(num_stages)
        if num_stages > self.fits:
            raise OutOfResources(num_stages * 100_000, 232_448, self.resource)
        assert args == (1, 2) and kwargs == {"BLOCK": 16}


def test_retries_with_fewer_stages_and_remembers_the_count() -> None:
    kernel = FakeKernel(fits=2)
    stage_fit.launch(kernel, ("test", 1), 4, 1, 2, BLOCK=16)
    assert kernel.launched == [4, 3, 2]
    stage_fit.launch(kernel, ("test", 1), 4, 1, 2, BLOCK=16)
    assert kernel.launched == [4, 3, 2, 2]  # launched once, at the count that fit
    other = FakeKernel(fits=4)
    stage_fit.launch(other, ("test", 2), 4, 1, 2, BLOCK=16)
    assert other.launched == [4]  # a key of its own


def test_raises_what_fewer_stages_cannot_fix() -> None:
    with pytest.raises(OutOfResources, match="shared memory"):
        stage_fit.launch(FakeKernel(fits=0), ("test", 3), 3, 1, 2, BLOCK=16)
    registers = FakeKernel(fits=1, resource="registers")
    with pytest.raises(OutOfResources, match="registers"):
        stage_fit.launch(registers, ("test", 4), 3, 1, 2, BLOCK=16)
    assert registers.launched == [3]
