"""Multi-step decoding (``num_scheduler_steps``): when the scheduler plans several steps,
and what they give back — the same tokens as one step at a time."""

from __future__ import annotations

import random

import pytest

from pagedlm import LLM, SamplingParams
from pagedlm.config import CacheConfig, SchedulerConfig
from pagedlm.core.outputs import ModelRunnerOutput, SchedulerOutput
from pagedlm.core.request import Request
from pagedlm.core.scheduler import OneBudgetScheduler

BLOCK = 4
EOS = 2


def _scheduler(
    steps: int = 4, *, max_seqs: int = 8, num_blocks: int = 64, max_model_len=256, caching=True
):
    return OneBudgetScheduler(
        SchedulerConfig(
            max_num_seqs=max_seqs,
            max_num_batched_tokens=64,
            max_model_len=max_model_len,
            num_scheduler_steps=steps,
        ),
        CacheConfig(block_size=BLOCK, enable_prefix_caching=caching),
        num_blocks,
    )


def _request(request_id: str, num_prompt: int = 6, **params) -> Request:
    params.setdefault("max_tokens", 20)
    return Request(
        request_id, list(range(10, 10 + num_prompt)), SamplingParams(**params), eos_token_ids={EOS}
    )


def _step(scheduler: OneBudgetScheduler, token: int = 7) -> SchedulerOutput:
    """Schedule and answer with ``token`` repeated once per planned step for each sampler."""
    output = scheduler.schedule()
    req_ids = [r.req_id for r in output.scheduled_new_reqs + output.scheduled_cached_reqs]
    sampled = []
    for req_id in req_ids:
        request = scheduler.requests[req_id]
        done = request.num_computed_tokens >= request.num_tokens
        sampled.append([token] * output.num_steps if done else [])
    scheduler.update_from_output(output, ModelRunnerOutput(req_ids, sampled))
    return output


def test_pure_decode_runs_several_steps_with_slots_for_all():
    scheduler = _scheduler(steps=4)
    for i in range(3):
        scheduler.add_request(_request(f"r{i}"))
    assert _step(scheduler).num_steps == 1  # prefill
    output = _step(scheduler)
    assert output.num_steps == 4
    assert output.total_num_scheduled_tokens == 3  # one fed token each; the rest follow
    assert scheduler.num_model_steps == 1 + 4
    for request in scheduler.running:
        # 6 prompt tokens + 1 + 4 sampled; every token but the last has its K/V.
        assert request.num_tokens == 11
        assert request.num_computed_tokens == 10
        # Slots covered positions 6..9 (the four fed tokens) when the steps ran.
        assert len(scheduler.kv_manager.get_block_ids(request)) * BLOCK >= 10


def test_one_step_when_a_waiting_request_could_start():
    scheduler = _scheduler(steps=4, max_seqs=8)
    scheduler.add_request(_request("a"))
    _step(scheduler)
    scheduler.add_request(_request("b"))
    assert _step(scheduler).num_steps == 1  # b is admitted (prefill) this step
    assert _step(scheduler).num_steps == 4


def test_full_batch_still_runs_several_steps_with_requests_waiting():
    scheduler = _scheduler(steps=4, max_seqs=2)
    for i in range(3):
        scheduler.add_request(_request(f"r{i}"))
    _step(scheduler)
    assert len(scheduler.waiting) == 1
    assert _step(scheduler).num_steps == 4  # nothing could start anyway


@pytest.mark.parametrize(
    "params",
    [
        {"logprobs": 2},
        {"presence_penalty": 0.5},
        {"repetition_penalty": 1.2},
        {"min_tokens": 5},
    ],
)
def test_requests_needing_the_host_between_tokens_run_one_step(params):
    scheduler = _scheduler(steps=4)
    scheduler.add_request(_request("plain"))
    scheduler.add_request(_request("special", **params))
    _step(scheduler)
    assert _step(scheduler).num_steps == 1


def test_min_tokens_reached_allows_several_steps():
    scheduler = _scheduler(steps=4)
    scheduler.add_request(_request("a", min_tokens=2))
    _step(scheduler)  # first token
    assert _step(scheduler).num_steps == 1  # 1 < min_tokens
    assert _step(scheduler).num_steps == 4


def test_steps_capped_by_remaining_tokens_and_model_length():
    scheduler = _scheduler(steps=8)
    scheduler.add_request(_request("short", max_tokens=4))
    scheduler.add_request(_request("shorter", max_tokens=2))
    _step(scheduler)
    assert _step(scheduler).num_steps == 3  # the longest has 3 tokens left
    assert not scheduler.has_unfinished_requests()

    scheduler = _scheduler(steps=8, max_model_len=12)
    scheduler.add_request(_request("long", num_prompt=6, max_tokens=100))
    _step(scheduler)  # 7 tokens now; positions 6..11 may still be fed
    assert _step(scheduler).num_steps == 6
    assert not scheduler.has_unfinished_requests()  # reached max_model_len exactly


def test_tokens_after_a_stop_are_dropped():
    scheduler = _scheduler(steps=4)
    scheduler.add_request(_request("a"))
    _step(scheduler)
    output = scheduler.schedule()
    assert output.num_steps == 4
    runner = ModelRunnerOutput(["a"], [[7, EOS, 7, 7]])
    (result,) = scheduler.update_from_output(output, runner)
    assert result.new_token_ids == [7, EOS]
    assert result.finish_reason == "stop"
    assert scheduler.kv_manager.num_free_blocks == scheduler.kv_manager.num_blocks


def test_short_memory_falls_back_to_one_step():
    # 2 requests of 6 prompt tokens + 1 sampled: 2 blocks each of the 5; 4 more tokens
    # would need a third block for each, and only one is free (no prefix sharing).
    scheduler = _scheduler(steps=4, num_blocks=5, caching=False)
    scheduler.add_request(_request("a", max_tokens=6))
    scheduler.add_request(_request("b", max_tokens=6))
    _step(scheduler)
    output = _step(scheduler)
    assert output.num_steps == 1
    assert scheduler.num_preemptions == 0


def _prompts(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [
        {"prompt_token_ids": [rng.randrange(384) for _ in range(rng.randint(3, 60))]}
        for _ in range(n)
    ]


def test_multi_step_generates_what_single_steps_generate(tiny_checkpoint):
    path = str(tiny_checkpoint("llama"))
    rng = random.Random(0)
    prompts = _prompts(12, 1)
    params = (
        [SamplingParams(temperature=0, max_tokens=rng.randint(1, 40), ignore_eos=True)] * 4
        + [
            SamplingParams(temperature=0.9, top_p=0.9, seed=i, max_tokens=30, ignore_eos=True)
            for i in range(4)
        ]
        + [SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[3, 5, 8, 13, 21])] * 4
    )
    results = {}
    planned: list[int] = []
    for steps in (1, 8):
        # 24 blocks of 16 tokens for 12 requests of up to 100 tokens: preemption happens.
        llm = LLM(
            path,
            skip_tokenizer_init=True,
            num_scheduler_steps=steps,
            max_num_seqs=8,
            num_kv_blocks=24,
        )
        scheduler = llm.llm_engine.engine_core.scheduler
        schedule = scheduler.schedule

        def counting_schedule(schedule=schedule):
            output = schedule()
            planned.append(output.num_steps)
            return output

        scheduler.schedule = counting_schedule
        outs = llm.generate(prompts, params, use_tqdm=False)
        results[steps] = [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outs]
    assert results[8] == results[1]
    assert max(planned) > 1  # the multi-step path did run


def _append_one_by_one(request: Request, token_ids: list[int], max_model_len: int) -> list[int]:
    from pagedlm.core.stop_checker import check_stop

    appended = []
    for token_id in token_ids:
        request.append_output_token_ids([token_id])
        appended.append(token_id)
        if check_stop(request, max_model_len):
            break
    return appended


def test_appending_several_tokens_stops_where_one_by_one_would():
    from pagedlm.core.stop_checker import append_token_ids

    rng = random.Random(0)
    for trial in range(400):
        params = {
            "max_tokens": rng.randint(1, 12),
            "min_tokens": rng.choice([0, 0, 3]),
            "ignore_eos": rng.random() < 0.5,
            "stop_token_ids": rng.choice([None, [5], [5, 6]]),
        }
        params["min_tokens"] = min(params["min_tokens"], params["max_tokens"])
        tokens = [rng.choice([2, 5, 6, 7, 8, 9]) for _ in range(rng.randint(1, 10))]
        prefix = [7] * rng.randint(0, 4)
        max_model_len = rng.choice([16, 12, 9])
        results = []
        for append in (append_token_ids, _append_one_by_one):
            request = _request(f"r{trial}", num_prompt=4, **params)
            request.append_output_token_ids(prefix[: params["max_tokens"] - 1])
            appended = append(request, tokens, max_model_len)
            results.append((appended, request.status, request.stop_reason, request.num_tokens))
        assert results[0] == results[1], (params, prefix, tokens, max_model_len)


def test_multi_step_stop_strings_cut_where_single_steps_do(smollm2_path):
    """Stop strings are found by the output processor, which now sees up to eight tokens
    at once: text, token ids and reasons must match one token at a time."""
    prompts = ["The capital of France is", "List three colors:", "Once upon a time", "def f(n):"]
    params = SamplingParams(temperature=0, max_tokens=40, stop=[".", "\n\n", " a "])
    results = []
    for steps in (1, 8):
        llm = LLM(smollm2_path, num_scheduler_steps=steps)
        outs = llm.generate(prompts, params, use_tqdm=False)
        results.append(
            [
                (c.text, c.token_ids, c.finish_reason, c.stop_reason)
                for c in (o.outputs[0] for o in outs)
            ]
        )
    assert results[0] == results[1]
    assert {stop for _, _, _, stop in results[0]} >= {".", " a "}  # stops did cut


def _answer(output: SchedulerOutput, tokens: dict[str, list[int]]) -> ModelRunnerOutput:
    req_ids = [r.req_id for r in output.scheduled_new_reqs + output.scheduled_cached_reqs]
    return ModelRunnerOutput(req_ids, [tokens.get(r, [7] * output.num_steps) for r in req_ids])


def test_chained_window_continues_before_the_tokens_are_known():
    scheduler = _scheduler(steps=4)
    scheduler.add_request(_request("long", max_tokens=20))
    scheduler.add_request(_request("short", max_tokens=5))  # ends by length in window 1
    scheduler.add_request(_request("eos", max_tokens=20))  # ends on EOS in window 1
    _step(scheduler)  # prefill: one token each
    first = scheduler.schedule()
    assert first.num_steps == 4
    computed = {r: scheduler.requests[r].num_computed_tokens for r in ("long", "eos")}
    following = scheduler.schedule_continuation(first)
    assert following is not None and following.inputs_from_previous
    # "short" reaches max_tokens inside the first window: it is not continued.
    assert [d.req_id for d in following.scheduled_cached_reqs] == ["long", "eos"]
    for data in following.scheduled_cached_reqs:
        # It starts where the first window ends (which fed 4 tokens from `computed - 1`).
        assert data.num_computed_tokens == computed[data.req_id] + 3
    assert following.num_steps == 4
    scheduler.update_from_output(first, _answer(first, {"eos": [7, EOS, 7, 7]}))
    eos = [o for o in scheduler.update_from_output(following, _answer(following, {}))]
    # The chained window's tokens for the request that stopped are dropped.
    assert [o.req_id for o in eos] == ["long"] and len(eos[0].new_token_ids) == 4
    long = scheduler.requests["long"]
    assert long.num_output_tokens == 9 and long.num_computed_tokens == long.num_tokens - 1
    assert set(scheduler.requests) == {"long"}
    table = scheduler.kv_manager.get_block_ids(long)
    assert len(table) * BLOCK >= long.num_computed_tokens + 1


def test_no_chained_window_while_requests_wait_or_memory_is_short():
    scheduler = _scheduler(steps=4)
    scheduler.add_request(_request("a"))
    _step(scheduler)
    first = scheduler.schedule()
    scheduler.add_request(_request("b"))  # arrives while the window runs
    assert scheduler.schedule_continuation(first) is None
    scheduler.update_from_output(first, _answer(first, {}))

    # 7 blocks of 4: two requests fit one window (3 blocks each), not a second one.
    tight = _scheduler(steps=4, num_blocks=7, caching=False)
    tight.add_request(_request("a"))
    tight.add_request(_request("b"))
    _step(tight)
    first = tight.schedule()
    free_before = tight.kv_manager.num_free_blocks
    assert tight.schedule_continuation(first) is None
    assert tight.kv_manager.num_free_blocks == free_before  # nothing half-allocated


def test_chained_windows_generate_what_single_steps_generate(tiny_checkpoint):
    path = str(tiny_checkpoint("llama"))
    rng = random.Random(3)
    prompts = _prompts(10, 2)
    params = (
        [SamplingParams(temperature=0, max_tokens=rng.randint(5, 60), ignore_eos=True)] * 3
        + [
            SamplingParams(temperature=0.8, seed=i, max_tokens=rng.randint(5, 60), ignore_eos=True)
            for i in range(3)
        ]
        + [SamplingParams(temperature=0, max_tokens=60, stop_token_ids=[3, 5, 8, 13, 21])] * 4
    )
    results = {}
    chained = []
    for steps in (1, 8):
        llm = LLM(path, skip_tokenizer_init=True, num_scheduler_steps=steps, max_num_seqs=16)
        scheduler = llm.llm_engine.engine_core.scheduler
        continuation = scheduler.schedule_continuation

        def counting(previous, continuation=continuation):
            output = continuation(previous)
            chained.append(output is not None)
            return output

        scheduler.schedule_continuation = counting
        outs = llm.generate(prompts, params, use_tqdm=False)
        results[steps] = [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outs]
        assert scheduler.kv_manager.usage == 0  # every block came back
    assert results[8] == results[1]
    assert sum(chained) >= 2  # windows did chain


def test_abort_while_a_chained_window_is_queued(tiny_checkpoint):
    """A request aborted between steps, while the window after the current one is
    already queued, reports nothing more; the others finish and every block comes back."""
    llm = LLM(str(tiny_checkpoint("llama")), skip_tokenizer_init=True, num_scheduler_steps=4)
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    for i, prompt in enumerate(_prompts(3, 5)):
        engine.add_request(f"r{i}", prompt, params)
    tokens: dict[str, int] = {}
    aborted_at = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id] = len(out.outputs[0].token_ids)
        core = engine.engine_core
        if aborted_at is None and core.has_queued_window:
            aborted_at = tokens.get("r1", 0)
            engine.abort_request(["r1"])
    assert aborted_at is not None  # a window was queued when r1 was aborted
    assert tokens["r1"] == aborted_at
    assert tokens["r0"] == tokens["r2"] == 30
    while core.has_unfinished_requests():  # collect a window queued for aborted work
        core.step()
    assert core.scheduler.kv_manager.usage == 0
