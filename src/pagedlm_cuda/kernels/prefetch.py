"""Weights into the L2 while the kernel before still runs.

Under programmatic dependent launch (``pdl.py``) a GEMV's programs start while the kernel
before it drains, and at batch 1 that kernel (a norm, the attention, a rotary) leaves the
memory bus nearly idle for several microseconds. A program that asks the L2 for the next
part of its weight rows before it waits turns that idle time into bytes its loop then
reads from the L2 rather than from HBM. ``cp.async.bulk.prefetch.L2`` (Hopper) asks for
one contiguous span per instruction; it neither blocks nor writes anything a kernel reads,
so it may come before the wait, and weights never change during a step.

How much to ask for is a budget per weight (``prefetch_columns``): a span the idle time
can fill, and that the L2 holds until the loop reaches it.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

PREFETCH_ENV = "PAGEDLM_GEMV_PREFETCH_MB"
"""For measuring only: megabytes of each batch-1 GEMV's weight asked into the L2 before its
programs wait (0: none); replaces ``DEFAULT_PREFETCH_MB``."""

DEFAULT_PREFETCH_MB = 0.0

_ALIGN = 16
"""``cp.async.bulk`` spans start and end on 16-byte boundaries."""

MIN_SPAN = 256
"""Bytes: smaller spans are not worth an instruction each (a row's share of a large
weight's budget may be a few hundred bytes)."""


def budget_bytes() -> int:
    """The prefetch budget per GEMV launch, in bytes."""
    value = os.environ.get(PREFETCH_ENV)
    megabytes = DEFAULT_PREFETCH_MB if value is None else float(value)
    return int(megabytes * 2**20)


def prefetch_spans(
    rows: int, columns: int, start: int, row_bytes: int, element_size: int, base: int,
    block_rows: int, num_warps: int,
) -> tuple[int, int]:  # fmt: skip
    """(spans per row, columns per span) for a GEMV's prefetch: ``rows`` rows of ``columns``
    (``row_bytes`` apart from address ``base``), from column ``start`` on, ``block_rows`` per
    program of ``num_warps`` warps. The budget is spread over the rows and cut into one span
    per thread, none under ``MIN_SPAN`` bytes, each a whole number of 16-byte units. No
    columns where the spans would not be aligned, under the Triton interpreter (which has
    no inline assembly), or with no budget."""
    if os.environ.get("TRITON_INTERPRET") == "1" or base % _ALIGN or row_bytes % _ALIGN:
        return 1, 0
    if (start * element_size) % _ALIGN:
        return 1, 0
    per_row = min(budget_bytes() // max(rows, 1), (columns - start) * element_size)
    spans = max(1, min(32 * num_warps // block_rows, per_row // MIN_SPAN))
    spans = 1 << (spans.bit_length() - 1)  # a power of two (``tl.arange``)
    per_span = per_row // spans
    return spans, (per_span - per_span % _ALIGN) // element_size


@triton.jit
def prefetch_rows(
    base_ptr, first_row, N, stride, start, BLOCK_N: tl.constexpr, CHUNKS: tl.constexpr,
    CHUNK: tl.constexpr,
):  # fmt: skip
    """Ask the L2 for ``CHUNKS`` spans of ``CHUNK`` elements (16-byte multiples, aligned)
    from column ``start`` of each of rows ``first_row ..`` ``+ BLOCK_N`` of a row-major
    matrix (rows past ``N`` ask for row ``N - 1`` again): one span per thread where the
    program has as many threads. Nothing waits for it, and nothing reads what it returns."""
    if CHUNK > 0:
        index = tl.arange(0, BLOCK_N * CHUNKS)
        rows = tl.minimum(first_row + index // CHUNKS, N - 1)
        pointers = base_ptr + rows.to(tl.int64) * stride + start + (index % CHUNKS) * CHUNK
        nbytes = CHUNK * (base_ptr.dtype.element_ty.primitive_bitwidth // 8)
        sizes = tl.full((BLOCK_N * CHUNKS,), nbytes, tl.int32)
        tl.inline_asm_elementwise(
            "cp.async.bulk.prefetch.L2.global [$1], $2;\n\tmov.u32 $0, 0;", "=r,l,r",
            [pointers.to(tl.int64), sizes], dtype=tl.int32, is_pure=False, pack=1,
        )  # fmt: skip
