"""``pagedlm.worker.spec_positions.correct_on_device`` in one launch.

Under asynchronous scheduling with speculative decoding every step after a verification
moves the in-flight requests' positions back by their rejections, on the device. As torch
ops that is some seventeen small kernels per step (gathers, a ``repeat_interleave``,
in-place subtractions, the block indices recomputed for every token); here one program
per request shifts its lengths and its tokens' positions, token-table indices and block
indices, and skips its tokens when it has nothing to shift (a request whose drafts were
all accepted, or that had none in flight). Program ``i`` also shifts sampled row ``i``'s
output index.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedlm_cuda.kernels import pdl

BLOCK_T = 64
"""Tokens per loop iteration of a request's program."""


@triton.jit
def _shift_of(slots_ptr, in_flight_ptr, num_rejected_ptr, req):
    slot = tl.load(slots_ptr + req)
    return tl.load(num_rejected_ptr + slot) * tl.load(in_flight_ptr + req)


@triton.jit(do_not_specialize=["num_reqs", "num_sampled"])
def _correct_kernel(
    token_index_ptr, block_index_ptr, block_offset_ptr, sample_index_ptr, slots_ptr,
    in_flight_ptr, sampled_ptr, seq_lens_ptr, positions_ptr, query_start_loc_ptr,
    num_rejected_ptr, num_reqs, num_sampled, row_length, blocks_per_row, block_size,
    BLOCK_T: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    pdl.start(USE_PDL)
    i = tl.program_id(0)
    if i < num_sampled:
        req = tl.load(sampled_ptr + i)
        shift = _shift_of(slots_ptr, in_flight_ptr, num_rejected_ptr, req)
        tl.store(sample_index_ptr + i, tl.load(sample_index_ptr + i) - shift)
    if i < num_reqs:
        shift = _shift_of(slots_ptr, in_flight_ptr, num_rejected_ptr, i)
        if shift != 0:
            tl.store(seq_lens_ptr + i, tl.load(seq_lens_ptr + i) - shift)
            start = tl.load(query_start_loc_ptr + i)
            end = tl.load(query_start_loc_ptr + i + 1)
            for t0 in range(start, end, BLOCK_T):
                t = t0 + tl.arange(0, BLOCK_T)
                mask = t < end
                position = tl.load(positions_ptr + t, mask=mask, other=0) - shift
                token = tl.load(token_index_ptr + t, mask=mask, other=0) - shift
                row_start = token - position  # slot * row_length: the shift cancels
                block = row_start // row_length * blocks_per_row + position // block_size
                tl.store(positions_ptr + t, position, mask=mask)
                tl.store(token_index_ptr + t, token, mask=mask)
                tl.store(block_index_ptr + t, block, mask=mask)
                tl.store(block_offset_ptr + t, position % block_size, mask=mask)


def correct_in_flight(
    token_index: torch.Tensor,
    block_index: torch.Tensor,
    block_offset: torch.Tensor,
    sample_index: torch.Tensor,
    slots: torch.Tensor,
    in_flight: torch.Tensor,
    sampled: torch.Tensor,
    seq_lens: torch.Tensor,
    positions: torch.Tensor,
    query_start_loc: torch.Tensor,
    num_rejected: torch.Tensor,
    row_length: int,
    blocks_per_row: int,
    block_size: int,
) -> None:
    """``correct_on_device``'s contract (``pagedlm.worker.spec_positions``), one launch."""
    num_reqs, num_sampled = slots.shape[0], sampled.shape[0]
    programs = max(num_reqs, num_sampled)
    if programs == 0:
        return
    _correct_kernel[(programs,)](
        token_index, block_index, block_offset, sample_index, slots, in_flight, sampled,
        seq_lens, positions, query_start_loc, num_rejected, num_reqs, num_sampled,
        row_length, blocks_per_row, block_size, BLOCK_T=BLOCK_T, **pdl.launch_options(),
    )  # fmt: skip
