"""The scheduler's encoder budget and encoder-cache tracking, with a fake model runner."""

from __future__ import annotations

import torch

from pagedlm.config import CacheConfig, SchedulerConfig
from pagedlm.core.request import Request
from pagedlm.core.scheduler import OneBudgetScheduler
from pagedlm.multimodal.tensors import from_tensor_data, to_tensor_data
from pagedlm.sampling_params import SamplingParams
from pagedlm.step import ModelRunnerOutput, MultiModalFeature, SchedulerOutput
from pagedlm.step.codec import decode, encode


def _scheduler(budget: int, encoder_budget: int, num_blocks: int = 64) -> OneBudgetScheduler:
    config = SchedulerConfig(
        max_num_batched_tokens=budget,
        max_model_len=256,
        max_num_encoder_input_tokens=encoder_budget,
    )
    return OneBudgetScheduler(config, CacheConfig(block_size=4), num_blocks)


def _feature(identifier: str, offset: int, length: int) -> MultiModalFeature:
    data = to_tensor_data(torch.arange(6, dtype=torch.float32).reshape(1, 2, 3))
    return MultiModalFeature("image", identifier, offset, length, {"pixel_values": data})


def _request(request_id: str, features: list[MultiModalFeature], num_tokens: int) -> Request:
    return Request(
        request_id,
        list(range(num_tokens)),
        SamplingParams(max_tokens=1),
        mm_features=features,
    )


def _run(scheduler: OneBudgetScheduler) -> SchedulerOutput:
    out = scheduler.schedule()
    sampled = []
    for req_id in out.req_ids:
        request = scheduler.requests[req_id]
        sampled.append([5] if request.num_computed_tokens >= request.num_tokens else [])
    scheduler.update_from_output(out, ModelRunnerOutput(out.req_ids, sampled))
    return out


def test_a_chunk_stops_before_an_image_the_budget_cannot_pay():
    scheduler = _scheduler(budget=64, encoder_budget=10)
    # Two images of 8 rows: only one fits the step's encoder budget.
    scheduler.add_request(_request("a", [_feature("x", 2, 8), _feature("y", 12, 8)], 24))
    first = _run(scheduler)
    assert first.scheduled_encoder_inputs == {"a": [0]}
    assert first.num_scheduled_tokens == {"a": 12}  # up to image "y", not into it
    second = _run(scheduler)
    assert second.scheduled_encoder_inputs == {"a": [1]}
    assert second.num_scheduled_tokens == {"a": 12}


def test_an_image_larger_than_the_budget_is_encoded_alone():
    scheduler = _scheduler(budget=64, encoder_budget=4)
    scheduler.add_request(_request("a", [_feature("x", 1, 8)], 12))
    scheduler.add_request(_request("b", [_feature("y", 1, 8)], 12))
    first = _run(scheduler)
    assert first.scheduled_encoder_inputs == {"a": [0]}
    # "b" feeds the one token before its image; the budget is spent.
    assert first.num_scheduled_tokens == {"a": 12, "b": 1}
    assert _run(scheduler).scheduled_encoder_inputs == {"b": [0]}


def test_a_cached_image_is_not_encoded_again():
    scheduler = _scheduler(budget=5, encoder_budget=8)
    scheduler.add_request(_request("a", [_feature("x", 2, 8)], 12))
    outputs = [_run(scheduler) for _ in range(3)]  # 5 + 5 + 2 tokens
    assert [o.scheduled_encoder_inputs for o in outputs] == [{"a": [0]}, {}, {}]
    # Another request with the same image, while the entry is still cached.
    scheduler.add_request(_request("b", [_feature("x", 0, 8)], 9))
    later = _run(scheduler)
    assert later.num_scheduled_tokens == {"b": 5} and later.scheduled_encoder_inputs == {}


def test_unreferenced_entries_beyond_the_cache_size_are_freed():
    scheduler = _scheduler(budget=64, encoder_budget=8)  # cache size: the budget, 8 rows
    scheduler.add_request(_request("a", [_feature("x", 0, 8)], 9))
    _run(scheduler)  # "a" finishes; "x" stays cached, unreferenced
    scheduler.add_request(_request("b", [_feature("y", 0, 8)], 9))
    assert _run(scheduler).scheduled_encoder_inputs == {"b": [0]}
    # 16 rows cached > 8: the oldest unreferenced entry goes with the next step.
    assert _run(scheduler).free_encoder_mm_hashes == ["x"]


def test_features_cross_the_step_codec():
    scheduler = _scheduler(budget=64, encoder_budget=16)
    scheduler.add_request(_request("a", [_feature("x", 2, 8)], 12))
    out = scheduler.schedule()
    decoded = decode(encode(out), SchedulerOutput)
    assert decoded == out
    feature = decoded.scheduled_new_reqs[0].mm_features[0]
    tensor = from_tensor_data(feature.tensors["pixel_values"])
    assert torch.equal(tensor, torch.arange(6, dtype=torch.float32).reshape(1, 2, 3))
    bf16 = torch.randn(3, 5).to(torch.bfloat16)
    assert torch.equal(from_tensor_data(to_tensor_data(bf16)), bf16)
