"""Requests the workers fail in a step (``ModelRunnerOutput.failed``: an adapter that could
not be read ran them without it) under asynchronous scheduling: whatever happened to the
request while that step was in flight, the blocks it computed leave the prefix cache."""

from __future__ import annotations

from pagedlm.config import CacheConfig, SchedulerConfig
from pagedlm.core.request import Request
from pagedlm.core.scheduler import OneBudgetScheduler
from pagedlm.lora.request import LoRARequest
from pagedlm.sampling_params import SamplingParams
from pagedlm.step import ModelRunnerOutput, SchedulerOutput

BLOCK = 4
EOS = 2
ADAPTER = LoRARequest("x", 1, "/adapters/x")
PROMPT = list(range(30, 38))  # two full blocks


def _scheduler(num_blocks: int) -> OneBudgetScheduler:
    return OneBudgetScheduler(
        SchedulerConfig(
            max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64, async_scheduling=True
        ),
        CacheConfig(block_size=BLOCK),
        num_blocks,
        max_loras=2,
    )


def _request(request_id: str, prompt: list[int], lora: LoRARequest | None = None) -> Request:
    params = SamplingParams(max_tokens=8)
    return Request(request_id, prompt, params, eos_token_ids={EOS}, lora_request=lora)


def _collect(scheduler: OneBudgetScheduler, step: SchedulerOutput, failed: dict[str, str]):
    sampled = [[7] for _ in step.req_ids]
    output = ModelRunnerOutput(step.req_ids, sampled, failed=failed)
    return scheduler.update_from_output(step, output)


def _hit(scheduler: OneBudgetScheduler) -> int:
    """Prompt tokens a new request of the adapter with the failed prompt would hit."""
    again = _request("again", PROMPT, ADAPTER)
    return scheduler.kv_manager.get_computed_blocks(again).num_computed_tokens


def test_a_request_preempted_while_its_failing_step_ran_leaves_no_block_cached():
    """The schedule made while the failing step ran preempted the request (its blocks
    freed, still hashed); the failure collected then found no table to uncache, and a
    later request of the adapter hit the K/V computed without it."""
    scheduler = _scheduler(num_blocks=4)
    scheduler.add_request(_request("a", list(range(10, 18))))
    scheduler.add_request(_request("r", PROMPT, ADAPTER))
    first = scheduler.schedule()
    second = scheduler.schedule()  # "a" needs a third block: "r" is preempted
    assert second.preempted_req_ids == {"r"}
    outputs = _collect(scheduler, first, {"r": "adapter x could not be read"})
    assert [(o.req_id, o.finish_reason) for o in outputs] == [("a", None), ("r", "error")]
    assert _hit(scheduler) == 0
    _collect(scheduler, second, {})
    while scheduler.has_unfinished_requests():
        _collect(scheduler, scheduler.schedule(), {})
    _collect(scheduler, scheduler.schedule(), {})
    assert scheduler.kv_manager.num_free_blocks == 4


def test_a_request_aborted_while_its_failing_step_ran_leaves_no_block_cached():
    """Aborted before the step that failed it was collected: the failure was dropped with
    the step's other entries for it, and its freed blocks stayed hashed."""
    scheduler = _scheduler(num_blocks=16)
    scheduler.add_request(_request("r", PROMPT, ADAPTER))
    first = scheduler.schedule()
    scheduler.abort_requests(["r"])
    assert _collect(scheduler, first, {"r": "adapter x could not be read"}) == []
    assert _hit(scheduler) == 0
