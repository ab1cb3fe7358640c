"""The pipeline-parallel batch queue on the real engine core and scheduler with a host-side
two-stage model: two disjoint steps in flight, the first stage fed only what the scheduler
hands on, and the results of synchronous scheduling through chunked prefill, prefix hits,
preemption, priorities, aborts and requests finishing while the other batch is in flight."""

from __future__ import annotations

import pytest
import torch

from core.test_async_scheduling import (
    VOCAB,
    HostModelExecutor,
    make_requests,
    requests_of_twenty_tokens,
    run,
)
from pagedlm.config import ArchConfig, CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from pagedlm.core.engine_core import EngineCore
from pagedlm.core.request import Request
from pagedlm.sampling_params import SamplingParams
from pagedlm.step import ModelRunnerOutput, SchedulerOutput, StepResult

BLOCK = 4


class _Collected:
    """A step's result that, when collected, leaves the executor's in-flight list."""

    def __init__(self, executor: TwoStageHostExecutor, req_ids: set[str], result: StepResult):
        self.executor, self.req_ids, self.inner = executor, req_ids, result

    def result(self) -> ModelRunnerOutput:
        self.executor.in_flight.remove(self.req_ids)
        return self.inner.result()


class TwoStageHostExecutor(HostModelExecutor):
    """``HostModelExecutor`` is the last stage (it knows the ids it samples); the first stage
    knows only the tokens of the scheduler's outputs, and checks that it knows every token a
    step feeds. Also checks that no request is in two steps in flight."""

    name = "two-stage-host-model"

    def __init__(self, num_blocks: int) -> None:
        super().__init__(num_blocks)
        self.first_stage: dict[str, list[int | None]] = {}
        self.in_flight: list[set[str]] = []

    @property
    def max_concurrent_batches(self) -> int:
        return 2

    def execute_model(self, scheduler_output: SchedulerOutput) -> None:
        first = self.first_stage
        for req_id in scheduler_output.finished_req_ids:
            first.pop(req_id, None)
        for data in scheduler_output.scheduled_new_reqs:
            first[data.req_id] = list(data.token_ids)
        cached = scheduler_output.scheduled_cached_reqs
        scheduled = scheduler_output.num_scheduled_tokens
        assert len(cached.new_token_ids) == len(cached.req_ids)
        for req_id, computed, tokens in zip(
            cached.req_ids, cached.num_computed_tokens, cached.new_token_ids, strict=True
        ):
            end = computed + scheduled[req_id]
            row = first[req_id]
            row.extend([None] * (end - len(row)))
            row[end - len(tokens) : end] = tokens
        for req_id, start in zip(scheduler_output.req_ids, scheduler_output.num_computed_tokens):
            fed = first[req_id][start : start + scheduled[req_id]]
            assert None not in fed and len(fed) == scheduled[req_id], "stage 0 lacks a token"
        for step in self.in_flight:
            assert not step & scheduled.keys(), "a request is in two steps in flight"
        self._launched = set(scheduled)
        super().execute_model(scheduler_output)

    def sample_tokens(self, grammar_bitmask) -> StepResult:
        result = super().sample_tokens(grammar_bitmask)
        if not self._launched:
            return result
        self.in_flight.append(self._launched)
        return _Collected(self, self._launched, result)


def make_core(pipelined: bool, num_blocks: int = 64, policy: str = "fcfs") -> EngineCore:
    arch = ArchConfig("LlamaForCausalLM", VOCAB, 8, 1, 2, 2, 4, 16)
    config = EngineConfig(
        ModelConfig("host-model", None, arch, torch.float32, 128),
        CacheConfig(block_size=BLOCK, num_kv_blocks=num_blocks),
        SchedulerConfig(
            max_num_seqs=4, max_num_batched_tokens=16, max_model_len=128, scheduling_policy=policy
        ),
        "cpu",
    )
    executor = (TwoStageHostExecutor if pipelined else HostModelExecutor)(num_blocks)
    return EngineCore(config, platform=None, executor=executor)  # type: ignore[arg-type]


@pytest.mark.parametrize(("num_blocks", "policy"), [(64, "fcfs"), (16, "fcfs"), (16, "priority")])
@pytest.mark.parametrize("seed", [0, 1])
def test_batch_queue_gives_the_sync_results(num_blocks: int, policy: str, seed: int) -> None:
    expected = run(make_core(False, num_blocks, policy), make_requests(seed))
    core = make_core(True, num_blocks, policy)
    assert run(core, make_requests(seed)) == expected
    assert core.max_steps_in_flight_seen == 2
    assert not core.executor.in_flight and not core.scheduler._in_flight_req_ids
    if num_blocks == 16:  # preemption happens, also of requests whose step is in flight
        assert core.scheduler.num_preemptions > 0


def test_request_aborted_in_flight_reports_nothing_more() -> None:
    results = run(make_core(True), requests_of_twenty_tokens(3), abort="r1")
    assert results["r1"][1] == "aborted here"
    assert 2 <= len(results["r1"][0]) < 20


def test_second_batch_launches_before_the_first_is_collected() -> None:
    core = make_core(True)
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    core.add_request(Request("a", list(range(3, 19)), params, set()))  # fills the budget
    core.add_request(Request("b", [5, 6, 7], params, set()))
    assert core.step() == [] and core.num_steps_in_flight == 1  # a's prefill, not waited for
    assert core.executor.in_flight == [{"a"}]
    collected = core.step()  # launches b's prefill (the queue is full), then collects a's
    assert core.max_steps_in_flight_seen == 2 and core.executor.in_flight == [{"b"}]
    assert [o.req_id for o in collected] == ["a"]
    while core.has_unfinished_requests():
        core.step()
    assert not core.executor.in_flight
