"""Step inputs of speculative verification: drafts read from the token table, logits at
every verified position, and the in-flight step's rejections resolved on the host or on the
device, which must give the same device inputs."""

from __future__ import annotations

import pytest
import torch

from pagedlm.sampling_params import SamplingParams
from pagedlm.step import CachedRequestData, NewRequestData, SchedulerOutput
from pagedlm.worker.input_batch import InputBatch
from pagedlm.worker.step_inputs import StepInputBuilder

BLOCK = 4


def _admit(batch: InputBatch, builder: StepInputBuilder) -> None:
    """Two requests, prompts done: a = [10..15] (slot row holds a sampled 16 at position 6),
    b = [20, 21] (sampled 22 at position 2)."""
    params = SamplingParams()
    output = SchedulerOutput(
        [
            NewRequestData("a", list(range(10, 16)), 6, params, [3, 5, 7], 0),
            NewRequestData("b", [20, 21], 2, params, [1, 2], 0),
        ],
        CachedRequestData(),
        {"a": 6, "b": 2},
        8,
    )
    batch.update(output)
    step = builder.build(output)
    batch.token_ids.view(-1).index_put_(
        (step.sample_token_index,), torch.tensor([16, 22], dtype=torch.int32)
    )


def _verify(start_a: int, start_b: int, in_flight: dict[str, int]) -> SchedulerOutput:
    """a verifies 3 drafts, b plain-decodes."""
    return SchedulerOutput(
        [],
        CachedRequestData(["a", "b"], [[], []], [start_a, start_b]),
        {"a": 4, "b": 1},
        5,
        scheduled_spec_decode_tokens={"a": [-1, -1, -1]},
        num_drafts_in_flight=in_flight,
    )


def test_a_verifying_request_feeds_its_drafts_and_gets_logits_at_each_position() -> None:
    batch = InputBatch(4, 32, BLOCK, torch.device("cpu"))
    builder = StepInputBuilder(batch, 64)
    _admit(batch, builder)
    slot = batch.requests["a"].slot
    batch.token_ids[slot, 7:10] = torch.tensor([30, 31, 32], dtype=torch.int32)  # drafts
    output = _verify(6, 2, {})
    batch.update(output)
    step = builder.build(output)
    assert step.input_ids.tolist() == [16, 30, 31, 32, 22]
    assert step.positions.tolist() == [6, 7, 8, 9, 2]
    assert step.layout.seq_lens.tolist() == [10, 3]
    assert step.layout.slot_mapping.tolist() == [5 * 4 + 2, 5 * 4 + 3, 7 * 4, 7 * 4 + 1, 6]
    assert step.sampled.tolist() == [0, 1] and step.num_sampling_rows.tolist() == [4, 1]
    assert step.logits_indices.tolist() == [0, 1, 2, 3, 4]
    row = batch.row_length
    assert step.sample_token_index.tolist() == [slot * row + 7, batch.requests["b"].slot * row + 3]


@pytest.mark.parametrize("rejected", [0, 2, 3])
def test_in_flight_rejections_on_the_device_give_the_host_resolved_inputs(rejected: int) -> None:
    """a's start (12) assumed its in-flight step accepted all 3 drafts; it rejected some."""
    results = []
    for host_lengths_exact in (True, False):
        batch = InputBatch(4, 32, BLOCK, torch.device("cpu"))
        builder = StepInputBuilder(batch, 64, host_lengths_exact)
        _admit(batch, builder)
        batch.token_ids[batch.requests["a"].slot, :20] = torch.arange(20, dtype=torch.int32)
        num_rejected = torch.zeros(4, dtype=torch.int32)
        num_rejected[batch.requests["a"].slot] = rejected
        output = _verify(12, 2, {"a": 3})
        batch.update(output)
        step = builder.build(output, num_rejected=num_rejected)
        assert step.exact_lengths == host_lengths_exact
        results.append(
            [
                step.input_ids.tolist(),
                step.positions.tolist(),
                step.layout.seq_lens.tolist(),
                step.layout.slot_mapping.tolist(),
                step.sample_token_index.tolist(),
            ]
        )
    assert results[0] == results[1]
    start = 12 - rejected
    assert results[0][1] == [start, start + 1, start + 2, start + 3, 2]
    assert results[0][0][:4] == [start, start + 1, start + 2, start + 3]  # the row's tokens
