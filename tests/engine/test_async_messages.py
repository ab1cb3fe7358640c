"""The msgspec messages between the front end and the engine core: round trips and mirrors."""

from __future__ import annotations

import dataclasses
import inspect
import subprocess
import sys

import msgspec
import pytest

from pagedlm.core.outputs import EngineCoreOutput
from pagedlm.core.request import Request
from pagedlm.core.scheduler_interface import SchedulerStats
from pagedlm.engine import messages
from pagedlm.sampling_params import RequestOutputKind, SamplingParams
from pagedlm.step import LogprobsLists


def _round_trip(message):
    encoded = messages.make_encoder().encode(message)
    if isinstance(message, messages.FrontendMessage.__args__):
        return messages.make_frontend_decoder().decode(encoded)
    return messages.make_core_decoder().decode(encoded)


def test_sampling_params_round_trip_keeps_resolved_fields():
    params = SamplingParams(
        n=3,
        temperature=0,
        top_k=5,
        seed=7,
        stop=["x", "yz"],
        stop_token_ids=[4],
        max_tokens=9,
        logprobs=2,
        logit_bias={3: 1.5, 10: -100},
        output_kind=RequestOutputKind.DELTA,
    )
    params.all_stop_token_ids = {4, 2, 99}  # resolved by the input processor, not derivable
    wire = messages.sampling_params_to_wire(params)
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(wire), type=messages.WireSamplingParams)
    restored = messages.sampling_params_from_wire(decoded)
    assert restored == params
    assert restored.all_stop_token_ids == {2, 4, 99}
    assert restored.output_kind is RequestOutputKind.DELTA
    assert restored.logit_bias == {3: 1.5, 10: -100.0}


def test_wire_sampling_params_mirrors_every_field():
    names = [f.name for f in dataclasses.fields(SamplingParams)]
    assert list(messages.WireSamplingParams.__struct_fields__) == names


def test_request_round_trip():
    params = SamplingParams(max_tokens=4, ignore_eos=False)
    request = Request(
        "r1",
        [5, 6, 7],
        params,
        eos_token_ids={2},
        arrival_time=12.5,
        cache_salt="salt",
        priority=-3,
    )
    message = messages.AddRequests("parent", [messages.request_to_wire(request)])
    decoded = _round_trip(message)
    assert isinstance(decoded, messages.AddRequests) and decoded.parent_id == "parent"
    restored = messages.request_from_wire(decoded.requests[0])
    assert restored.request_id == "r1"
    assert restored.prompt_token_ids == [5, 6, 7]
    assert restored.eos_token_ids == {2}
    assert restored.arrival_time == 12.5
    assert restored.cache_salt == "salt"
    assert restored.priority == -3
    assert restored.sampling_params == params


def test_wire_request_mirrors_request_constructor():
    constructor = list(inspect.signature(Request.__init__).parameters)[1:]
    assert list(messages.WireRequest.__struct_fields__) == constructor


def test_core_outputs_round_trip():
    logprobs = LogprobsLists([[3, 1, 2]], [[-0.1, -2.5, -3.0]], [1])
    outputs = [
        EngineCoreOutput(
            "a", [3], new_logprobs=logprobs, num_cached_tokens=16, num_external_computed_tokens=8
        ),
        EngineCoreOutput("b", [9, 8], finish_reason="stop", stop_reason=8),
        EngineCoreOutput("c", [], new_prompt_logprobs=logprobs),
    ]
    stats = SchedulerStats(2, 1, 0.25, 3, 40, 16, num_deferred_reqs=1)
    decoded = _round_trip(messages.CoreOutputs(outputs, stats))
    assert decoded.stats == stats
    assert decoded.outputs == outputs
    assert all(type(o) is EngineCoreOutput for o in decoded.outputs)
    assert type(decoded.outputs[0].new_logprobs) is LogprobsLists


def test_data_parallel_stats_outputs_and_the_step_time_round_trip():
    """What the front end's per-engine metrics read: each replica's stats beside the sum,
    the replica of each output, and the core's clock at the step's end."""
    from pagedlm.engine.data_parallel import sum_stats

    stats = sum_stats(
        [
            SchedulerStats(2, 1, 0.25, 3, 40, 16, num_deferred_reqs=1, prefix_cache_requests=2),
            SchedulerStats(0, 2, 0.5, 0, 8, 0, prefix_cache_requests=1, prefix_cache_resets=1),
        ]
    )
    assert (stats.num_waiting_reqs, stats.num_deferred_reqs) == (3, 1)
    assert (stats.prefix_cache_requests, stats.prefix_cache_resets) == (3, 1)
    outputs = [EngineCoreOutput("a", [3]), EngineCoreOutput("b", [4], engine_index=1)]
    decoded = _round_trip(messages.CoreOutputs(outputs, stats, timestamp=12.5))
    assert decoded.stats == stats and len(decoded.stats.engines) == 2
    assert all(type(engine) is SchedulerStats for engine in decoded.stats.engines)
    assert [o.engine_index for o in decoded.outputs] == [0, 1]
    assert decoded.timestamp == 12.5


def test_decoders_reject_the_other_direction():
    encoded = messages.make_encoder().encode(messages.Shutdown())
    with pytest.raises(msgspec.ValidationError):
        messages.make_core_decoder().decode(encoded)


def test_import_pagedlm_does_not_load_zmq_or_msgspec():
    bare = "import sys, pagedlm; print('zmq' in sys.modules, 'msgspec' in sys.modules)"
    result = subprocess.run(
        [sys.executable, "-c", bare], capture_output=True, text=True, check=True
    )
    assert result.stdout.split() == ["False", "False"]
    used = "import sys, pagedlm; pagedlm.AsyncLLM; assert 'zmq' in sys.modules"
    subprocess.run([sys.executable, "-c", used], check=True)
