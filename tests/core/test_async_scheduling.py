"""Asynchronous scheduling (one step in flight) against synchronous, on the real engine core
and scheduler with a host-side model: the same tokens, stops and freed blocks, through
chunked prefill, prefix hits, preemption, priorities and aborts."""

from __future__ import annotations

import random

import pytest
import torch

from pagedlm.config import ArchConfig, CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from pagedlm.core.engine_core import EngineCore
from pagedlm.core.request import Request
from pagedlm.executor import Executor
from pagedlm.sampling_params import SamplingParams
from pagedlm.step import FinishedStep, ModelRunnerOutput, SchedulerOutput

VOCAB, EOS, BLOCK = 50, 2, 4


def next_token(tokens: list[int]) -> int:
    """A deterministic 'model': the next token depends on every token so far."""
    value = len(tokens)
    for token in tokens[-6:]:
        value = (value * 131 + token * 7 + 11) % 1_000_003
    return value % VOCAB


class HostModelExecutor(Executor):
    """Runs ``next_token`` like a worker runs a model: it keeps every request's tokens,
    including those it sampled and the scheduler has not seen yet, and checks that each
    step feeds exactly the tokens it should."""

    name = "host-model"

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.tokens: dict[str, list[int]] = {}
        self.forward: ModelRunnerOutput | None = None
        self.num_steps = 0

    def determine_num_kv_blocks(self) -> int:
        return self.num_blocks

    def initialize_kv_cache(self, num_blocks: int) -> None:
        pass

    def execute_model(self, scheduler_output: SchedulerOutput) -> None:
        for req_id in scheduler_output.finished_req_ids:
            self.tokens.pop(req_id, None)
        for data in scheduler_output.scheduled_new_reqs:
            known = self.tokens.get(data.req_id)
            if known is not None:  # resumed: the scheduler knows everything sampled
                assert data.token_ids == known, "a resumed request lost or gained tokens"
            self.tokens[data.req_id] = list(data.token_ids)
        starts = dict(zip(scheduler_output.req_ids, scheduler_output.num_computed_tokens))
        sampled = []
        for req_id in scheduler_output.req_ids:
            tokens = self.tokens[req_id]
            end = starts[req_id] + scheduler_output.num_scheduled_tokens[req_id]
            assert end <= len(tokens), "fed a token that does not exist yet"
            if end == len(tokens):
                tokens.append(next_token(tokens))
                sampled.append([tokens[-1]])
            else:
                sampled.append([])
        if scheduler_output.req_ids:
            self.num_steps += 1
        self.forward = ModelRunnerOutput(scheduler_output.req_ids, sampled)

    def sample_tokens(self, grammar_bitmask) -> FinishedStep:
        output, self.forward = self.forward, None
        return FinishedStep(output or ModelRunnerOutput([], []))


def make_core(
    async_scheduling: bool,
    num_blocks: int = 64,
    max_num_seqs: int = 4,
    budget: int = 16,
    policy: str = "fcfs",
) -> EngineCore:
    arch = ArchConfig("LlamaForCausalLM", VOCAB, 8, 1, 2, 2, 4, 16)
    config = EngineConfig(
        ModelConfig("host-model", None, arch, torch.float32, 128),
        CacheConfig(block_size=BLOCK, num_kv_blocks=num_blocks),
        SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=budget,
            max_model_len=128,
            async_scheduling=async_scheduling,
            scheduling_policy=policy,
        ),
        "cpu",
    )
    return EngineCore(config, platform=None, executor=HostModelExecutor(num_blocks))  # type: ignore[arg-type]


def make_requests(seed: int, count: int = 14) -> list[Request]:
    rng = random.Random(seed)
    shared = [rng.randrange(3, VOCAB) for _ in range(9)]
    requests = []
    for i in range(count):
        prompt = [rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 30))]
        if i % 3 == 0:
            prompt = shared + prompt  # prefix-cache hits
        params = SamplingParams(
            max_tokens=rng.randint(1, 24),
            min_tokens=rng.choice([0, 0, 1]),
            stop_token_ids=rng.choice([[], [rng.randrange(3, VOCAB)]]),
            ignore_eos=rng.random() < 0.2,
        )
        params.all_stop_token_ids = {EOS, *params.stop_token_ids}
        requests.append(Request(f"r{i}", prompt, params, {EOS}, priority=rng.randint(0, 3)))
    return requests


def run(core: EngineCore, requests: list[Request], abort: str | None = None) -> dict:
    results: dict[str, list] = {r.request_id: [[], None, None] for r in requests}
    pending = list(requests)
    steps = 0
    while pending or core.has_unfinished_requests():
        if pending:  # requests arrive while others run
            core.add_request(pending.pop(0))
        if abort is not None and abort in core.scheduler.requests:
            request = core.scheduler.requests[abort]
            if request.num_output_placeholders and request.num_output_tokens >= 2:
                core.abort_requests([abort])
                results[abort][1] = "aborted here"
        for out in core.step():
            assert results[out.req_id][1] is None, f"{out.req_id} reported after it finished"
            results[out.req_id][0] += out.new_token_ids
            if out.finished:
                results[out.req_id][1:] = [out.finish_reason, out.stop_reason]
        steps += 1
        assert steps < 2000, "the engine stopped making progress"
    scheduler = core.scheduler
    assert scheduler.kv_manager.num_free_blocks == scheduler.num_blocks, "blocks leaked"
    assert not scheduler.requests
    return results


@pytest.mark.parametrize(("num_blocks", "policy"), [(64, "fcfs"), (16, "fcfs"), (16, "priority")])
@pytest.mark.parametrize("seed", [0, 1])
def test_async_gives_the_sync_results(num_blocks: int, policy: str, seed: int) -> None:
    sync_core = make_core(False, num_blocks=num_blocks, policy=policy)
    async_core = make_core(True, num_blocks=num_blocks, policy=policy)
    expected = run(sync_core, make_requests(seed))
    assert run(async_core, make_requests(seed)) == expected
    assert all(reason is not None for _, reason, _ in expected.values())
    if num_blocks == 16:  # too few blocks for four long requests: preemption happens
        assert async_core.scheduler.num_preemptions > 0
    # Overlap costs steps only where a request's last token was in flight.
    assert async_core.executor.num_steps >= sync_core.executor.num_steps


def requests_of_twenty_tokens(seed: int) -> list[Request]:
    """``make_requests(seed)``, each running to exactly 20 output tokens (no stops)."""
    requests = make_requests(seed)
    for request in requests:
        request.sampling_params.max_tokens = 20
        request.sampling_params.ignore_eos = True
        request.eos_token_ids = set()
        request.sampling_params.stop_token_ids = []
        request.sampling_params.all_stop_token_ids = set()
    return requests


def test_request_aborted_with_a_step_in_flight_reports_nothing_more() -> None:
    results = run(make_core(True), requests_of_twenty_tokens(3), abort="r1")
    assert results["r1"][1] == "aborted here"
    assert 2 <= len(results["r1"][0]) < 20


def test_id_added_again_while_its_aborted_step_is_in_flight_names_a_new_request() -> None:
    """The token the aborted request samples in the step still in flight is not the new
    request's (it was appended to it, which the workers never saw)."""
    core = make_core(True)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    core.add_request(Request("a", [5, 6, 7], params, {EOS}))
    core.step()
    core.step()  # its first token collected, its second in flight
    core.abort_requests(["a"])
    core.add_request(Request("a", [9, 8], params, {EOS}))
    tokens = []
    while core.has_unfinished_requests():
        tokens += [token for out in core.step() for token in out.new_token_ids]
    expected = [9, 8]
    for _ in range(4):
        expected.append(next_token(expected))
    assert tokens == expected[2:]
    assert core.scheduler.kv_manager.num_free_blocks == core.scheduler.num_blocks


def test_last_token_in_flight_is_not_scheduled_again() -> None:
    core = make_core(True)
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    core.add_request(Request("a", [5, 6, 7], params, {EOS}))
    assert core.step() == []  # the prefill is in flight
    assert core.scheduler.requests["a"].num_output_placeholders == 1
    first = core.step()  # decodes its second (last) token while collecting the first
    assert [o.new_token_ids for o in first] == [[next_token([5, 6, 7])]]
    assert not core.scheduler.running[0].is_finished
    last = core.step()  # nothing left to schedule: only collects
    assert last[0].finish_reason == "length" and core.executor.num_steps == 2
    assert not core.has_unfinished_requests()


class _FailingResult:
    def result(self) -> ModelRunnerOutput:
        raise RuntimeError("the device reported an error")


def test_a_step_that_fails_in_flight_raises_from_the_next_step() -> None:
    """The step in flight is collected by the next ``step()``: its failure surfaces there
    (the engine-core process then reports it and every waiter fails, as without overlap)."""
    core = make_core(True)
    core.executor.sample_tokens = lambda bitmask: _FailingResult()  # type: ignore[method-assign]
    core.add_request(Request("a", [5, 6, 7], SamplingParams(max_tokens=4), {EOS}))
    assert core.step() == []  # launched; its failure is not known yet
    with pytest.raises(RuntimeError, match="device reported an error"):
        core.step()
