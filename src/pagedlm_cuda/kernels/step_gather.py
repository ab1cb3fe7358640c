"""``pagedlm.worker.step_inputs.gather_on_device`` in one launch.

Every step gathers its input ids and slot mapping per token and its rows' block tables
from the input batch's tables; a graph replays these gathers first. As torch ops they are
five kernels (three ``index_select``, a multiply and an add), ~8 us of a batch-1 decode
step on the H200 (session 26's W2 timeline) for a few hundred bytes. Here the first
``cdiv(T, BLOCK_T)`` programs take ``BLOCK_T`` tokens each and the next ``R`` programs a
row's block table each.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_T = 256
"""Tokens per program."""
BLOCK_W = 256
"""Block-table entries per loop iteration of a row's program."""


# The token count varies per eager step: not specialized, so none compiles mid-run (the
# row count only sizes the grid).
@triton.jit(do_not_specialize=["num_tokens"])
def _gather_kernel(
    token_table_ptr, token_index_ptr, block_table_ptr, block_index_ptr, block_offset_ptr,
    slots_ptr, input_ids_ptr, slot_mapping_ptr, row_tables_ptr, num_tokens, width,
    block_size, BLOCK_T: tl.constexpr, BLOCK_W: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    token_programs = tl.cdiv(num_tokens, BLOCK_T)
    if pid < token_programs:
        t = pid * BLOCK_T + tl.arange(0, BLOCK_T)
        mask = t < num_tokens
        token = tl.load(token_index_ptr + t, mask=mask, other=0).to(tl.int64)
        tl.store(input_ids_ptr + t, tl.load(token_table_ptr + token, mask=mask), mask=mask)
        block = tl.load(block_index_ptr + t, mask=mask, other=0).to(tl.int64)
        offset = tl.load(block_offset_ptr + t, mask=mask, other=0)
        block_id = tl.load(block_table_ptr + block, mask=mask, other=0)
        tl.store(slot_mapping_ptr + t, block_id * block_size + offset, mask=mask)
    else:
        row = (pid - token_programs).to(tl.int64)
        source = block_table_ptr + tl.load(slots_ptr + row).to(tl.int64) * width
        dest = row_tables_ptr + row * width
        for w0 in range(0, width, BLOCK_W):
            w = w0 + tl.arange(0, BLOCK_W)
            mask = w < width
            tl.store(dest + w, tl.load(source + w, mask=mask), mask=mask)


def gather_step_inputs(
    token_table: torch.Tensor,
    token_index: torch.Tensor,
    block_table: torch.Tensor,
    block_index: torch.Tensor,
    block_offset: torch.Tensor,
    slots: torch.Tensor,
    input_ids: torch.Tensor,
    slot_mapping: torch.Tensor,
    row_tables: torch.Tensor,
    block_size: int,
) -> None:
    """``gather_on_device``'s gathers (same arguments, int32 contiguous tensors), queued as
    one kernel; launched without programmatic dependent launch, so it starts after every
    kernel before it, as the torch ops did."""
    num_tokens, num_rows = token_index.shape[0], slots.shape[0]
    width = block_table.shape[1]
    if row_tables.shape[1] != width:
        raise ValueError(f"row_tables has {row_tables.shape[1]} columns, block_table {width}.")
    programs = triton.cdiv(num_tokens, BLOCK_T) + num_rows
    if programs == 0:
        return
    _gather_kernel[(programs,)](
        token_table, token_index, block_table, block_index, block_offset, slots,
        input_ids, slot_mapping, row_tables, num_tokens, width, block_size,
        BLOCK_T=BLOCK_T, BLOCK_W=BLOCK_W,
    )  # fmt: skip
