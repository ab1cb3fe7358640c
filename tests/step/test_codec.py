"""The step protocol crosses processes as msgspec msgpack: every message round-trips."""

from __future__ import annotations

import numpy as np

from pagedlm.sampling_params import SamplingParams, StructuredOutputsParams
from pagedlm.step import (
    CachedRequestData,
    GrammarBitmask,
    LogprobsLists,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
    codec,
)


def test_scheduler_output_round_trips() -> None:
    params = SamplingParams(
        temperature=0.7,
        seed=5,
        stop=["\n"],
        logit_bias={3: -2.5},
        logprobs=2,
        structured_outputs=StructuredOutputsParams(regex="[ab]+"),
    )
    output = SchedulerOutput(
        scheduled_new_reqs=[NewRequestData("a", [1, 2, 3], 3, params, [7, 8], 0)],
        scheduled_cached_reqs=CachedRequestData(["b"], [[9]], [41]),
        num_scheduled_tokens={"a": 3, "b": 1},
        total_num_scheduled_tokens=4,
        scheduled_spec_decode_tokens={"b": [5, 6]},
        finished_req_ids={"z"},
        preempted_req_ids={"y"},
        structured_output_req_ids=["a"],
    )
    decoded = codec.decode(codec.encode(output), SchedulerOutput)
    assert decoded == output
    assert decoded.scheduled_new_reqs[0].sampling_params.logit_bias == {3: -2.5}


def test_runner_output_and_bitmask_round_trip() -> None:
    output = ModelRunnerOutput(
        req_ids=["a", "b"],
        sampled_token_ids=[[4], []],
        logprobs={"a": LogprobsLists([[4, 1]], [[-0.5, -1.0]], [1])},
        prompt_logprobs={"b": LogprobsLists([[2]], [[-3.0]], [7])},
        pooler_output={"b": [0.25, -1.0]},
    )
    assert codec.decode(codec.encode(output), ModelRunnerOutput) == output
    bitmask = GrammarBitmask(["a"], np.array([[-1, 5]], dtype=np.int32))
    decoded = codec.decode(codec.encode(bitmask), GrammarBitmask)
    assert decoded.req_ids == ["a"]
    assert decoded.bitmask.dtype == np.int32 and decoded.bitmask.tolist() == [[-1, 5]]
    decoded.bitmask[0, 0] = 0  # writable, its own memory
