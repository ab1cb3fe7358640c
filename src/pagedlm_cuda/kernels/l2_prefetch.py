"""Weights asked into the L2 cache ahead of their reads (Hopper's bulk prefetch).

At batch 1 a decode step is a chain of short kernels, and only the GEMVs stream much
memory: while the attention, the norms and the activation run (~0.4 ms of llama-3-8b's
~4 ms step), and while a short GEMV ramps up and drains, the memory bus idles. With
programmatic dependent launch (``pdl.py``) a GEMV's programs start before the kernel
ahead of them has finished, and until now read only their first slice of weights before
waiting (as many bytes as their registers hold). A ``cp.async.bulk.prefetch.L2`` asks the
memory system for up to 1 MB per instruction without holding a register or shared-memory
byte: a program issues one per row for the bytes that follow its first slice, then waits,
and its loop finds those bytes in L2 (or on their way there). Weights never change, so
this may come before the wait like the first slice. It changes no value and no order of
arithmetic: results are bitwise the same with or without it.

How much to prefetch per row (``row_bytes``): the resident programs' prefetched bytes
must fit the L2 (50 MB on the H100 and H200) next to what the other kernels use, so it is
capped per row; ``PAGEDLM_GEMV_L2_PREFETCH=BYTES`` sets the cap for measuring
(0: off). Only on CUDA devices of compute capability 9.0 and later, outside the Triton
interpreter (which has no inline assembly).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

L2_PREFETCH_ENV = "PAGEDLM_GEMV_L2_PREFETCH"
DEFAULT_ROW_BYTES = 0
"""The cap per row when ``L2_PREFETCH_ENV`` is unset: off until measured on the H200
(``docs/performance.md``, session 18)."""
MAX_BYTES = 65535 * 16
"""One bulk prefetch's largest size (its size field counts 16-byte units in 16 bits)."""


@functools.cache
def _cap() -> int:
    """The bytes per row asked for (0 where the device has no bulk prefetch)."""
    if os.environ.get("TRITON_INTERPRET") == "1" or torch.version.hip is not None:
        return 0
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
        return 0
    return int(os.environ.get(L2_PREFETCH_ENV, DEFAULT_ROW_BYTES))


def row_bytes(row_start: int, bytes_left: int, row_stride: int) -> int:
    """How many bytes of each row a GEMV program prefetches: the cap, at most
    ``bytes_left`` (what follows the first slice), rounded down to 16; 0 where the device
    has no bulk prefetch or ``row_start`` (the first prefetched byte of row 0) or
    ``row_stride`` (bytes) is not 16-byte aligned."""
    cap = _cap()
    if cap <= 0 or row_start % 16 or row_stride % 16:
        return 0
    return max(0, min(cap, bytes_left, MAX_BYTES)) // 16 * 16


@triton.jit
def prefetch_rows(first_ptr, row_stride, num_rows, NBYTES: tl.constexpr):
    """Thread ``t`` of the program, for ``t < num_rows``, asks L2 for the ``NBYTES``
    bytes at ``first_ptr + t * row_stride`` (bytes; 16-byte aligned, ``NBYTES`` a
    multiple of 16). Call only with ``NBYTES > 0`` (``row_bytes`` says 0 where the
    instruction does not exist)."""
    tl.inline_asm_elementwise(
        """{
        .reg .pred p;
        .reg .u32 t;
        .reg .u64 a;
        mov.u32 t, %tid.x;
        setp.lt.u32 p, t, $2;
        mul.wide.u32 a, t, $3;
        add.u64 a, a, $1;
        @p cp.async.bulk.prefetch.L2.global [a], $4;
        mov.u32 $0, 0;
        }""",
        "=r,l,r,r,r",
        [first_ptr, num_rows, row_stride, tl.full([], NBYTES, tl.int32)],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )
