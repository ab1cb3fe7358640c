"""Multi-LoRA shrink and expand over a step's tokens (Punica's BGMV, in Triton).

``lora_shrink``: ``y[t] = A[slot[t]] x[t]``, as ``num_splits`` float32 partial sums over
slices of the input features ([num_splits, T, num_slices * max_rank]);
``lora_expand``: ``out[t, slice cols] += B[slot[t], slice cols] y[t, slice's ranks]``, summing
the partials as it reads them. One launch each per projection covers the whole batch, every
adapter and every slice (q, k and v of a fused layer are the grid's third axis). A token
whose slot is -1 (base model, padding row) returns at once, so base-model rows of ``out``
are never touched. A one-row step's layers behind the Triton GEMV skip both:
``TritonLoRAOps`` runs them through ``lora_fused.gemv_lora`` (base and delta in one launch).

Why the split: ``A`` is a few dozen rows of thousands of features. A program per token
walking all of them is one SM reading serially, and its latency (tens of microseconds at
8B shapes, the same at batch 1 and 64) was the whole cost of the projection's delta. Each
program now reads at most ``SPLIT_K`` features, so a token's rows are read by
``K / SPLIT_K`` SMs at once; the partials are summed in a fixed order in ``lora_expand``
(no atomics: the result does not depend on scheduling).

The kernels read the slots from the model runner's fixed-address ``token_slots`` buffer and
nothing host-side, so a CUDA graph captured over them replays any later step's adapter mix.
Tokens of the same adapter in a step share its rows through the L2 cache.

Both launch with programmatic dependent launch (``pdl.py``): a program first lets the next
kernel launch, then reads its token's slot (written by a host copy before the forward) and
its first tile of the adapter's weights (A for the shrink; B, most of what an expand program
reads) while the kernel before it drains, and only after ``wait_for_previous`` reads the
activations, the partials and ``out``, and writes. A program of a base-model token waits
too before it returns: a kernel whose programs could all exit without waiting might
complete before its predecessor, and the next kernel, which waits only for this one, would
read that predecessor's output too early.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from pagedlm.lora.ops import LoRAStepState, SliceSpec
from pagedlm_cuda.fused_layers import SingleRowLinear
from pagedlm_cuda.kernels import pdl
from pagedlm_cuda.kernels.lora_fused import FusedScratch, base_config, gemv_lora

if TYPE_CHECKING:
    from pagedlm.model_executor.layers.linear_base import LinearBase, LinearKernel

logger = logging.getLogger(__name__)

FUSED_ENV = "PAGEDLM_LORA_FUSED"
"""Set to 0 to run one-row LoRA layers through the base GEMV and two launches, as larger
batches run."""

MAX_SLICES = 3


@triton.jit
def _shrink_kernel(
    x_ptr, a_ptr, slots_ptr, y_ptr, K, N, stride_x, stride_a_slot, stride_a_row,
    stride_y_split, stride_y, SPLIT_K: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    pdl.allow_next(USE_PDL)
    token = tl.program_id(0)
    slot = tl.load(slots_ptr + token)  # a host copy before the forward: before the wait
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    split = tl.program_id(2)
    a_rows = (
        a_ptr
        + tl.maximum(slot, 0).to(tl.int64) * stride_a_slot
        + rows[:, None].to(tl.int64) * stride_a_row
    )
    cols = split * SPLIT_K + tl.arange(0, BLOCK_K)
    col_mask = cols < K
    # The adapter's weights: the first tile streams in while the previous kernel drains.
    a = tl.load(
        a_rows + cols[None, :], mask=row_mask[:, None] & col_mask[None, :] & (slot >= 0), other=0.0
    )
    # Every program waits, even one with nothing to do: the kernel then completes only
    # after the previous one has, which keeps the chain's order (pdl.py).
    pdl.wait_for_previous(USE_PDL)
    if slot < 0:
        return
    x_row = x_ptr + token.to(tl.int64) * stride_x
    x = tl.load(x_row + cols, mask=col_mask, other=0.0).to(tl.float32)
    acc = tl.sum(a.to(tl.float32) * x[None, :], axis=1)
    for k0 in range(BLOCK_K, SPLIT_K, BLOCK_K):
        cols = split * SPLIT_K + k0 + tl.arange(0, BLOCK_K)
        col_mask = cols < K
        x = tl.load(x_row + cols, mask=col_mask, other=0.0).to(tl.float32)
        a = tl.load(a_rows + cols[None, :], mask=row_mask[:, None] & col_mask[None, :], other=0.0)
        acc += tl.sum(a.to(tl.float32) * x[None, :], axis=1)
    y_row = y_ptr + split.to(tl.int64) * stride_y_split + token.to(tl.int64) * stride_y
    tl.store(y_row + rows, acc, mask=row_mask)


@triton.jit
def _expand_kernel(
    y_ptr, b_ptr, slots_ptr, out_ptr, R, num_splits, stride_y_split, stride_y, stride_b_slot,
    stride_b_row, stride_out, start0, start1, start2, size0, size1, size2,
    BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    pdl.allow_next(USE_PDL)
    token = tl.program_id(0)
    slot = tl.load(slots_ptr + token)  # a host copy before the forward: before the wait
    s = tl.program_id(2)
    start = tl.where(s == 0, start0, tl.where(s == 1, start1, start2))
    size = tl.where(s == 0, size0, tl.where(s == 1, size1, size2))
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < size
    ranks = tl.arange(0, BLOCK_R)
    rank_mask = ranks < R
    b_rows = (
        b_ptr
        + tl.maximum(slot, 0).to(tl.int64) * stride_b_slot
        + (start + cols)[:, None].to(tl.int64) * stride_b_row
    )
    # B's tile is the bulk of what the program reads, and a weight: read before the wait.
    b = tl.load(
        b_rows + ranks[None, :],
        mask=col_mask[:, None] & rank_mask[None, :] & (slot >= 0),
        other=0.0,
    )
    pdl.wait_for_previous(USE_PDL)  # every program, as in the shrink (the chain's order)
    if slot < 0:
        return
    y_row = y_ptr + token.to(tl.int64) * stride_y + s * R + ranks
    y = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for split in range(0, num_splits):
        y += tl.load(y_row + split * stride_y_split, mask=rank_mask, other=0.0)
    delta = tl.sum(b.to(tl.float32) * y[None, :], axis=1)
    out_cols = out_ptr + token.to(tl.int64) * stride_out + start + cols
    current = tl.load(out_cols, mask=col_mask, other=0.0)
    tl.store(out_cols, (current.to(tl.float32) + delta).to(current.dtype), mask=col_mask)


def shrink_split(in_features: int) -> int:
    """Input features per shrink program: 512 (four 128-wide tiles) keeps every program's
    loop short while the partials stay few (8 for a 4096-wide input, 28 for 14336)."""
    return 512 if in_features > 512 else triton.next_power_of_2(max(in_features, 16))


def lora_shrink(
    x: torch.Tensor, lora_a: torch.Tensor, token_slots: torch.Tensor, split_k: int | None = None
) -> torch.Tensor:
    """x [T, K], lora_a [L, N, K], token_slots [T] int32 -> partial sums y
    [cdiv(K, split_k), T, N] float32 whose sum over the first axis is ``A[slot] x`` (rows of
    tokens with slot -1 are left unwritten). ``split_k``: a power of two >= 16 (default
    ``shrink_split(K)``)."""
    num_tokens, k = x.shape
    n = lora_a.shape[1]
    assert x.stride(1) == 1 and lora_a.stride(2) == 1 and lora_a.shape[2] == k
    split_k = shrink_split(k) if split_k is None else split_k
    block_n = min(64, triton.next_power_of_2(n))
    # The widest tile of at most 8,192 elements: a rank-16 slice's whole split is one
    # tile, so all of its weights are read before the PDL wait.
    block_k = min(split_k, max(128, 8192 // block_n))
    assert split_k % block_k == 0
    num_splits = triton.cdiv(k, split_k)
    y = torch.empty((num_splits, num_tokens, n), dtype=torch.float32, device=x.device)
    grid = (num_tokens, triton.cdiv(n, block_n), num_splits)
    _shrink_kernel[grid](
        x, lora_a, token_slots, y, k, n, x.stride(0), lora_a.stride(0), lora_a.stride(1),
        y.stride(0), y.stride(1), SPLIT_K=split_k, BLOCK_N=block_n, BLOCK_K=block_k, **pdl.launch_options(),
    )  # fmt: skip
    return y


def lora_expand(
    out: torch.Tensor,
    y: torch.Tensor,
    lora_b: torch.Tensor,
    token_slots: torch.Tensor,
    slices: tuple[SliceSpec, ...],
) -> None:
    """out [T, N] += per slice ``B[slot, slice cols] y[:, slice ranks]`` in place;
    lora_b [L, N, R], y: ``lora_shrink``'s partials [splits, T, len(slices) * R]."""
    if not 1 <= len(slices) <= MAX_SLICES:
        raise ValueError(f"lora_expand takes 1 to {MAX_SLICES} slices, got {len(slices)}")
    num_tokens = out.shape[0]
    rank = lora_b.shape[2]
    assert out.stride(1) == 1 and lora_b.stride(2) == 1 and y.shape[2] == len(slices) * rank
    padded = list(slices) + [SliceSpec(0, 0)] * (MAX_SLICES - len(slices))
    block_n = 128
    grid = (num_tokens, triton.cdiv(max(s.size for s in slices), block_n), len(slices))
    _expand_kernel[grid](
        y, lora_b, token_slots, out, rank, y.shape[0], y.stride(0), y.stride(1),
        lora_b.stride(0), lora_b.stride(1), out.stride(0), *(s.start for s in padded), *(s.size for s in padded),
        BLOCK_N=block_n, BLOCK_R=triton.next_power_of_2(rank), **pdl.launch_options(),
    )  # fmt: skip


class TritonLoRAOps:
    """``LoRAOps`` for CUDA/ROCm, CUDA-graph safe. A one-row input of a layer whose base
    kernel is the Triton GEMV (``SingleRowLinear``) runs base and delta in one launch
    (``lora_fused.gemv_lora``; at batch 1 the separate kernels' launches were the delta's
    whole cost); every other batch the base kernel, then two launches (shrink, expand).
    ``split_k``: the shrink's features per program (None: ``shrink_split``; tests force
    small ones so that several partials are summed). ``fuse_single_row=False`` (default:
    unless ``PAGEDLM_LORA_FUSED=0``) keeps the two-launch path at one row too (benchmarks
    compare them)."""

    graph_safe = True

    def __init__(self, split_k: int | None = None, fuse_single_row: bool | None = None) -> None:
        self.split_k = split_k
        if fuse_single_row is None:
            fuse_single_row = os.environ.get(FUSED_ENV, "1") != "0"
        self.fuse_single_row = fuse_single_row
        self._scratch: dict[tuple, FusedScratch] = {}
        self._warned = False

    def add_lora(
        self,
        out: torch.Tensor,
        x: torch.Tensor,
        lora_a: torch.Tensor,
        lora_b: torch.Tensor,
        slices: tuple[SliceSpec, ...],
        state: LoRAStepState,
        active_slots: list[bool],
    ) -> None:
        token_slots = state.token_slots[: x.shape[0]]
        shrunk = lora_shrink(x, lora_a, token_slots, self.split_k)
        lora_expand(out, shrunk, lora_b, token_slots, slices)

    def linear_with_lora(
        self,
        layer: LinearBase,
        base_kernel: LinearKernel | None,
        x: torch.Tensor,
        lora_a: torch.Tensor,
        lora_b: torch.Tensor,
        slices: tuple[SliceSpec, ...],
        state: LoRAStepState,
    ) -> torch.Tensor | None:
        if x.shape[0] != 1 or not self.fuse_single_row:
            return None
        weight = layer.weight
        fusable = (
            isinstance(base_kernel, SingleRowLinear)
            and x.dim() == 2
            and x.stride(1) == 1
            and weight.dim() == 2
            and weight.stride(1) == 1
            and weight.dtype in (torch.float16, torch.bfloat16, torch.float32)
            and len(slices) <= MAX_SLICES
            and lora_b.shape[1] == weight.shape[0]
        )
        if not fusable:
            return None
        scratch = self.fused_scratch(lora_a, weight.shape[0])
        if scratch is None:
            return None
        return gemv_lora(
            x, weight, layer.linear_bias, lora_a, lora_b, state.token_slots, slices, scratch
        )

    def fused_scratch(self, lora_a: torch.Tensor, out_features: int) -> FusedScratch | None:
        """The call site's scratch (keyed by its slots' buffer). Made on the call site's
        first one-row call, which the graph runners make eagerly before capturing; None
        (the two-launch path) if that first call is being captured."""
        num_warps = base_config(out_features)[2]
        key = (lora_a.data_ptr(), lora_a.shape[1], lora_a.shape[2], num_warps)
        scratch = self._scratch.get(key)
        if scratch is None:
            if lora_a.is_cuda and torch.cuda.is_current_stream_capturing():
                if not self._warned:
                    self._warned = True
                    logger.warning(
                        "LoRA: a one-row layer was first called under CUDA-graph capture; "
                        "it takes the two-launch path in that graph (run each size once "
                        "eagerly before capturing it, as the graph runners do)"
                    )
                return None
            scratch = FusedScratch(lora_a.shape[1], lora_a.shape[2], num_warps, lora_a.device)
            self._scratch[key] = scratch
        return scratch
