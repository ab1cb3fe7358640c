"""Penalties against hand-computed references, and their place before greedy argmax."""

from __future__ import annotations

import pytest
import torch

from pagedlm.sample import Sampler, SamplingMetadata, SamplingRow, token_history_from_lists
from pagedlm.sample.penalties import apply_penalties, pad_token_ids
from pagedlm.sampling_params import SamplingParams

CPU = torch.device("cpu")
LOGITS = torch.tensor([-2.0, -1.0, 0.5, 1.0, 2.0, 3.0, -0.5])
PROMPT = [0, 2, 2]
OUTPUT = [4, 4, 1]


def history(rows: list[SamplingRow], prompt=PROMPT, output=OUTPUT):
    """Every row's tokens: ``prompt``, then ``output``."""
    return token_history_from_lists([prompt] * len(rows), [output] * len(rows), CPU)


def penalized(rows: list[SamplingRow], logits: torch.Tensor) -> torch.Tensor:
    metadata = SamplingMetadata.build(rows, logits.shape[1], CPU, token_history=history(rows))
    assert metadata.penalties is not None
    result = logits.clone()
    apply_penalties(result, metadata.penalties)
    return result


def row(**params) -> SamplingRow:
    return SamplingRow(SamplingParams(**params), None, len(OUTPUT))


@pytest.mark.parametrize("penalty", [2.0, 0.5])
def test_repetition_penalty_hf_semantics(penalty: float) -> None:
    expected = LOGITS.clone()
    for token in (0, 1, 2, 4):  # seen in prompt or output
        value = LOGITS[token]
        expected[token] = value / penalty if value > 0 else value * penalty
    result = penalized([row(repetition_penalty=penalty)], LOGITS.unsqueeze(0))
    torch.testing.assert_close(result[0], expected, rtol=0, atol=1e-6)


def test_frequency_and_presence_count_output_tokens_only() -> None:
    expected = LOGITS.clone()
    expected[4] -= 0.5 * 2 + 0.25  # twice in the output
    expected[1] -= 0.5 * 1 + 0.25  # once in the output; prompt tokens 0 and 2 untouched
    result = penalized([row(frequency_penalty=0.5, presence_penalty=0.25)], LOGITS.unsqueeze(0))
    torch.testing.assert_close(result[0], expected, rtol=0, atol=1e-6)


def test_negative_frequency_penalty_encourages_repeats() -> None:
    result = penalized([row(frequency_penalty=-1.0)], LOGITS.unsqueeze(0))
    assert result[0, 4] == LOGITS[4] + 2.0


def test_all_penalties_compose_repetition_first() -> None:
    expected = LOGITS.clone()
    expected[0] = -2.0 * 1.5
    expected[2] = 0.5 / 1.5
    expected[1] = -1.0 * 1.5 - (0.3 + 0.1)
    expected[4] = 2.0 / 1.5 - (0.3 * 2 + 0.1)
    result = penalized(
        [row(repetition_penalty=1.5, frequency_penalty=0.3, presence_penalty=0.1)],
        LOGITS.unsqueeze(0),
    )
    torch.testing.assert_close(result[0], expected, rtol=0, atol=1e-6)


def test_only_penalized_rows_change() -> None:
    torch.manual_seed(0)
    logits = torch.randn(4, 7)
    rows = [row(), row(repetition_penalty=2.0), row(), row(presence_penalty=1.0)]
    metadata = SamplingMetadata.build(rows, 7, CPU, token_history=history(rows))
    assert metadata.penalties is not None
    assert metadata.penalties.row_indices.tolist() == [1, 3]
    result = penalized(rows, logits)
    assert torch.equal(result[[0, 2]], logits[[0, 2]])
    assert not torch.equal(result[1], logits[1])
    assert not torch.equal(result[3], logits[3])


def test_no_penalties_means_no_stage() -> None:
    assert SamplingMetadata.build([row(), row()], 7, CPU).penalties is None


def test_penalty_changes_greedy_choice() -> None:
    # Token 5 leads; a frequency penalty on it (sampled twice) hands the argmax to token 4.
    rows = [
        SamplingRow(SamplingParams(temperature=0.0, frequency_penalty=1.0), None, 2),
        SamplingRow(SamplingParams(temperature=0.0), None, 2),
    ]
    logits = LOGITS.expand(2, -1).clone()
    metadata = SamplingMetadata.build(rows, 7, CPU, token_history=history(rows, [0], [5, 5]))
    assert Sampler()(logits, metadata).sampled_token_ids.tolist() == [4, 5]


def test_pad_token_ids() -> None:
    padded = pad_token_ids([[3, 1], [], [2, 2, 2]], 9, CPU)
    assert padded.tolist() == [[3, 1, 9], [9, 9, 9], [2, 2, 2]]
    assert pad_token_ids([[], []], 9, CPU).shape == (2, 0)


def test_a_tiny_repetition_penalty_samples_the_seen_token_not_nan() -> None:
    """Seen positive logits divided by a tiny penalty leave float32's range: the sampler
    keeps them at the largest finite logit (+inf would make the softmax NaN and the draw
    junk), so each row samples one of them."""
    rows = [
        SamplingRow(SamplingParams(temperature=1.0, seed=seed, repetition_penalty=1e-39), None, 3)
        for seed in range(8)
    ]
    logits = LOGITS.expand(len(rows), -1).clone()
    metadata = SamplingMetadata.build(rows, 7, CPU, token_history=history(rows))
    sampled = Sampler()(logits, metadata).sampled_token_ids.tolist()
    assert set(sampled) <= {2, 4}  # the seen positive logits (0.5 and 2.0)
