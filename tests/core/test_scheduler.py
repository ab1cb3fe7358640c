"""OneBudgetScheduler and the token-level stop checker, driven by a fake model runner."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from pagedlm.config import CacheConfig, SchedulerConfig
from pagedlm.core.outputs import EngineCoreOutput
from pagedlm.core.request import Request, RequestStatus
from pagedlm.core.scheduler import OneBudgetScheduler
from pagedlm.core.stop_checker import append_token_ids
from pagedlm.sampling_params import SamplingParams
from pagedlm.step import LogprobsLists, ModelRunnerOutput, SchedulerOutput

BLOCK = 4
EOS = 2
FILLER = 7
"""The token the fake model samples unless told otherwise (not EOS, not a stop token)."""


def _scheduler(
    *, budget: int = 64, max_seqs: int = 8, num_blocks: int = 64, max_model_len: int = 256
) -> OneBudgetScheduler:
    return OneBudgetScheduler(
        SchedulerConfig(
            max_num_seqs=max_seqs, max_num_batched_tokens=budget, max_model_len=max_model_len
        ),
        CacheConfig(block_size=BLOCK),
        num_blocks,
    )


def _request(request_id: str, num_prompt: int, first_token: int = 10, **params) -> Request:
    params.setdefault("max_tokens", 4)
    return Request(
        request_id,
        list(range(first_token, first_token + num_prompt)),
        SamplingParams(**params),
        eos_token_ids={EOS},
    )


def _row_order(output: SchedulerOutput) -> list[str]:
    return output.req_ids


def _step(
    scheduler: OneBudgetScheduler,
    sample: Callable[[Request], list[int]] = lambda request: [FILLER],
) -> tuple[SchedulerOutput, list[EngineCoreOutput]]:
    """One engine step with a fake runner: requests whose prompt is done sample ``sample``."""
    output = scheduler.schedule()
    req_ids = _row_order(output)
    sampled = []
    for req_id in req_ids:
        request = scheduler.requests[req_id]
        done = request.num_computed_tokens >= request.num_tokens
        sampled.append(sample(request) if done else [])
    runner_output = ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled)
    return output, scheduler.update_from_output(output, runner_output)


def _run_to_completion(
    scheduler: OneBudgetScheduler, max_steps: int = 200
) -> list[SchedulerOutput]:
    outputs = []
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            return outputs
        output, _ = _step(scheduler)
        _assert_step_invariants(scheduler, output)
        outputs.append(output)
    raise AssertionError("requests did not finish")


def _assert_step_invariants(scheduler: OneBudgetScheduler, output: SchedulerOutput) -> None:
    assert output.total_num_scheduled_tokens <= scheduler.config.max_num_batched_tokens
    assert len(output.num_scheduled_tokens) <= scheduler.config.max_num_seqs
    for request in scheduler.running:
        num_slots = len(scheduler.kv_manager.get_block_ids(request)) * BLOCK
        assert num_slots >= request.num_computed_tokens


def _assert_all_free(scheduler: OneBudgetScheduler) -> None:
    manager = scheduler.kv_manager
    assert manager.num_free_blocks == manager.num_blocks
    assert all(block.ref_cnt == 0 for block in manager.pool.blocks)
    assert not scheduler.requests


# ------------------------------------------------------------------------ the budget


def test_budget_is_shared_in_arrival_order():
    scheduler = _scheduler(budget=16)
    for i in range(3):
        scheduler.add_request(_request(f"r{i}", 10, first_token=100 * i))
    output, _ = _step(scheduler)
    assert output.num_scheduled_tokens == {"r0": 10, "r1": 6}
    assert output.total_num_scheduled_tokens == 16
    assert [r.request_id for r in scheduler.waiting] == ["r2"]


def test_long_prompt_is_chunked_across_steps():
    scheduler = _scheduler(budget=16)
    request = _request("long", 40)
    scheduler.add_request(request)
    chunks, new_tokens = [], []
    for _ in range(3):
        output, outputs = _step(scheduler)
        chunks.append(output.num_scheduled_tokens["long"])
        new_tokens.append([o.new_token_ids for o in outputs])
    assert chunks == [16, 16, 8]
    assert new_tokens == [[], [], [[FILLER]]]  # partial chunks sample nothing
    assert request.num_computed_tokens == 40
    output, _ = _step(scheduler)
    assert output.scheduled_cached_reqs.num_computed_tokens[0] == 40
    assert output.num_scheduled_tokens == {"long": 1}


def test_running_requests_come_before_waiting_ones():
    scheduler = _scheduler(budget=8)
    scheduler.add_request(_request("first", 5))
    _step(scheduler)
    scheduler.add_request(_request("second", 20, first_token=300))
    output, _ = _step(scheduler)
    assert output.scheduled_cached_reqs.req_ids == ["first"]
    assert output.num_scheduled_tokens == {"first": 1, "second": 7}


def test_max_num_seqs_caps_running_requests():
    scheduler = _scheduler(max_seqs=2)
    for i in range(3):
        scheduler.add_request(_request(f"r{i}", 3, first_token=100 * i, max_tokens=2))
    output, _ = _step(scheduler)
    assert set(output.num_scheduled_tokens) == {"r0", "r1"}
    _step(scheduler)  # r0 and r1 finish (max_tokens=2)
    output, _ = _step(scheduler)
    assert set(output.num_scheduled_tokens) == {"r2"}
    assert output.finished_req_ids == {"r0", "r1"}


def test_request_that_needs_several_tokens_gets_them():
    # A running request with more than one missing token (as with speculative drafts,
    # or a chunk cut short by the budget) is scheduled all of them at once.
    scheduler = _scheduler(budget=8)
    scheduler.add_request(_request("a", 12))
    _step(scheduler)
    output, _ = _step(scheduler)
    assert output.num_scheduled_tokens == {"a": 4}
    assert output.scheduled_cached_reqs.num_computed_tokens[0] == 8


# ------------------------------------------------------------------------ preemption


def test_last_running_request_is_preempted_and_resumes():
    # 7 blocks of 4 slots; with max_tokens=6 the three requests need 3 blocks each in
    # the end, so decoding runs out of blocks and the newest request must give way.
    # max_num_seqs keeps "late" waiting behind them.
    scheduler = _scheduler(num_blocks=7, max_seqs=3)
    requests = [
        _request(f"r{i}", num_prompt, first_token=100 * i, max_tokens=6)
        for i, num_prompt in enumerate((4, 6, 4))
    ]
    for request in requests:
        scheduler.add_request(request)
    scheduler.add_request(_request("late", 4, first_token=900, max_tokens=1))
    preempting_step = None
    for _ in range(10):
        output, _ = _step(scheduler)
        if output.preempted_req_ids:
            preempting_step = output
            break
    assert preempting_step is not None
    assert preempting_step.preempted_req_ids == {"r2"}
    assert "r2" not in preempting_step.num_scheduled_tokens
    assert not preempting_step.scheduled_new_reqs  # no admissions in a preempting step
    assert [r.request_id for r in scheduler.waiting] == ["r2", "late"]
    victim = requests[2]
    assert victim.status == RequestStatus.PREEMPTED
    assert victim.num_computed_tokens == 0
    assert victim.num_preemptions == 1
    assert scheduler.make_stats().num_preemptions == 1
    tokens_at_preemption = list(victim.all_token_ids)

    resumed = None
    for output in _run_to_completion(scheduler):
        for new in output.scheduled_new_reqs:
            if new.req_id == "r2":
                resumed = new
    assert resumed is not None
    assert resumed.token_ids == tokens_at_preemption  # prompt and outputs so far
    # Its tail block was evicted first; its prompt block is hit again.
    assert resumed.num_computed_tokens == BLOCK
    assert len(resumed.block_ids) * BLOCK >= len(resumed.token_ids)
    assert victim.num_output_tokens == 6
    assert victim.status == RequestStatus.FINISHED_LENGTH
    _assert_all_free(scheduler)


def test_request_preempts_itself_when_it_is_last():
    scheduler = _scheduler(num_blocks=3)
    first = _request("a", 4, first_token=100, max_tokens=8)
    second = _request("b", 4, first_token=200, max_tokens=4)
    scheduler.add_request(first)
    scheduler.add_request(second)
    _step(scheduler)  # both admitted, 1 block each, 1 free
    output, _ = _step(scheduler)  # a takes the last block; b has none and preempts itself
    assert output.preempted_req_ids == {"b"}
    assert output.num_scheduled_tokens == {"a": 1}
    _run_to_completion(scheduler)
    assert first.num_output_tokens == 8
    assert second.num_output_tokens == 4
    _assert_all_free(scheduler)


def test_waiting_request_is_not_admitted_without_blocks():
    scheduler = _scheduler(num_blocks=4)
    scheduler.add_request(_request("big", 12, max_tokens=4))  # 3 blocks now, 4 later
    scheduler.add_request(_request("small", 4, first_token=500, max_tokens=1))
    output, _ = _step(scheduler)
    assert set(output.num_scheduled_tokens) == {"big", "small"}  # 3 + 1 blocks
    scheduler.add_request(_request("third", 2, first_token=700, max_tokens=1))
    output, _ = _step(scheduler)
    assert not output.preempted_req_ids
    assert "third" not in output.num_scheduled_tokens  # blocks all held: it waits
    assert [r.request_id for r in scheduler.waiting] == ["third"]
    _run_to_completion(scheduler)
    _assert_all_free(scheduler)


# ----------------------------------------------------------------- abort and cleanup


def test_abort_while_waiting_running_and_preempted_frees_everything():
    scheduler = _scheduler(num_blocks=3, max_seqs=2)
    running = _request("running", 4, first_token=100, max_tokens=8)
    preempted = _request("preempted", 4, first_token=200, max_tokens=4)
    waiting = _request("waiting", 4, first_token=300, max_tokens=4)
    for request in (running, preempted, waiting):
        scheduler.add_request(request)
    _step(scheduler)
    output, _ = _step(scheduler)
    assert output.preempted_req_ids == {"preempted"}
    aborted = scheduler.abort_requests(["waiting", "preempted", "running", "unknown"])
    assert aborted == [waiting, preempted, running]
    assert all(r.status == RequestStatus.FINISHED_ABORTED for r in aborted)
    assert not scheduler.has_unfinished_requests()
    _assert_all_free(scheduler)
    output = scheduler.schedule()
    assert output.is_empty
    assert output.finished_req_ids == {"waiting", "preempted", "running"}
    assert scheduler.schedule().finished_req_ids == set()


def test_abort_between_schedule_and_update_drops_the_result():
    scheduler = _scheduler()
    scheduler.add_request(_request("a", 4))
    output = scheduler.schedule()
    scheduler.abort_requests(["a"])
    outputs = scheduler.update_from_output(
        output, ModelRunnerOutput(req_ids=["a"], sampled_token_ids=[[FILLER]])
    )
    assert outputs == []
    _assert_all_free(scheduler)


def test_blocks_all_free_after_many_requests_finish():
    scheduler = _scheduler(budget=10, max_seqs=3, num_blocks=8)
    for i in range(6):
        scheduler.add_request(_request(f"r{i}", 3 + i, first_token=10 * i, max_tokens=5))
    _run_to_completion(scheduler)
    _assert_all_free(scheduler)
    stats = scheduler.make_stats()
    assert (stats.num_running_reqs, stats.num_waiting_reqs, stats.kv_cache_usage) == (0, 0, 0.0)


# ---------------------------------------------------------------------- admission


def test_request_that_can_never_fit_is_rejected():
    scheduler = _scheduler(num_blocks=4)  # 16 token slots
    with pytest.raises(ValueError, match=r"(?i)lower max_tokens.*raise num_kv_blocks"):
        scheduler.add_request(_request("huge", 10, max_tokens=7))
    scheduler.add_request(_request("fits", 10, max_tokens=6))
    assert scheduler.get_num_unfinished_requests() == 1


def test_duplicate_request_id_is_rejected():
    scheduler = _scheduler()
    scheduler.add_request(_request("a", 4))
    with pytest.raises(ValueError, match="unique id"):
        scheduler.add_request(_request("a", 4))


def test_prefix_hit_and_parallel_samples_share_blocks():
    scheduler = _scheduler()
    children = [_request(f"n-{i}", 9, max_tokens=2) for i in range(3)]
    for child in children:
        scheduler.add_request(child)
    output, outputs = _step(scheduler)
    # The first child's full blocks are cached at allocation; the others hit them.
    new_reqs = {r.req_id: r for r in output.scheduled_new_reqs}
    assert new_reqs["n-0"].num_computed_tokens == 0
    assert new_reqs["n-1"].num_computed_tokens == new_reqs["n-2"].num_computed_tokens == 8
    assert output.num_scheduled_tokens == {"n-0": 9, "n-1": 1, "n-2": 1}
    assert new_reqs["n-0"].block_ids[:2] == new_reqs["n-1"].block_ids[:2]
    assert new_reqs["n-1"].block_ids[:2] == new_reqs["n-2"].block_ids[:2]
    assert [o.num_cached_tokens for o in outputs] == [0, 8, 8]
    stats = scheduler.make_stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (27, 16)
    _run_to_completion(scheduler)
    _assert_all_free(scheduler)


# ---------------------------------------------------------------------------- stops


def _finish_with(request: Request, tokens: list[int], max_model_len: int = 256) -> list[int]:
    return append_token_ids(request, tokens, max_model_len)


def test_eos_stops_unless_ignored():
    request = _request("a", 3, max_tokens=10)
    assert _finish_with(request, [FILLER, EOS, FILLER]) == [FILLER, EOS]
    assert request.status == RequestStatus.FINISHED_STOPPED
    assert request.stop_reason is None
    ignoring = _request("b", 3, max_tokens=3, ignore_eos=True)
    assert _finish_with(ignoring, [EOS, EOS, EOS]) == [EOS, EOS, EOS]
    assert ignoring.status == RequestStatus.FINISHED_LENGTH


def test_stop_token_ids_respect_min_tokens():
    request = _request("a", 3, max_tokens=10, min_tokens=2, stop_token_ids=[42])
    # Below min_tokens neither a stop token nor EOS ends the request.
    assert _finish_with(request, [42, EOS, 42, FILLER]) == [42, EOS]
    assert request.stop_reason is None
    request = _request("b", 3, max_tokens=10, min_tokens=2, stop_token_ids=[42])
    assert _finish_with(request, [EOS, 42, FILLER]) == [EOS, 42]
    assert request.status == RequestStatus.FINISHED_STOPPED
    assert request.stop_reason == 42


def test_length_limits():
    capped = _request("a", 3, max_tokens=2)
    assert _finish_with(capped, [FILLER, FILLER, FILLER]) == [FILLER, FILLER]
    assert capped.status.finish_reason == "length"
    by_context = _request("b", 3, max_tokens=10)
    assert _finish_with(by_context, [FILLER] * 5, max_model_len=5) == [FILLER, FILLER]
    assert by_context.status == RequestStatus.FINISHED_LENGTH
    eos_at_limit = _request("c", 3, max_tokens=1)
    assert _finish_with(eos_at_limit, [EOS]) == [EOS]
    assert eos_at_limit.status.finish_reason == "stop"


def test_scheduler_reports_stop_and_truncates_multi_token_results():
    scheduler = _scheduler()
    request = _request("a", 4, max_tokens=10, stop_token_ids=[42], logprobs=0)
    scheduler.add_request(request)
    output = scheduler.schedule()
    logprobs = LogprobsLists(
        token_ids=[[5], [42], [6]], logprobs=[[-1.0], [-2.0], [-3.0]], ranks=[1, 1, 1]
    )
    outputs = scheduler.update_from_output(
        output,
        ModelRunnerOutput(req_ids=["a"], sampled_token_ids=[[5, 42, 6]], logprobs={"a": logprobs}),
    )
    (result,) = outputs
    assert result.new_token_ids == [5, 42]
    assert (result.finish_reason, result.stop_reason) == ("stop", 42)
    assert result.new_logprobs is not None
    assert result.new_logprobs.token_ids == [[5], [42]]
    assert result.new_logprobs.ranks == [1, 1]
    assert request.output_token_ids == [5, 42]
    _assert_all_free(scheduler)
    assert scheduler.schedule().finished_req_ids == {"a"}


def test_prompt_logprobs_of_a_partial_chunk_are_passed_through():
    scheduler = _scheduler(budget=4)
    scheduler.add_request(_request("a", 10, prompt_logprobs=0))
    output = scheduler.schedule()
    chunk = LogprobsLists(token_ids=[[11], [12], [13]], logprobs=[[-1.0]] * 3, ranks=[1, 1, 1])
    outputs = scheduler.update_from_output(
        output,
        ModelRunnerOutput(req_ids=["a"], sampled_token_ids=[[]], prompt_logprobs={"a": chunk}),
    )
    (result,) = outputs
    assert result.new_token_ids == []
    assert result.new_prompt_logprobs is chunk
    assert not result.finished


def _priority_scheduler(**kwargs) -> OneBudgetScheduler:
    scheduler = _scheduler(**kwargs)
    config = scheduler.config
    return OneBudgetScheduler(
        SchedulerConfig(
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=config.max_model_len,
            scheduling_policy="priority",
        ),
        CacheConfig(block_size=BLOCK),
        scheduler.num_blocks,
    )


def _prioritized(request_id: str, priority: int, arrival: float, **params) -> Request:
    request = _request(request_id, 4, first_token=10 + 10 * arrival, **params)
    request.priority = priority
    request.arrival_time = arrival
    return request


def test_priority_policy_admits_lower_values_first_then_by_arrival():
    scheduler = _priority_scheduler(max_seqs=1)
    for request_id, priority, arrival in [("late-low", 5, 1), ("high", 0, 2), ("low", 5, 0)]:
        scheduler.add_request(_prioritized(request_id, priority, arrival, max_tokens=2))
    started = []
    for output in _run_to_completion(scheduler):
        started += [r.req_id for r in output.scheduled_new_reqs]
    assert started == ["high", "low", "late-low"]
    _assert_all_free(scheduler)


def test_fcfs_policy_ignores_priority_order():
    scheduler = _scheduler(max_seqs=1)
    for request_id, priority, arrival in [("first", 5, 0), ("second", 0, 1)]:
        scheduler.add_request(_prioritized(request_id, priority, arrival, max_tokens=2))
    started = []
    for output in _run_to_completion(scheduler):
        started += [r.req_id for r in output.scheduled_new_reqs]
    assert started == ["first", "second"]


def test_priority_policy_preempts_the_least_urgent_running_request():
    # 6 blocks of 4: two 4-token prompts fit, their growth to 4 + 10 tokens does not.
    scheduler = _priority_scheduler(num_blocks=6)
    scheduler.add_request(_prioritized("low", 3, 0, max_tokens=10, ignore_eos=True))
    _step(scheduler)  # "low" starts alone
    scheduler.add_request(_prioritized("high", 1, 1, max_tokens=10, ignore_eos=True))
    _step(scheduler)
    assert [r.request_id for r in scheduler.running] == ["high", "low"]
    preempted = set()
    for _ in range(40):
        if not scheduler.has_unfinished_requests():
            break
        output, _ = _step(scheduler)
        preempted |= output.preempted_req_ids
    assert preempted == {"low"}  # admitted first, but the less urgent one
    assert scheduler.requests == {}
    _assert_all_free(scheduler)


def test_long_prefill_token_threshold_caps_each_prompts_chunk() -> None:
    scheduler = OneBudgetScheduler(
        SchedulerConfig(
            max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256,
            long_prefill_token_threshold=12,
        ),
        CacheConfig(block_size=BLOCK),
        64,
    )  # fmt: skip
    scheduler.add_request(_request("long", 40))
    scheduler.add_request(_request("short", 5, first_token=100))
    first, _ = _step(scheduler)
    # Each prompt takes at most 12 tokens of the 64, the short one its 5.
    assert first.num_scheduled_tokens == {"long": 12, "short": 5}
    counts = [first.num_scheduled_tokens["long"]]
    for output in _run_to_completion(scheduler):
        if "long" in output.num_scheduled_tokens:
            counts.append(output.num_scheduled_tokens["long"])
    assert counts[:4] == [12, 12, 12, 4] and set(counts[4:]) == {1}


def test_long_prefill_token_threshold_is_checked_at_the_edge(chat_checkpoint) -> None:
    from pagedlm.engine.arg_utils import EngineArgs

    for bad in (-1, 1.5):
        with pytest.raises(ValueError, match="must be a non-negative integer"):
            EngineArgs(
                model=str(chat_checkpoint), long_prefill_token_threshold=bad
            ).create_engine_config()
    with pytest.raises(ValueError, match="prompts run whole here"):
        EngineArgs(
            model=str(chat_checkpoint),
            long_prefill_token_threshold=16,
            enable_chunked_prefill=False,
        ).create_engine_config()
