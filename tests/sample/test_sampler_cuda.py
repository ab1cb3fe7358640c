"""The sampler on a CUDA device: same semantics, seeded rows independent of the batch."""

from __future__ import annotations

import pytest
import torch

from pagedlm.sample import (
    Sampler,
    SamplingMetadata,
    SamplingRow,
    compute_logprobs,
    token_history_from_lists,
)
from pagedlm.sampling_params import SamplingParams

pytestmark = pytest.mark.cuda
CUDA = torch.device("cuda")
VOCAB = 4096


def make_row(generator: torch.Generator | None = None, **params) -> SamplingRow:
    return SamplingRow(SamplingParams(**params), generator, 2)


def run(logits: torch.Tensor, rows: list[SamplingRow], seed: int = 0) -> torch.Tensor:
    default = torch.Generator(device=CUDA).manual_seed(seed)
    history = token_history_from_lists([[1, 2, 3]] * len(rows), [[4, 4]] * len(rows), CUDA)
    metadata = SamplingMetadata.build(rows, logits.shape[1], CUDA, default, history)
    return Sampler()(logits, metadata).sampled_token_ids


def test_greedy_and_logprobs_on_cuda() -> None:
    torch.manual_seed(0)
    logits = torch.randn(16, VOCAB, device=CUDA)
    sampled = run(logits, [make_row(temperature=0.0) for _ in range(16)])
    assert torch.equal(sampled, logits.argmax(dim=-1))
    result = compute_logprobs(logits, sampled, num_top=5)
    torch.testing.assert_close(
        result.logprobs,
        torch.log_softmax(logits, dim=-1).gather(1, result.token_ids),
        rtol=0,
        atol=1e-6,
    )
    assert torch.all(result.ranks == 1)


def test_filters_and_penalties_on_cuda() -> None:
    torch.manual_seed(1)
    row = torch.randn(VOCAB, device=CUDA) * 3
    kinds = [{"top_k": 3}, {"top_p": 0.2, "repetition_penalty": 1.3}, {"min_p": 0.3}, {}]
    rows = [make_row(**kinds[i % 4]) for i in range(1024)]
    sampled = run(row.expand(1024, -1).clone(), rows)
    assert set(sampled[0::4].tolist()) <= set(row.topk(3).indices.tolist())
    probs = row.softmax(-1)
    allowed = set(torch.nonzero(probs >= 0.3 * probs.max()).flatten().tolist())
    assert set(sampled[2::4].tolist()) <= allowed
    assert len(set(sampled[3::4].tolist())) > 50


def test_seeded_rows_independent_of_batch_on_cuda() -> None:
    torch.manual_seed(2)
    steps = [torch.randn(VOCAB, device=CUDA) for _ in range(5)]

    def tokens(position: int, batch_size: int) -> list[int]:
        generator = torch.Generator(device=CUDA).manual_seed(11)
        result = []
        for logits_row in steps:
            rows = [make_row(top_k=50, temperature=1.2) for _ in range(batch_size)]
            rows[position] = make_row(generator, seed=11, top_p=0.9, temperature=0.8)
            logits = torch.randn(batch_size, VOCAB, device=CUDA)
            logits[position] = logits_row
            result.append(int(run(logits, rows, seed=position)[position]))
        return result

    alone = tokens(0, 1)
    assert tokens(3, 7) == alone
    assert tokens(60, 64) == alone
