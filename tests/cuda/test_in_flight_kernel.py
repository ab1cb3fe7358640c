"""The in-flight correction kernel (``correct_in_flight``) against ``correct_on_device``'s
torch ops: requests with and without rejections or drafts in flight, a long chunk over
several loop iterations, padding tokens past the real ones left alone."""

from __future__ import annotations

import torch
from triton_env import DEVICE

from pagedlm.worker.spec_positions import correct_on_device
from pagedlm_cuda.kernels.in_flight import BLOCK_T, correct_in_flight

ROW_LENGTH, BLOCK_SIZE, BLOCKS_PER_ROW = 512, 16, 32


def _step():
    """A step of four requests (query lengths 5, 1, BLOCK_T + 7, 5) plus two padding
    tokens, as the host staged it before knowing the in-flight rejections."""
    query_lens = [5, 1, BLOCK_T + 7, 5]
    slots = [2, 0, 5, 3]
    starts = [100, 40, 200, 17]  # each request's first position this step
    positions, tokens = [], []
    for slot, start, count in zip(slots, starts, query_lens, strict=True):
        positions += range(start, start + count)
        tokens += [slot * ROW_LENGTH + p for p in range(start, start + count)]
    positions += [0, 0]
    tokens += [7, 7]  # padding tokens: untouched
    blocks = [t // ROW_LENGTH * BLOCKS_PER_ROW + p // BLOCK_SIZE for t, p in zip(tokens, positions)]
    offsets = [p % BLOCK_SIZE for p in positions]
    qsl = [0]
    for count in query_lens:
        qsl.append(qsl[-1] + count)
    i32 = dict(dtype=torch.int32)
    return dict(
        token_index=torch.tensor(tokens, **i32),
        block_index=torch.tensor(blocks, **i32),
        block_offset=torch.tensor(offsets, **i32),
        sample_index=torch.tensor(
            [slots[r] * ROW_LENGTH + starts[r] + 1 for r in (0, 2, 3)], **i32
        ),
        slots=torch.tensor(slots, **i32),
        in_flight=torch.tensor([1, 1, 1, 0], **i32),  # request 3 had no drafts in flight
        sampled=torch.tensor([0, 2, 3], **i32),  # request 1 (a prompt chunk) samples nothing
        seq_lens=torch.tensor([s + c for s, c in zip(starts, query_lens)], **i32),
        positions=torch.tensor(positions[: qsl[-1]], **i32),
        query_start_loc=torch.tensor(qsl, **i32),
        # By slot: request 0 (slot 2) rejected 3, request 1 (slot 0) none, request 2
        # (slot 5) 2; slot 3's count is stale and request 3 is not in flight.
        num_rejected=torch.tensor([0, 9, 3, 4, 9, 2, 9, 9], **i32),
    )


def test_correct_in_flight_matches_the_torch_ops() -> None:
    ref = _step()
    correct_on_device(
        **ref, row_length=ROW_LENGTH, blocks_per_row=BLOCKS_PER_ROW, block_size=BLOCK_SIZE
    )
    out = {name: value.to(DEVICE) for name, value in _step().items()}
    correct_in_flight(
        **out, row_length=ROW_LENGTH, blocks_per_row=BLOCKS_PER_ROW, block_size=BLOCK_SIZE
    )
    for name, value in ref.items():
        assert torch.equal(out[name].cpu(), value), name
    assert not torch.equal(ref["positions"], _step()["positions"])  # something moved
