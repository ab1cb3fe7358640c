"""A one-row linear layer and its LoRA delta in one launch: ``out = x W^T + b + B (A x)``.

At batch 1 the separate shrink and expand (``lora.py``) cost two launches per projection
(22 us per Llama-3-8B layer on the H200, mostly launch and dependency latency: the bytes
are 1-2% of the projection's). Here the base layer's GEMV does the delta too. Its programs
(one per ``BLOCK_N`` output rows, the tiles of ``gemv.py``) also do the shrink's work items
(an ``A`` tile of ``SHRINK_N`` rows x ``SHRINK_K`` features each) and add ``B y`` in the
epilogue, so the delta rides on a kernel that streams the whole weight anyway.

The work items are handed out by a claim counter, after the PDL wait: every program first
claims until the claim falls past the last item (so each call makes exactly ``items +
programs`` claims), doing each item it draws: it stores its partial sum, then takes a
ticket from a done counter; the holder of the last ticket sums the partials in a fixed
order into ``y`` and publishes the call's epoch in a ready counter. After its own rows'
dot products a program waits (spins) for that epoch before it reads ``y``. A program that
waits has drawn a claim past the last item, so every item was drawn before, by a program
that is running and waits for nothing after drawing it: the wait always ends, whatever the
number of programs resident or the order they start in (and in the sequential interpreter,
where the first program draws every item).

The counters only grow (int64): a call's epoch is its first claim // (items + programs),
so they need no reset and a CUDA graph replays them. Each call site (layer) has its own
(``FusedScratch``), and its calls never overlap: a program claims only after the PDL wait,
when every earlier kernel, an earlier call of the layer included, has completed.

Registers are capped at about the GEMV's own count (``REGISTER_LIMITS``) so that as many
programs stream the weight per SM as in ``gemv``.

Measured on the H200 (bf16, Llama-3-8B shapes, rank 16, 8 slots; ``python
tests/cuda/bench_lora_kernels.py``: CUDA graphs of 16 calls, weights rotated past the L2),
the delta's cost over the plain GEMV at batch 1, this kernel against the GEMV followed by
shrink + expand:

| projection | GEMV alone | fused | two launches | fused, slot -1 | fused, registers uncapped |
| --- | --- | --- | --- | --- | --- |
| qkv 4096 -> 6144 | 12.7 us | +3.1 | +11.3 | +1.4 | +4.9 |
| o 4096 -> 4096 | 8.7 | +2.8 | +3.2 | +1.7 | +4.1 |
| gate_up 4096 -> 28672 | 53.2 | +2.1 | +4.2 | +0.8 | +6.6 |
| down 14336 -> 4096 | 27.1 | +2.0 | +5.0 | +1.0 | +6.5 |

10.0 us per layer against 23.7. End to end (``python -m pagedlm.benchmarks.lora``, a
shortened run: 64 output tokens, one timed iteration, 64 sequences at most) batch 1 with
one adapter went to 236.0 tok/s against 247.7 without LoRA (95.3%; 86.5% before).

Results: a token without an adapter (slot -1) gets the bits of ``gemv``; with one, the base
result is rounded to the output dtype before the delta is added in float32 and rounded
again, as ``gemv`` followed by ``lora_expand`` does (only the delta's summation order
differs from the two-kernel path).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pagedlm.lora.ops import SliceSpec
from pagedlm_cuda.kernels import pdl

MAX_SLICES = 3


@triton.jit
def _shrink_item(
    item, slot, x_ptr, a_ptr, partial_ptr, K, NA, stride_a_slot, stride_a_row, num_splits,
    SHRINK_N: tl.constexpr, SHRINK_K: tl.constexpr,
):  # fmt: skip
    """partial[split, rows] = A[slot, rows, split's features] x[split's features]."""
    row_block = item // num_splits
    split = item % num_splits
    rows = row_block * SHRINK_N + tl.arange(0, SHRINK_N)
    row_mask = rows < NA
    cols = split * SHRINK_K + tl.arange(0, SHRINK_K)
    col_mask = cols < K
    has_adapter = slot >= 0
    a = tl.load(
        a_ptr
        + tl.maximum(slot, 0).to(tl.int64) * stride_a_slot
        + rows[:, None].to(tl.int64) * stride_a_row
        + cols[None, :],
        mask=row_mask[:, None] & col_mask[None, :] & has_adapter,
        other=0.0,
    )
    x = tl.load(x_ptr + cols, mask=col_mask & has_adapter, other=0.0)
    acc = tl.sum(a.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
    tl.store(partial_ptr + split * NA + rows, acc, mask=row_mask & has_adapter)


@triton.jit
def _merge_partials(
    slot, partial_ptr, y_ptr, NA, num_splits, MERGE_S: tl.constexpr, BLOCK_NA: tl.constexpr
):
    """y = the partials summed over the splits, ``MERGE_S`` at a time, in split order."""
    cols = tl.arange(0, BLOCK_NA)
    col_mask = cols < NA
    y = tl.zeros((BLOCK_NA,), dtype=tl.float32)
    if slot >= 0:
        for s0 in range(0, num_splits, MERGE_S):
            splits = s0 + tl.arange(0, MERGE_S)
            part = tl.load(
                partial_ptr + splits[:, None] * NA + cols[None, :],
                mask=(splits < num_splits)[:, None] & col_mask[None, :],
                other=0.0,
                cache_modifier=".cg",
            )
            y += tl.sum(part, axis=0)
        tl.store(y_ptr + cols, y, mask=col_mask)


@triton.jit
def _gemv_lora_kernel(
    x_ptr, w_ptr, bias_ptr, out_ptr, a_ptr, b_ptr, slots_ptr, partial_ptr, y_ptr,
    counters_ptr, N, K, stride_w, NA, R, stride_a_slot, stride_a_row, stride_b_slot,
    stride_b_row, start1, start2, num_splits, num_items,
    HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SHRINK_N: tl.constexpr, SHRINK_K: tl.constexpr, MERGE_S: tl.constexpr,
    BLOCK_NA: tl.constexpr, BLOCK_R: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    pdl.allow_next(USE_PDL)
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    w_rows = w_ptr + rows[:, None].to(tl.int64) * stride_w
    cols = tl.arange(0, BLOCK_K)
    k_mask = cols < K
    # Weights and the slot (a host copy before the forward) are read before the wait.
    w = tl.load(w_rows + cols[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
    slot = tl.load(slots_ptr)
    ranks = tl.arange(0, BLOCK_R)
    rank_mask = ranks < R
    b = tl.load(
        b_ptr
        + tl.maximum(slot, 0).to(tl.int64) * stride_b_slot
        + rows[:, None].to(tl.int64) * stride_b_row
        + ranks[None, :],
        mask=row_mask[:, None] & rank_mask[None, :] & (slot >= 0),
        other=0.0,
    )
    pdl.wait_for_previous(USE_PDL)  # every write below comes after it

    claims_ptr = counters_ptr
    done_ptr = counters_ptr + 1
    ready_ptr = counters_ptr + 2
    per_call = num_items + tl.num_programs(0)
    claim = tl.atomic_add(claims_ptr, 1, sem="relaxed", scope="gpu")
    epoch = claim // per_call
    item = claim - epoch * per_call
    while item < num_items:
        _shrink_item(
            item, slot, x_ptr, a_ptr, partial_ptr, K, NA, stride_a_slot, stride_a_row,
            num_splits, SHRINK_N=SHRINK_N, SHRINK_K=SHRINK_K,
        )  # fmt: skip
        # Every thread's stores land before the ticket (release); the last ticket's
        # holder sees all of them (acquire).
        tl.debug_barrier()
        ticket = tl.atomic_add(done_ptr, 1, sem="acq_rel", scope="gpu")
        if ticket == epoch * num_items + num_items - 1:
            _merge_partials(slot, partial_ptr, y_ptr, NA, num_splits, MERGE_S, BLOCK_NA)
            tl.debug_barrier()
            tl.atomic_add(ready_ptr, 1, sem="release", scope="gpu")
        item = tl.atomic_add(claims_ptr, 1, sem="relaxed", scope="gpu") - epoch * per_call

    # The base rows, as gemv.py computes them.
    x = tl.load(x_ptr + cols, mask=k_mask, other=0.0)
    acc = w.to(tl.float32) * x.to(tl.float32)[None, :]
    for k0 in range(BLOCK_K, K, BLOCK_K):
        k = k0 + cols
        k_mask = k < K
        w = tl.load(w_rows + k[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        x = tl.load(x_ptr + k, mask=k_mask, other=0.0)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    base = tl.sum(acc, axis=1)
    if HAS_BIAS:
        base += tl.load(bias_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)
    result = base.to(out_ptr.dtype.element_ty)
    if slot >= 0:
        ready = tl.atomic_add(ready_ptr, 0, sem="acquire", scope="gpu")
        while ready <= epoch:
            ready = tl.atomic_add(ready_ptr, 0, sem="acquire", scope="gpu")
        # Row r belongs to slice (r >= start1) + (r >= start2) and reads its ranks of y.
        row_slice = (rows >= start1).to(tl.int32) + (rows >= start2).to(tl.int32)
        y = tl.load(
            y_ptr + row_slice[:, None] * R + ranks[None, :],
            mask=row_mask[:, None] & rank_mask[None, :],
            other=0.0,
            cache_modifier=".cg",
        )
        delta = tl.sum(b.to(tl.float32) * y, axis=1)
        result = (result.to(tl.float32) + delta).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + rows, result, mask=row_mask)


GemvConfig = tuple[int, int, int, int]
"""(BLOCK_N, BLOCK_K, num_warps, num_stages)."""


def base_config(n: int) -> GemvConfig:
    """The tiles ``gemv.gemv_config`` gives one row (a base-model token then gets the same
    bits from either kernel; the tests check it)."""
    if n <= 4096:
        return 16, 1024, 8, 4
    if n <= 8192:
        return 16, 512, 8, 4
    return 16, 256, 4, 4


REGISTER_LIMITS = {(1024, 8): 128, (512, 8): 80, (256, 4): 72}
"""(BLOCK_K, num_warps) -> registers per thread: about what ``gemv``'s kernel uses at those
tiles (ptxas for sm_90a, 16-divisible shapes, 16-bit weights and activations: 128, 76,
72). Left alone, the compiler gives this kernel 162 and 108 at 8 warps, which would cut the
programs resident per SM below the GEMV's (2 -> 1, 3 -> 2); at these limits ptxas
reports no spills."""


@dataclass(frozen=True)
class ShrinkPlan:
    """How the shrink of ``A [NA, K]`` is cut into work items: ``row_blocks`` x ``splits``
    tiles of ``shrink_n`` x ``shrink_k`` (by default 8,192 elements with 8 warps, 2,048
    with 4: 32 and 16 per thread, which keep ptxas within ``REGISTER_LIMITS`` unspilled)."""

    shrink_n: int
    shrink_k: int
    row_blocks: int
    splits: int

    @property
    def items(self) -> int:
        return self.row_blocks * self.splits


def shrink_plan(
    num_rows: int, in_features: int, num_warps: int, shrink_k: int | None = None
) -> ShrinkPlan:
    """``shrink_k``: a power of two (default: what fills the tile; tests force small ones
    for many items)."""
    shrink_n = min(64, triton.next_power_of_2(num_rows))
    if shrink_k is None:
        tile = 8192 if num_warps >= 8 else 2048
        shrink_k = min(max(tile // shrink_n, 16), triton.next_power_of_2(in_features))
    return ShrinkPlan(
        shrink_n,
        shrink_k,
        triton.cdiv(num_rows, shrink_n),
        triton.cdiv(in_features, shrink_k),
    )


class FusedScratch:
    """One call site's counters (claims, done tickets, ready epochs; int64, only growing),
    the shrink's partial sums and ``y``. Allocate it outside graph capture."""

    def __init__(
        self,
        num_rows: int,
        in_features: int,
        num_warps: int,
        device: torch.device | str,
        shrink_k: int | None = None,
    ) -> None:
        self.plan = shrink_plan(num_rows, in_features, num_warps, shrink_k)
        self.counters = torch.zeros(3, dtype=torch.int64, device=device)
        self.partials = torch.empty(
            (self.plan.splits, num_rows), dtype=torch.float32, device=device
        )
        self.y = torch.empty(num_rows, dtype=torch.float32, device=device)


def gemv_lora(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    token_slots: torch.Tensor,
    slices: tuple[SliceSpec, ...],
    scratch: FusedScratch,
    limit_registers: bool = True,
) -> torch.Tensor:
    """x [1, K], weight [N, K] (float, unit-stride rows), bias [N] or None, lora_a [L, NA,
    K], lora_b [L, N, R], token_slots [>= 1] int32 (row 0's slot, -1: none), ``slices``
    covering ``[0, N)`` in order -> ``x W^T + b + B[slot] (A[slot] x)`` [1, N] in x's dtype.
    ``scratch``: this call site's, made by ``FusedScratch(NA, K, num_warps)`` with
    ``num_warps`` from ``base_config(N)``. ``limit_registers``: ``REGISTER_LIMITS`` (False:
    the compiler's choice; benchmarks compare)."""
    n, k = weight.shape
    num_rows, rank = lora_a.shape[1], lora_b.shape[2]
    assert x.shape == (1, k) and x.stride(1) == 1 and weight.stride(1) == 1
    assert lora_a.shape[2] == k and lora_a.stride(2) == 1 and lora_b.stride(2) == 1
    assert lora_b.shape[1] == n and num_rows == len(slices) * rank
    assert 1 <= len(slices) <= MAX_SLICES and slices[0].start == 0
    assert sum(s.size for s in slices) == n
    block_n, block_k, num_warps, num_stages = base_config(n)
    plan = scratch.plan
    assert plan.shrink_n == min(64, triton.next_power_of_2(num_rows))
    assert plan.row_blocks * plan.shrink_n >= num_rows and plan.splits * plan.shrink_k >= k
    starts = [s.start for s in slices[1:]] + [n] * (MAX_SLICES - len(slices))
    out = torch.empty((1, n), dtype=x.dtype, device=x.device)
    block_na = triton.next_power_of_2(num_rows)
    limit = REGISTER_LIMITS.get((block_k, num_warps)) if limit_registers else None
    two_bytes = weight.element_size() == 2 and x.element_size() == 2  # what was measured
    extra = {"maxnreg": limit} if limit is not None and two_bytes and x.is_cuda else {}
    merge_s = max(1, min(triton.next_power_of_2(plan.splits), 4096 // block_na))
    _gemv_lora_kernel[(triton.cdiv(n, block_n),)](
        x, weight, bias if bias is not None else weight, out, lora_a, lora_b, token_slots,
        scratch.partials, scratch.y, scratch.counters, n, k, weight.stride(0), num_rows,
        rank, lora_a.stride(0), lora_a.stride(1), lora_b.stride(0), lora_b.stride(1),
        starts[0], starts[1], plan.splits, plan.items,
        HAS_BIAS=bias is not None, BLOCK_N=block_n, BLOCK_K=block_k, SHRINK_N=plan.shrink_n,
        SHRINK_K=plan.shrink_k, MERGE_S=merge_s, BLOCK_NA=block_na,
        BLOCK_R=triton.next_power_of_2(rank), num_warps=num_warps, num_stages=num_stages,
        **pdl.launch_options(), **extra,
    )  # fmt: skip
    return out
