"""Programmatic dependent launch (Hopper and later): a kernel's programs may start while
the kernel before it still drains.

Every kernel launched this way first lets the next kernel launch, then waits for the
previous kernel to complete (``griddepcontrol.wait``: its writes are visible afterwards)
before it reads an activation or writes anything. Because every such kernel waits,
completion stays ordered along the whole chain; a kernel launched without it (any torch
kernel, a copy) starts only after everything before it has completed, as usual.

So a read may come before the wait when what it reads was last written before the most
recent torch kernel or copy: weights; the step's metadata and positions (host copies);
the KV cache of earlier steps (each forward begins with the embedding, a torch kernel).
That is how the batch-1 GEMV streams its first weight slice, the rotary kernel fetches
its cos/sin rows and the decode attention its first keys and values while the previous
kernel finishes. Writes always come after the wait.

A decode step at batch 1 is a chain of ~400 short kernels; without this each one starts
only after the last program of the previous one has exited.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch
import triton
import triton.language as tl

PDL_ENV = "PAGEDLM_PDL"
"""Set to 0 to launch every kernel the plain way."""


@functools.cache
def enabled() -> bool:
    """True on a CUDA (not HIP) device of compute capability 9.0+, outside the Triton
    interpreter, unless ``PAGEDLM_PDL=0``."""
    if os.environ.get(PDL_ENV, "1") == "0" or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    if torch.version.hip is not None or not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability() >= (9, 0)


def launch_options() -> dict[str, Any]:
    """Keyword arguments for a kernel launch: its ``USE_PDL`` constexpr, and the launch
    attribute where it applies."""
    if enabled():
        return {"USE_PDL": True, "launch_pdl": True}
    return {"USE_PDL": False}


@triton.jit
def allow_next(USE_PDL: tl.constexpr):
    """Let the next kernel's programs launch (they wait for this one before reading)."""
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def wait_for_previous(USE_PDL: tl.constexpr):
    """Block until the previous kernel has completed and its writes are visible."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()


@triton.jit
def start(USE_PDL: tl.constexpr):
    """The prologue of a kernel that reads activations from its first instruction."""
    allow_next(USE_PDL)
    wait_for_previous(USE_PDL)
