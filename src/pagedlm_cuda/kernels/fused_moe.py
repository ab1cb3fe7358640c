"""A mixture-of-experts layer's routed experts without a host wait: the routing aligned
into expert blocks on the device, then one grouped GEMM launch per projection.

Alignment (``align_to_blocks``, three small launches, no sort and no atomics): the
``T * top_k`` (token, slot) pairs, numbered ``token * top_k + slot``, grouped by local
expert (in pair order within an expert), each expert's run padded with the sentinel
``T * top_k`` to a multiple of ``block_m``. Every output has a size fixed by ``T``,
``top_k``, the local expert count and ``block_m`` (``block_capacity``), so the work is
the same kernels at the same shapes each step and a CUDA graph can hold it; only their
contents follow the routing. Pairs routed to another rank's experts appear nowhere.

Grouped GEMM (``_grouped_gemm_kernel``): a grid of (row blocks of the capacity) x
(output column tiles). A program reads its block's expert (-1: past the padded total,
it exits), gathers its ``block_m`` rows (sentinel rows masked to zeros and never
stored), streams that expert's weight in ``block_k`` slices and accumulates in float32.
The first launch multiplies token rows by ``w13``, taking each output column's gate row
and the up row it pairs with, and stores ``silu(gate) * up`` rounded as ``silu_and_mul``
does ([pairs, I]); the second multiplies those rows by ``w2``, rounds to the model
dtype, scales by the pair's routing weight and stores [pairs, hidden]. The top-k
contributions of a token are then summed in slot order (``sum`` over [T, top_k,
hidden]), so the result does not depend on the order programs finish.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from pagedlm.model_executor.quantization.fp8 import FP8_DTYPE
from pagedlm_cuda.kernels.activation import silu_times


class ExpertBlocks(NamedTuple):
    """A routing aligned into ``block_m``-row blocks of one local expert each."""

    pair_ids: torch.Tensor
    """int32 [capacity]: pair numbers (``token * top_k + slot``) sorted by local expert,
    each expert's run starting at a multiple of ``block_m``; padding holds ``T * top_k``."""
    block_experts: torch.Tensor
    """int32 [capacity // block_m]: each block's local expert, -1 for blocks past the
    padded total."""
    padded_total: torch.Tensor
    """int32 [1]: rows in use (a multiple of ``block_m``), on the device."""


def block_capacity(num_pairs: int, num_local_experts: int, block_m: int) -> int:
    """Rows the alignment reserves: every pair once, plus at most ``block_m - 1`` padding
    rows for each expert that has a pair (at most ``min(experts, pairs)`` of them),
    rounded up to whole blocks."""
    padded = num_pairs + min(num_local_experts, num_pairs) * (block_m - 1)
    return triton.cdiv(padded, block_m) * block_m


@triton.jit
def _chunk_hits(
    ids_ptr, chunk, num_pairs, expert_start, num_local,
    CHUNK: tl.constexpr, EXPERTS: tl.constexpr,
):  # fmt: skip
    """The pairs of chunk ``chunk`` and which local expert each goes to: int32 [CHUNK,
    EXPERTS], 1 at (pair, its local expert), a row of zeros for another rank's pair."""
    pairs = chunk * CHUNK + tl.arange(0, CHUNK)
    in_range = pairs < num_pairs
    local = tl.load(ids_ptr + pairs, mask=in_range, other=0).to(tl.int32) - expert_start
    experts = tl.arange(0, EXPERTS)
    hit = (local[:, None] == experts[None, :]) & (experts < num_local)[None, :]
    return pairs, (hit & in_range[:, None]).to(tl.int32)


@triton.jit(do_not_specialize=["num_pairs"])
def _count_kernel(
    ids_ptr, chunk_counts_ptr, num_pairs, expert_start, num_local,
    CHUNK: tl.constexpr, EXPERTS: tl.constexpr,
):  # fmt: skip
    chunk = tl.program_id(0)
    _, hit = _chunk_hits(ids_ptr, chunk, num_pairs, expert_start, num_local, CHUNK, EXPERTS)
    tl.store(chunk_counts_ptr + chunk * EXPERTS + tl.arange(0, EXPERTS), tl.sum(hit, axis=0))


@triton.jit(do_not_specialize=["num_chunks", "num_pairs", "capacity"])
def _layout_kernel(
    chunk_counts_ptr, chunk_offsets_ptr, expert_rows_ptr, pair_ids_ptr, block_experts_ptr,
    total_ptr, num_chunks, num_pairs, capacity,
    BLOCK_M: tl.constexpr, EXPERTS: tl.constexpr, CHUNK: tl.constexpr,
):  # fmt: skip
    """One program: each chunk's first row within each expert's run (the counts of the
    chunks before it), each expert's padded first row, the padded total, the padding
    sentinel everywhere and each block's expert."""
    experts = tl.arange(0, EXPERTS)
    counts = tl.zeros((EXPERTS,), dtype=tl.int32)
    for start in range(0, num_chunks, CHUNK):  # CHUNK chunks' counts at a time
        chunks = start + tl.arange(0, CHUNK)
        index = chunks[:, None] * EXPERTS + experts[None, :]
        mask = (chunks < num_chunks)[:, None]
        tile = tl.load(chunk_counts_ptr + index, mask=mask, other=0)
        before = counts[None, :] + tl.cumsum(tile, axis=0) - tile
        tl.store(chunk_offsets_ptr + index, before, mask=mask)
        counts += tl.sum(tile, axis=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    tl.store(expert_rows_ptr + experts, ends - padded)
    total = tl.sum(padded, axis=0)
    tl.store(total_ptr, total)
    for start in range(0, capacity, 1024):
        rows = start + tl.arange(0, 1024)
        tl.store(pair_ids_ptr + rows, num_pairs, mask=rows < capacity)
    num_blocks = capacity // BLOCK_M
    for start in range(0, num_blocks, CHUNK):
        blocks = start + tl.arange(0, CHUNK)
        first_row = blocks * BLOCK_M
        # The expert whose run holds first_row: how many runs end at or before it.
        owner = tl.sum((ends[None, :] <= first_row[:, None]).to(tl.int32), axis=1)
        owner = tl.where(first_row < total, owner, -1)
        tl.store(block_experts_ptr + blocks, owner, mask=blocks < num_blocks)


@triton.jit(do_not_specialize=["num_pairs"])
def _place_kernel(
    ids_ptr, chunk_offsets_ptr, expert_rows_ptr, pair_ids_ptr, num_pairs, expert_start,
    num_local, CHUNK: tl.constexpr, EXPERTS: tl.constexpr,
):  # fmt: skip
    chunk = tl.program_id(0)
    pairs, hit = _chunk_hits(ids_ptr, chunk, num_pairs, expert_start, num_local, CHUNK, EXPERTS)
    experts = tl.arange(0, EXPERTS)
    first = tl.load(expert_rows_ptr + experts) + tl.load(
        chunk_offsets_ptr + chunk * EXPERTS + experts
    )
    earlier = tl.cumsum(hit, axis=0) - hit  # the same expert's pairs before it in the chunk
    rows = tl.sum(hit * (first[None, :] + earlier), axis=1)
    tl.store(pair_ids_ptr + rows, pairs, mask=tl.sum(hit, axis=1) > 0)


def _alignment_tiles(num_local_experts: int) -> tuple[int, int]:
    """(experts padded to a power of two from 16, pairs per chunk): a chunk's one-hot
    table of at most 4096 entries, at least 16 pairs."""
    experts = max(16, triton.next_power_of_2(num_local_experts))
    return experts, max(16, min(256, 4096 // experts))


def align_to_blocks(
    expert_ids: torch.Tensor, expert_start: int, num_local_experts: int, block_m: int
) -> ExpertBlocks:
    """expert_ids [T, top_k] (global ids) -> the pairs of experts ``expert_start ..
    expert_start + num_local_experts - 1`` in ``block_m``-row expert blocks.

    Three launches, none of which the host waits for: each chunk of pairs counts its
    pairs per expert (a program per chunk); one program turns the counts into each
    chunk's offsets, the padded runs and the block owners; each chunk then writes its
    pairs to their rows (an expert's pairs keep their order: chunk offset plus rank
    within the chunk). No atomics, so the layout is the same on every run."""
    ids = expert_ids.reshape(-1)
    num_pairs = ids.numel()
    device = ids.device
    experts, chunk = _alignment_tiles(num_local_experts)
    num_chunks = triton.cdiv(num_pairs, chunk)
    capacity = block_capacity(num_pairs, num_local_experts, block_m)
    int32 = dict(dtype=torch.int32, device=device)
    chunk_counts = torch.empty((num_chunks, experts), **int32)
    chunk_offsets = torch.empty((num_chunks, experts), **int32)
    expert_rows = torch.empty(experts, **int32)
    pair_ids = torch.empty(capacity, **int32)
    block_experts = torch.empty(capacity // block_m, **int32)
    padded_total = torch.empty(1, **int32)
    _count_kernel[(num_chunks,)](
        ids, chunk_counts, num_pairs, expert_start, num_local_experts, CHUNK=chunk,
        EXPERTS=experts,
    )  # fmt: skip
    _layout_kernel[(1,)](
        chunk_counts, chunk_offsets, expert_rows, pair_ids, block_experts, padded_total,
        num_chunks, num_pairs, capacity, BLOCK_M=block_m, EXPERTS=experts, CHUNK=chunk,
    )  # fmt: skip
    _place_kernel[(num_chunks,)](
        ids, chunk_offsets, expert_rows, pair_ids, num_pairs, expert_start,
        num_local_experts, CHUNK=chunk, EXPERTS=experts,
    )  # fmt: skip
    return ExpertBlocks(pair_ids, block_experts, padded_total)


@triton.jit(do_not_specialize=["num_pairs"])
def _grouped_gemm_kernel(
    a_ptr, w_ptr, out_ptr, pair_ids_ptr, block_experts_ptr, weights_ptr, scale_ptr, num_pairs,
    N, K, stride_a, stride_we, stride_wn, stride_out, stride_se,
    PAIRS_PER_A_ROW: tl.constexpr, GATED: tl.constexpr, WEIGHTED: tl.constexpr,
    SCALED: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    block = tl.program_id(0)
    expert = tl.load(block_experts_ptr + block)
    if expert < 0:
        return
    pairs = tl.load(pair_ids_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
    row_mask = pairs < num_pairs
    a_rows = a_ptr + (pairs // PAIRS_PER_A_ROW).to(tl.int64)[:, None] * stride_a
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    w_rows = w_ptr + expert.to(tl.int64) * stride_we + cols[:, None].to(tl.int64) * stride_wn
    up_rows = w_rows + N.to(tl.int64) * stride_wn  # GATED: the up row paired with each gate row
    slice_cols = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up_acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + slice_cols
        k_mask = k < K
        a = tl.load(a_rows + k[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w_mask = col_mask[:, None] & k_mask[None, :]
        w = tl.load(w_rows + k[None, :], mask=w_mask, other=0.0).to(a.dtype)  # E4M3: exact
        acc = tl.dot(a, tl.trans(w), acc, input_precision=PRECISION, out_dtype=tl.float32)
        if GATED:
            up = tl.load(up_rows + k[None, :], mask=w_mask, other=0.0).to(a.dtype)
            up_acc = tl.dot(
                a, tl.trans(up), up_acc, input_precision=PRECISION, out_dtype=tl.float32
            )
    if SCALED:  # FP8 codes: each output column times its row's scale
        scales = scale_ptr + expert.to(tl.int64) * stride_se + cols
        acc = acc * tl.load(scales, mask=col_mask, other=0.0)[None, :]
        if GATED:
            up_acc = up_acc * tl.load(scales + N, mask=col_mask, other=0.0)[None, :]
    dtype = out_ptr.dtype.element_ty
    out = acc.to(dtype)  # rounded as the eager path's matmul output
    if GATED:
        out = silu_times(out, up_acc.to(dtype))
    if WEIGHTED:
        out = out.to(tl.float32) * tl.load(weights_ptr + pairs, mask=row_mask, other=0.0)[:, None]
    out_index = pairs[:, None].to(tl.int64) * stride_out + cols[None, :]
    tl.store(out_ptr + out_index, out.to(dtype), mask=row_mask[:, None] & col_mask[None, :])


class FusedMoEConfig(NamedTuple):
    """Rows per expert block, output columns and weight columns per program's tile, warps
    and pipeline stages."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    stages: int = 3


def fused_moe_config(num_pairs: int, num_local_experts: int, dtype: torch.dtype) -> FusedMoEConfig:
    """The tiles for ``num_pairs`` pairs over ``num_local_experts`` experts: 16-row blocks
    while experts average at most 16 pairs (decode steps: less padding, and each block
    still reads its expert's whole weight), 32 up to 64, 64 beyond. Not tuned on a GPU."""
    per_expert = num_pairs / num_local_experts
    block_m = 16 if per_expert <= 16 else 32 if per_expert <= 64 else 64
    if dtype == torch.float32:
        return FusedMoEConfig(block_m, 64, 32, 4, 2)
    return FusedMoEConfig(block_m, 64, 64, 4, 3)


_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _check(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    expert_ids: torch.Tensor,
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    num_local, two_i, hidden = w13.shape
    if x.dim() != 2 or x.shape[1] != hidden or two_i % 2:
        raise ValueError(
            f"fused_experts needs x [T, hidden] and w13 [experts, 2 * I, hidden]; got x "
            f"{tuple(x.shape)} and w13 {tuple(w13.shape)}."
        )
    if tuple(w2.shape) != (num_local, hidden, two_i // 2):
        raise ValueError(
            f"w2 must be [experts, hidden, I] = {(num_local, hidden, two_i // 2)}; got "
            f"{tuple(w2.shape)}."
        )
    fp8 = w13.dtype == w2.dtype == FP8_DTYPE and x.dtype in (torch.float16, torch.bfloat16)
    if not (fp8 or x.dtype == w13.dtype == w2.dtype) or x.dtype not in _DTYPES:
        raise ValueError(
            f"fused_experts multiplies x, w13 and w2 of one float dtype (float16, bfloat16 "
            f"or float32), or 16-bit x with E4M3 experts; got {x.dtype}, {w13.dtype} and "
            f"{w2.dtype}."
        )
    if fp8 != (scales is not None):
        raise ValueError("E4M3 experts need w13_scale and w2_scale, float ones neither.")
    if scales is not None:
        w13_scale, w2_scale = scales
        if tuple(w13_scale.shape) != (num_local, two_i) or tuple(w2_scale.shape) != (
            num_local,
            hidden,
        ):
            raise ValueError(
                f"w13_scale must be [experts, 2 * I] = {(num_local, two_i)} and w2_scale "
                f"[experts, hidden] = {(num_local, hidden)}; got {tuple(w13_scale.shape)} "
                f"and {tuple(w2_scale.shape)}."
            )
    if expert_ids.dim() != 2 or expert_ids.shape[0] != x.shape[0]:
        raise ValueError(
            f"expert_ids must be [T, top_k] for T={x.shape[0]}; got {tuple(expert_ids.shape)}."
        )
    if weights.shape != expert_ids.shape:
        raise ValueError(
            f"weights must have expert_ids' shape {tuple(expert_ids.shape)}; got "
            f"{tuple(weights.shape)}."
        )
    if w13.stride(2) != 1 or w2.stride(2) != 1:
        raise ValueError("fused_experts needs unit-stride rows in w13 and w2.")


def fused_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    expert_ids: torch.Tensor,
    expert_start: int = 0,
    num_experts: int | None = None,
    config: FusedMoEConfig | None = None,
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    batch_invariant: bool = False,
) -> torch.Tensor:
    """This rank's routed-expert output [T, hidden] in x's dtype: for each token, the sum
    over its slots whose expert is local of ``weight * (silu(x gate^T) * (x up^T)) down^T``.

    x [T, hidden]; w13 [num_local_experts, 2 * I, hidden] (gate rows, then up rows); w2
    [num_local_experts, hidden, I]; weights float32 [T, top_k]; expert_ids [T, top_k]
    (global ids, experts ``expert_start ..`` local). ``num_experts`` (default: the local
    count) only tells whether every expert is local, so every pair's row is written.
    ``scales``: (w13_scale [experts, 2 * I], w2_scale [experts, hidden]) float32 for E4M3
    experts (``FusedMoE.quantize_fp8``): codes widened to x's dtype in registers, each
    product column times its row's scale in float32 before the rounding.
    ``batch_invariant``: one tiling whatever the batch (the smallest row blocks) and each
    token's contributions summed in slot order, so a token's bits do not depend on the
    other tokens of the call (``pagedlm.batch_invariant``)."""
    _check(x, w13, w2, weights, expert_ids, scales)
    num_tokens, top_k = expert_ids.shape
    num_local, two_i, hidden = w13.shape
    inter = two_i // 2
    num_pairs = num_tokens * top_k
    if num_pairs == 0:
        return torch.zeros_like(x)
    cfg = config or fused_moe_config(0 if batch_invariant else num_pairs, num_local, x.dtype)
    blocks = align_to_blocks(expert_ids, expert_start, num_local, cfg.block_m)
    num_blocks = blocks.block_experts.numel()
    x = x if x.stride(1) == 1 else x.contiguous()
    weights = weights.to(torch.float32).contiguous()
    # float32 x: full float32 products (tl.dot would take TF32), as the eager path's.
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    launch = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                  num_warps=cfg.num_warps, num_stages=cfg.stages, PRECISION=precision)  # fmt: skip
    w13_scale, w2_scale = scales if scales is not None else (weights, weights)  # unread
    scaled = scales is not None
    activated = torch.empty((num_pairs, inter), dtype=x.dtype, device=x.device)
    _grouped_gemm_kernel[(num_blocks, triton.cdiv(inter, cfg.block_n))](
        x, w13, activated, blocks.pair_ids, blocks.block_experts, weights, w13_scale, num_pairs,
        inter, hidden, x.stride(0), w13.stride(0), w13.stride(1), activated.stride(0),
        w13_scale.stride(0), PAIRS_PER_A_ROW=top_k, GATED=True, WEIGHTED=False, SCALED=scaled,
        **launch,
    )  # fmt: skip
    every_expert_local = expert_start == 0 and num_local == (num_experts or num_local)
    make = torch.empty if every_expert_local else torch.zeros  # other ranks' rows: zeros
    contributions = make((num_pairs, hidden), dtype=x.dtype, device=x.device)
    _grouped_gemm_kernel[(num_blocks, triton.cdiv(hidden, cfg.block_n))](
        activated, w2, contributions, blocks.pair_ids, blocks.block_experts, weights, w2_scale,
        num_pairs, hidden, inter, activated.stride(0), w2.stride(0), w2.stride(1),
        contributions.stride(0), w2_scale.stride(0), PAIRS_PER_A_ROW=1, GATED=False,
        WEIGHTED=True, SCALED=scaled, **launch,
    )  # fmt: skip
    per_slot = contributions.view(num_tokens, top_k, hidden)
    if not batch_invariant:
        return per_slot.sum(dim=1)
    # torch's reduction may split the slots across threads by the output's size; this
    # sums them in slot order, in float32 with one rounding as the reduction does.
    out = per_slot[:, 0].to(torch.float32, copy=True)
    for slot in range(1, top_k):
        out += per_slot[:, slot]
    return out.to(x.dtype)
