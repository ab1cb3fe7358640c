"""Greedy verification of a speculative step in two launches.

A verification step's rows hold, per request, the target's logits after each of its
``k`` drafts (``rejection_sampler.py``). When every row is greedy the outcome is the
longest run of drafts equal to their rows' argmax plus one token, and every emitted token
is its row's argmax: a request's token grid is its rows' argmax, whichever drafts were
accepted. Done with torch ops that step costs some thirty small kernels after the argmax
(draft lookup, comparisons, a cumulative product, index arithmetic, scatters into the
token table); each costs a launch and a few microseconds of an otherwise idle device.

Here ``gumbel_partials`` (the split argmax, no noise) reads the logits once, then one
program per request takes its rows' partials, picks each row's argmax (the first among
equal scores, as ``torch.argmax``), reads its drafts from the step's input ids (the token
fed after row ``j`` is row ``j``'s draft), counts the accepted run among the first
``num_verified = min(k, num_valid[slot])`` drafts, and writes everything the torch path
writes: the token grid, the emitted count, each row's token into the token table and the
slot's rejected count.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedlm_cuda.kernels import pdl
from pagedlm_cuda.kernels.sampling import gumbel_partials


@triton.jit(do_not_specialize=["num_splits"])
def _greedy_verify_kernel(
    best_value_ptr, best_index_ptr, num_splits, input_ids_ptr, logits_indices_ptr,
    last_token, row_starts_ptr, slots_ptr, num_valid_ptr, sample_token_index_ptr,
    token_table_ptr, num_rejected_ptr, grid_ptr, num_emitted_ptr, emitted_ptr, width,
    BLOCK_W: tl.constexpr, BLOCK_S: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    pdl.start(USE_PDL)
    req = tl.program_id(0)
    start = tl.load(row_starts_ptr + req)
    num_rows = tl.load(row_starts_ptr + req + 1) - start
    slot = tl.load(slots_ptr + req)
    j = tl.arange(0, BLOCK_W)
    row_mask = j < num_rows
    rows = start + j
    splits = tl.arange(0, BLOCK_S)
    partial = rows[:, None] * num_splits + splits[None, :]
    partial_mask = row_mask[:, None] & (splits < num_splits)[None, :]
    value = tl.load(best_value_ptr + partial, mask=partial_mask, other=float("-inf"))
    index = tl.load(best_index_ptr + partial, mask=partial_mask, other=2147483647)
    top = tl.max(value, axis=1)
    argmax = tl.min(tl.where(value == top[:, None], index, 2147483647), axis=1).to(tl.int64)
    # Row j's draft: the token fed right after row j's position (the last row's is unused).
    fed = tl.load(logits_indices_ptr + rows, mask=row_mask, other=0) + 1
    draft = tl.load(input_ids_ptr + tl.minimum(fed, last_token), mask=row_mask, other=-1)
    num_verified = tl.minimum(num_rows - 1, tl.load(num_valid_ptr + slot))
    accepted = (j < num_verified) & (draft.to(tl.int64) == argmax)
    num_accepted = tl.min(tl.where(accepted, BLOCK_W, j), axis=0)
    tl.store(grid_ptr + req * width + j, tl.where(row_mask, argmax, 0), mask=j < width)
    tl.store(emitted_ptr + rows, argmax, mask=row_mask)
    tl.store(num_emitted_ptr + req, (num_accepted + 1).to(tl.int64))
    tl.store(num_rejected_ptr + slot, (num_rows - 1 - num_accepted).to(tl.int32))
    first = tl.load(sample_token_index_ptr + req)
    tl.store(token_table_ptr + first + j, argmax.to(tl.int32), mask=row_mask)


def greedy_verify(
    logits: torch.Tensor,
    input_ids: torch.Tensor,
    logits_indices: torch.Tensor,
    last_token: int,
    row_starts: torch.Tensor,
    slots: torch.Tensor,
    num_valid: torch.Tensor,
    sample_token_index: torch.Tensor,
    token_table: torch.Tensor,
    num_rejected: torch.Tensor,
    width: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``pagedlm.sample.rejection_sampler.FusedGreedyVerifier`` (see there for the
    arguments) in two launches."""
    num_reqs = slots.shape[0]
    device = logits.device
    grid = torch.empty((num_reqs, width), dtype=torch.int64, device=device)
    num_emitted = torch.empty(num_reqs, dtype=torch.int64, device=device)
    emitted = torch.empty(logits.shape[0], dtype=torch.int64, device=device)
    if num_reqs == 0:
        return grid, num_emitted, emitted
    best_value, best_index = gumbel_partials(logits, None, None, None)
    num_splits = best_value.shape[1]
    _greedy_verify_kernel[(num_reqs,)](
        best_value, best_index, num_splits, input_ids, logits_indices, last_token, row_starts, slots, num_valid, sample_token_index,
        token_table, num_rejected, grid, num_emitted, emitted, width,
        BLOCK_W=max(2, triton.next_power_of_2(width)),
        BLOCK_S=max(2, triton.next_power_of_2(num_splits)), **pdl.launch_options(),
    )  # fmt: skip
    return grid, num_emitted, emitted
