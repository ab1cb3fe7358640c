"""Split-K for the batch-1 GGUF GEMVs and the few-row GEMM (``gemm_rows.py``): a row
block's columns shared by several programs.

A GEMV whose weight has few row blocks (llama-3-8b's q/k/v, o and down projections give
512-768 one-warp programs to 132 SMs) leaves too few loads in flight to reach the memory
bandwidth. With ``split_k`` = S each row block's slices go to S programs (``program_id(1)``
is the split); each stores its rows' partial sums in ``partials[split, rows]`` and counts
itself in ``counts[row block]``. The program that counts last adds the S parts in split
order, so the sum does not depend on which program finished last (the result repeats
bitwise), writes the rows, and sets the count back to zero for the next call.

Ordering: a barrier puts every thread's partial store before the count, whose
acquire-release atomic (one thread of the program) publishes them, as a grid-wide barrier
does; the last program reads the parts from L2 (``.cg``). With programmatic dependent
launch the next GEMV touches the counts and parts only after its wait for this one.

The bf16 and FP8 GEMV (``gemv.py``) do not split: their wider programs are not short of
loads in flight, and on an H100 (session 21) every split tile lost to the unsplit one.
The few-row GEMM's sums are [weight rows, x rows] tiles; it passes ``split_sum`` their
flat indices into an ``M * N`` part per split.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

SPLIT_PARTIALS = 4 * 2**20
"""Float32 parts a device's workspace holds (``N * split`` at most; the few-row GEMM's
``M * N * split``): 16 MiB."""
SPLIT_BLOCKS = 65536
"""Row blocks its counts cover (``ceil(N / block_n)`` at most)."""
_workspaces: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}


def split_workspace(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The device's parts (float32) and per-row-block counts (int32, zero between calls).
    One pair per device, made at its first split GEMV."""
    workspace = _workspaces.get(device)
    if workspace is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            # A capture records the zeroing without running it: eager calls would read
            # garbage counts until the graph first replays.
            raise RuntimeError(
                "The split GEMV's workspace is made outside CUDA graph capture: run a split "
                "GEMV once eagerly (the graph runners' warm-up step does) before capturing."
            )
        workspace = (
            torch.empty(SPLIT_PARTIALS, dtype=torch.float32, device=device),
            torch.zeros(SPLIT_BLOCKS, dtype=torch.int32, device=device),
        )
        _workspaces[device] = workspace
    return workspace


def plan_split(
    name: str, n: int, block_n: int, num_slices: int, split_k: int, device: torch.device
) -> tuple[int, int, torch.Tensor | None, torch.Tensor | None]:
    """(splits, slices per split, parts, counts) for ``num_slices`` slices per row block
    asked to split ``split_k`` ways: whole slices per program and no program without one,
    so fewer splits than asked when the slices are few; no workspace when one program
    takes a row block. ValueError (naming ``name``) when the workspace is too small."""
    per_split = triton.cdiv(num_slices, max(split_k, 1))
    splits = triton.cdiv(num_slices, per_split)
    if splits == 1:
        return 1, per_split, None, None
    if n * splits > SPLIT_PARTIALS or triton.cdiv(n, block_n) > SPLIT_BLOCKS:
        raise ValueError(
            f"{name}: split_k={split_k} over {n} rows needs more than the split workspace "
            f"holds ({SPLIT_PARTIALS} parts, {SPLIT_BLOCKS} row blocks)."
        )
    partials, counts = split_workspace(device)
    return splits, per_split, partials, counts


@triton.jit
def split_sum(y, rows, row_mask, partials_ptr, counts_ptr, N, SPLIT: tl.constexpr):
    """Hand in this program's float32 sums ``y`` of ``rows``; returns (whether this program
    finishes the row block, the S parts' sum in split order: valid only then)."""
    block = tl.program_id(0)
    tl.store(partials_ptr + tl.program_id(1) * N + rows, y, mask=row_mask)
    tl.debug_barrier()
    last = tl.atomic_add(counts_ptr + block, 1, sem="acq_rel") == SPLIT - 1
    total = tl.zeros_like(y)
    if last:
        for part in tl.static_range(SPLIT):
            total += tl.load(
                partials_ptr + part * N + rows, mask=row_mask, other=0.0, cache_modifier=".cg"
            )
        tl.store(counts_ptr + block, 0)
    return last, total
