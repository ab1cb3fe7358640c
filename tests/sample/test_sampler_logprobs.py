"""Raw logprobs, ranks and their conversion to per-request lists."""

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
from pagedlm.step import LogprobsLists

CPU = torch.device("cpu")


def test_logprobs_match_log_softmax_and_ranks() -> None:
    torch.manual_seed(0)
    logits = torch.randn(5, 40) * 3
    chosen = torch.tensor([0, 5, 39, 17, 3])
    result = compute_logprobs(logits, chosen, num_top=4)
    reference = torch.log_softmax(logits, dim=-1)
    assert result.token_ids.shape == (5, 5) and result.token_ids.dtype == torch.int64
    assert result.logprobs.dtype == torch.float32
    assert torch.equal(result.token_ids[:, 0], chosen)
    torch.testing.assert_close(
        result.logprobs, reference.gather(1, result.token_ids), rtol=0, atol=1e-6
    )
    order = reference.argsort(dim=-1, descending=True)
    assert torch.equal(result.token_ids[:, 1:], order[:, :4])
    for i in range(5):
        assert result.ranks[i] == order[i].tolist().index(int(chosen[i])) + 1


def test_ranks_with_ties_count_only_strictly_better_tokens() -> None:
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0], [2.0, 2.0, 2.0, 2.0], [5.0, 1.0, 1.0, 0.0]])
    result = compute_logprobs(logits, torch.tensor([2, 3, 2]), num_top=2)
    assert result.ranks.tolist() == [1, 1, 2]
    assert set(result.token_ids[0, 1:].tolist()) == {1, 2}
    torch.testing.assert_close(result.logprobs[1], torch.full((3,), -torch.log(torch.tensor(4.0))))


def test_zero_top_gives_the_chosen_token_only() -> None:
    logits = torch.randn(2, 10)
    result = compute_logprobs(logits, torch.tensor([1, 2]), num_top=0)
    assert result.token_ids.tolist() == [[1], [2]]
    assert result.logprobs.shape == (2, 1)


def test_to_lists_trims_each_row() -> None:
    torch.manual_seed(1)
    result = compute_logprobs(torch.randn(3, 20), torch.tensor([4, 5, 6]), num_top=5)
    lists = result.to_lists([0, 2, 5])
    assert [len(entry.token_ids[0]) for entry in lists] == [1, 3, 6]
    assert all(isinstance(entry, LogprobsLists) and len(entry.ranks) == 1 for entry in lists)
    assert lists[1].token_ids[0] == result.token_ids[1, :3].tolist()
    assert lists[2].logprobs[0] == result.logprobs[2].tolist()
    assert lists[0].ranks == [int(result.ranks[0])]
    assert [len(entry.token_ids[0]) for entry in result.to_lists()] == [6, 6, 6]
    with pytest.raises(ValueError, match="only 5 were computed"):
        result.to_lists([0, 6, 1])
    with pytest.raises(ValueError, match="one count per row"):
        result.to_lists([1, 2])


def test_to_position_lists_keeps_every_position() -> None:
    result = compute_logprobs(torch.randn(4, 20), torch.tensor([1, 2, 3, 4]), num_top=3)
    lists = result.to_position_lists(1)
    assert [len(ids) for ids in lists.token_ids] == [2, 2, 2, 2]
    assert [ids[0] for ids in lists.token_ids] == [1, 2, 3, 4]
    assert lists.ranks == result.ranks.tolist()


def test_sampler_returns_raw_logprobs_of_sampled_tokens() -> None:
    torch.manual_seed(2)
    logits = torch.randn(3, 30)
    rows = [
        SamplingRow(
            SamplingParams(
                temperature=0.5, repetition_penalty=1.5, logit_bias={3: 5.0}, logprobs=2
            ),
            None,
            1,
        ),
        SamplingRow(SamplingParams(temperature=0.0, top_k=3), None),
        SamplingRow(SamplingParams(logprobs=4, top_p=0.5), None),
    ]
    history = token_history_from_lists([[1, 2], [1], [1]], [[3], [], []], CPU)
    metadata = SamplingMetadata.build(rows, 30, CPU, torch.Generator().manual_seed(0), history)
    assert metadata.max_num_logprobs == 4
    output = Sampler()(logits, metadata)
    assert output.logprobs is not None
    assert torch.equal(output.logprobs.token_ids[:, 0], output.sampled_token_ids)
    reference = torch.log_softmax(logits, dim=-1)
    torch.testing.assert_close(
        output.logprobs.logprobs, reference.gather(1, output.logprobs.token_ids), rtol=0, atol=1e-6
    )
    assert output.logprobs.ranks[1] == 1


def test_no_logprobs_requested() -> None:
    rows = [SamplingRow(SamplingParams(), None)]
    metadata = SamplingMetadata.build(rows, 8, CPU)
    assert metadata.max_num_logprobs is None
    assert Sampler()(torch.randn(1, 8), metadata).logprobs is None
    rows = [SamplingRow(SamplingParams(logprobs=0), None)]
    assert SamplingMetadata.build(rows, 8, CPU).max_num_logprobs == 0
