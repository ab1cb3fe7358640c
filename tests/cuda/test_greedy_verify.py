"""The fused greedy verification (``greedy_verify``) against the rejection sampler's torch
path plus ``Speculator.verify``'s writes: tokens, counts, the token table and the
rejected counts, for requests of different row counts, fewer valid drafts than scheduled,
ties, and a vocabulary of several argmax splits."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from triton_env import DEVICE

from pagedlm.sample.metadata import SamplingMetadata
from pagedlm.sample.rejection_sampler import RejectionSampler
from pagedlm.sample.row import SamplingRow
from pagedlm.sampling_params import SamplingParams
from pagedlm_cuda.kernels.greedy_verify import greedy_verify
from pagedlm_cuda.kernels.sampling import SPLIT_V

ROW_LENGTH = 40


def _case(vocab: int, rows: list[int], seed: int):
    generator = torch.Generator().manual_seed(seed)
    num_rows = sum(rows)
    logits = torch.randn(num_rows, vocab, generator=generator)
    logits[0, 7] = logits[0, 3] = logits[0].max() + 1  # a tie: the first index wins
    argmax = logits.argmax(dim=1)
    # The step feeds each request's rows as consecutive tokens after two padding tokens;
    # drafts follow their row's argmax until a wrong one, a different place per request.
    input_ids = torch.randint(0, vocab, (num_rows + 3,), generator=generator, dtype=torch.int32)
    logits_indices = torch.arange(2, 2 + num_rows, dtype=torch.int64)
    start = 0
    for i, count in enumerate(rows):
        wrong_at = i % count  # request 0 rejects its first draft; others later or never
        for j in range(count - 1):
            token = int(argmax[start + j])
            input_ids[logits_indices[start + j] + 1] = token if j != wrong_at else token ^ 1
        start += count
    return logits, input_ids, logits_indices


@pytest.mark.parametrize("vocab", [50, SPLIT_V + 300])
def test_greedy_verify_matches_the_rejection_sampler(vocab: int) -> None:
    rows = [5, 1, 3, 5, 2]
    slots = [3, 0, 6, 1, 4]
    # Request 3 (slot 1) verifies 2 of its 4 drafts (all right up to its third): 3 emitted.
    num_valid_by_slot = torch.tensor([0, 2, 0, 4, 9, 0, 2, 0], dtype=torch.int64)
    logits, input_ids, logits_indices = _case(vocab, rows, seed=vocab)
    num_tokens = input_ids.shape[0]
    sample_token_index = torch.tensor([s * ROW_LENGTH + 10 for s in slots], dtype=torch.int64)

    # The torch path, as Speculator.verify runs it.
    counts = np.array(rows)
    request = torch.from_numpy(np.repeat(np.arange(len(rows)), counts))
    position = torch.from_numpy(
        np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)
    )
    slots_t = torch.tensor(slots)
    num_verified = torch.minimum(torch.tensor(rows) - 1, num_valid_by_slot[slots_t])
    drafts = input_ids[(logits_indices + 1).clamp(max=num_tokens - 1)].to(torch.int64)
    metadata = SamplingMetadata.build(
        [SamplingRow(SamplingParams(temperature=0.0), None)] * len(logits), vocab,
        torch.device("cpu"), default_generator=torch.Generator(),
    )  # fmt: skip
    ref = RejectionSampler()(
        logits, metadata, drafts, counts, num_verified, row_map=(request, position)
    )
    ref_table = torch.zeros(8 * ROW_LENGTH, dtype=torch.int32)
    ref_table[sample_token_index[request] + position] = ref.token_ids[request, position].to(
        torch.int32
    )
    ref_rejected = torch.zeros(8, dtype=torch.int32)
    ref_rejected[slots_t] = (torch.tensor(rows) - ref.num_emitted).to(torch.int32)
    assert ref.num_emitted.tolist() != [max(rows)] * len(rows)  # some rejections
    assert int(ref.num_emitted[3]) == 3

    table = torch.zeros(8 * ROW_LENGTH, dtype=torch.int32, device=DEVICE)
    rejected = torch.zeros(8, dtype=torch.int32, device=DEVICE)
    row_starts = torch.tensor(np.concatenate([[0], np.cumsum(counts)]), device=DEVICE)
    grid, num_emitted, emitted = greedy_verify(
        logits.to(DEVICE), input_ids.to(DEVICE), logits_indices.to(DEVICE), num_tokens - 1,
        row_starts, slots_t.to(DEVICE), num_valid_by_slot.to(DEVICE),
        sample_token_index.to(DEVICE), table, rejected, max(rows),
    )  # fmt: skip
    assert grid.cpu().tolist() == ref.token_ids.tolist()
    assert num_emitted.cpu().tolist() == ref.num_emitted.tolist()
    assert emitted.cpu().tolist() == logits.argmax(dim=1).tolist()
    assert torch.equal(table.cpu(), ref_table)
    assert torch.equal(rejected.cpu(), ref_rejected)
