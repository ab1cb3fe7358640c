"""The persistent input batch and the step inputs gathered from it (on CPU, where the
"device" tables are host tensors): positions, slot mapping, block tables, sampled rows,
padding rows for graphs, and tokens that reach the next step only through the table."""

from __future__ import annotations

import torch

from pagedlm.sampling_params import SamplingParams
from pagedlm.step import CachedRequestData, NewRequestData, SchedulerOutput
from pagedlm.worker.input_batch import InputBatch
from pagedlm.worker.step_inputs import StepInputBuilder

BLOCK = 4


def make_builder(max_reqs: int = 4, max_len: int = 32, max_tokens: int = 64):
    batch = InputBatch(max_reqs, max_len, BLOCK, torch.device("cpu"))
    return batch, StepInputBuilder(batch, max_tokens)


def new(req_id: str, tokens: list[int], blocks: list[int], computed: int = 0, **params):
    return NewRequestData(req_id, tokens, len(tokens), SamplingParams(**params), blocks, computed)


def schedule(new_reqs=(), cached=(), counts=None, finished=(), preempted=()) -> SchedulerOutput:
    counts = counts or {}
    cached_data = CachedRequestData(
        [r for r, _, _ in cached], [b for _, b, _ in cached], [n for _, _, n in cached]
    )
    return SchedulerOutput(
        list(new_reqs),
        cached_data,
        counts,
        sum(counts.values()),
        {},
        set(finished),
        set(preempted),
    )


def test_prefill_chunks_then_decode_reads_sampled_tokens_from_the_table() -> None:
    batch, builder = make_builder()
    a = new("a", [10, 11, 12, 13, 14, 15], [7, 2])  # 6 tokens, blocks 7 then 2
    b = new("b", [20, 21, 22], [5])
    output = schedule([a, b], counts={"a": 4, "b": 3})  # a is chunked: 4 of 6
    batch.update(output)
    step = builder.build(output)
    assert step.input_ids.tolist() == [10, 11, 12, 13, 20, 21, 22]
    assert step.positions.tolist() == [0, 1, 2, 3, 0, 1, 2]
    assert step.layout.slot_mapping.tolist() == [28, 29, 30, 31, 20, 21, 22]
    assert step.layout.query_start_loc.tolist() == [0, 4, 7]
    assert step.layout.seq_lens.tolist() == [4, 3]
    assert step.layout.block_table[:, :2].tolist() == [[7, 2], [5, 0]]
    assert step.sampled.tolist() == [1]  # only b's prompt is complete
    assert step.logits_indices.tolist() == [6]
    # What the sampler does: b's sampled token goes into the table at position 3.
    batch.token_ids.view(-1).index_put_(
        (step.sample_token_index,), torch.tensor([99], dtype=torch.int32)
    )

    output = schedule(
        cached=[("a", [], 4), ("b", [], 3)],
        counts={"a": 2, "b": 1},
    )
    batch.update(output)
    step = builder.build(output)
    # b's input is the token the previous step sampled, which the host never saw.
    assert step.input_ids.tolist() == [14, 15, 99]
    assert step.positions.tolist() == [4, 5, 3]
    assert step.layout.slot_mapping.tolist() == [8, 9, 23]
    assert step.sampled.tolist() == [0, 1]
    assert step.logits_indices.tolist() == [1, 2]


def test_graph_padding_rows_write_nothing_and_attend_to_nothing() -> None:
    batch, builder = make_builder()
    output = schedule([new("a", [1, 2], [3]), new("b", [4], [6])], counts={"a": 2, "b": 1})
    batch.update(output)
    builder.build(output)
    output = schedule(
        cached=[("a", [], 2), ("b", [9], 1)],
        counts={"a": 1, "b": 1},
    )
    batch.update(output)
    step = builder.build(output, padded_num_reqs=4)
    assert step.layout.slot_mapping.tolist() != [14, 25, -1, -1]  # a graph gathers these
    builder.gather(step)  # what the captured graph does first
    layout = step.layout
    assert layout.num_reqs == 4 and layout.num_tokens == 4
    assert layout.query_start_loc.tolist() == [0, 1, 2, 3, 4]
    assert layout.seq_lens.tolist() == [3, 2, 0, 0]
    assert layout.slot_mapping.tolist() == [14, 25, -1, -1]
    assert layout.block_table[:, :2].tolist() == [[3, 0], [6, 9], [0, 0], [0, 0]]
    assert step.logits_indices is None  # every real row samples: the first two rows


def test_capture_inputs_are_all_padding_of_the_query_length() -> None:
    _, builder = make_builder()
    step = builder.capture_inputs(3, 2)
    builder.gather(step)
    assert step.layout.query_start_loc.tolist() == [0, 2, 4, 6]
    assert step.layout.seq_lens.tolist() == [0, 0, 0]
    assert step.layout.slot_mapping.tolist() == [-1] * 6
    assert step.layout.max_query_len == 2


def test_slots_are_reused_and_a_preempted_request_keeps_its_generator() -> None:
    batch, builder = make_builder(max_reqs=2)
    output = schedule([new("a", [1], [0], seed=5), new("b", [2], [1])], counts={"a": 1, "b": 1})
    batch.update(output)
    builder.build(output)
    generator = batch.requests["a"].generator
    assert generator is not None
    slot_of_b = batch.requests["b"].slot
    output = schedule([new("c", [3, 4], [2])], counts={"c": 2}, finished=["b"], preempted=["a"])
    batch.update(output)
    step = builder.build(output)
    assert "b" not in batch.requests and batch.requests["a"].slot == -1
    assert batch.requests["c"].slot in (slot_of_b, 0)
    assert step.input_ids.tolist() == [3, 4]
    output = schedule([new("a", [1, 8], [5])], counts={"a": 2}, finished=["c"])
    batch.update(output)
    assert batch.requests["a"].generator is generator
    assert builder.build(output).input_ids.tolist() == [1, 8]


def test_prompt_logprob_rows_and_their_targets() -> None:
    batch, builder = make_builder()
    a = new("a", [10, 11, 12, 13, 14], [1, 2], prompt_logprobs=1)
    output = schedule([a], counts={"a": 3})
    batch.update(output)
    step = builder.build(output)
    assert [(r.req_id, r.num_rows) for r in step.prompt_logprob_rows] == [("a", 3)]
    assert step.logits_indices.tolist() == [0, 1, 2]  # nothing samples yet
    targets = batch.token_ids.view(-1)[step.prompt_target_index]
    assert targets.tolist() == [11, 12, 13]
    output = schedule(cached=[("a", [], 3)], counts={"a": 2})
    batch.update(output)
    step = builder.build(output)
    # Rows: the sampled last row first, then the prompt rows of positions 3 (predicting 14).
    assert step.logits_indices.tolist() == [1, 0]
    assert batch.token_ids.view(-1)[step.prompt_target_index].tolist() == [14]
