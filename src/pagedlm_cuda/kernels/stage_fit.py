"""Launching a pipelined kernel with as many stages as the GPU's shared memory holds.

A Triton kernel whose loop loads feed ``tl.dot`` keeps ``num_stages`` copies of its
tiles in shared memory. How many bytes that takes depends on the tiles, on the input's
dtype (float32 x tiles are twice bfloat16's) and on the layout's constexprs (a GGUF layer
with a scale and a minimum per 16 columns pipelines four times the scale tiles of one with
a scale per 32), and how many bytes there are depends on the GPU: 227 KB per block on an
H100, 163 KB on an A100, 99 KB on most consumer cards. A configuration tuned on one
therefore fails on another with Triton's ``OutOfResources`` at its first launch, before
anything runs. ``launch`` retries with one stage fewer until the kernel fits, and
remembers the count per key, so later calls launch once.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

from triton.runtime.errors import OutOfResources

_FITTING: dict[tuple[Hashable, int], int] = {}
"""(key, stages asked) -> the most stages, at most those, that fit, once found."""


def launch(
    kernel: Callable[..., Any], key: Hashable, num_stages: int, *args: Any, **kwargs: Any
) -> None:
    """``kernel(*args, num_stages=s, **kwargs)`` for the largest ``s <= num_stages`` whose
    shared memory fits (a shortage of anything else, or of shared memory at one stage,
    raises). ``key`` names everything the bytes depend on besides the stages
    (constexprs, tiles, dtypes, device)."""
    stages = min(num_stages, _FITTING.get((key, num_stages), num_stages))
    while True:
        try:
            kernel(*args, num_stages=stages, **kwargs)
        except OutOfResources as error:
            if stages <= 1 or error.name != "shared memory":
                raise
            stages -= 1
            continue
        _FITTING[key, num_stages] = stages
        return
