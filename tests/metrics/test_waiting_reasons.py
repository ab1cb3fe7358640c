"""vLLM's ``num_requests_waiting_by_reason``: the scheduler's count of waiting requests a
transient constraint holds back ("deferred": a grammar compiling, one LoRA adapter too
many, a step in flight) beside those waiting for capacity, and its export. Pure Python,
no model (the KV-transfer case is in ``tests/kv_transfer``)."""

from __future__ import annotations

from pagedlm.config import CacheConfig, SchedulerConfig
from pagedlm.core.request import Request, RequestStatus
from pagedlm.core.scheduler import OneBudgetScheduler
from pagedlm.core.scheduler_interface import SchedulerStats
from pagedlm.lora.request import LoRARequest
from pagedlm.metrics import EngineMetrics
from pagedlm.sampling_params import SamplingParams, StructuredOutputsParams
from pagedlm.step import ModelRunnerOutput, SchedulerOutput


class CompilingGrammars:
    """A structured-output manager whose grammars compile when the test says so."""

    def __init__(self) -> None:
        self.compiled: set[str] = set()

    def add_request(self, request: Request) -> None:
        pass

    def is_ready(self, request_id: str) -> bool:
        return request_id in self.compiled

    def wait_for_any(self, request_ids: list[str], timeout: float) -> None:
        pass

    def remove(self, request_id: str) -> None:
        self.compiled.discard(request_id)


def scheduler(max_num_seqs: int = 8, **kwargs) -> OneBudgetScheduler:
    return OneBudgetScheduler(
        SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=64, max_model_len=64),
        CacheConfig(block_size=4),
        32,
        **kwargs,
    )


def request(request_id: str, lora: str | None = None, grammar: bool = False) -> Request:
    params = SamplingParams(
        max_tokens=4, structured_outputs=StructuredOutputsParams(regex="a") if grammar else None
    )
    adapter = None
    if lora is not None:
        adapter = LoRARequest(lora, {"sql": 1, "chat": 2}[lora], f"/adapters/{lora}")
    return Request(request_id, [1, 2, 3, 4, 5], params, set(), lora_request=adapter)


def waiting(scheduler: OneBudgetScheduler) -> tuple[int, int]:
    """(capacity, deferred), as exported."""
    stats = scheduler.make_stats()
    return stats.num_waiting_reqs - stats.num_deferred_reqs, stats.num_deferred_reqs


def collect(scheduler: OneBudgetScheduler, output: SchedulerOutput) -> None:
    """The fake workers: every request that finished its prompt samples token 9."""
    sampled = [
        [9] if scheduler.requests[r].num_computed_tokens >= scheduler.requests[r].num_tokens else []
        for r in output.req_ids
    ]
    scheduler.update_from_output(output, ModelRunnerOutput(output.req_ids, sampled))


def test_requests_behind_a_full_batch_wait_for_capacity():
    sched = scheduler(max_num_seqs=1)
    for request_id in ("a", "b", "c"):
        sched.add_request(request(request_id))
    assert waiting(sched) == (3, 0)
    collect(sched, sched.schedule())
    assert waiting(sched) == (2, 0)


def test_a_compiling_grammar_is_deferred_until_it_is_admitted():
    grammars = CompilingGrammars()
    sched = scheduler(structured_output=grammars)
    sched.add_request(request("constrained", grammar=True))
    sched.add_request(request("plain"))
    assert waiting(sched) == (1, 1)
    collect(sched, sched.schedule())  # the plain request starts past the compiling one
    assert sched.requests["constrained"].status == RequestStatus.WAITING_FOR_GRAMMAR
    assert waiting(sched) == (0, 1)
    grammars.compiled.add("constrained")
    assert set(sched.schedule().num_scheduled_tokens) == {"constrained", "plain"}
    assert waiting(sched) == (0, 0)


def test_one_adapter_too_many_is_deferred_and_the_seats_it_leaves_are_capacity():
    """max_loras=1: a request of a second adapter is skipped (deferred) while one of the
    running adapter's starts behind it; once the seats are full the rest wait for them."""
    sched = scheduler(max_num_seqs=2, max_loras=1)
    for request_id, lora in (("sql-1", "sql"), ("chat", "chat"), ("sql-2", "sql"), ("p", None)):
        sched.add_request(request(request_id, lora))
    # Before any step: the first adapter takes the slot, so the second's request defers.
    assert waiting(sched) == (3, 1)
    output = sched.schedule()
    assert set(output.num_scheduled_tokens) == {"sql-1", "sql-2"}
    collect(sched, output)
    assert waiting(sched) == (1, 1)  # "chat" deferred, "p" waits for a seat
    sched.abort_requests(["sql-1", "sql-2"])
    assert waiting(sched) == (2, 0)  # the slot is free: both wait for nothing else


def test_a_preempted_request_whose_step_is_in_flight_is_deferred():
    """The pipeline-parallel batch queue skips a request a launched step still holds."""
    sched = scheduler(disjoint_steps=True)
    sched.add_request(request("a"))
    output = sched.schedule()
    assert sched.preempt_running() == 1
    assert waiting(sched) == (0, 1)
    collect(sched, output)
    assert waiting(sched) == (1, 0)


def test_the_reasons_are_exported_per_engine_and_add_up_to_the_waiting():
    metrics = EngineMetrics(max_model_len=64)
    stats = SchedulerStats(1, 5, 0.5, 0, 0, 0, num_deferred_reqs=2)
    by_reason = {
        m.labels["reason"]: m.value
        for m in metrics.snapshot(stats)
        if m.name == "pagedlm:num_requests_waiting_by_reason"
    }
    assert by_reason == {"capacity": 3, "deferred": 2}
    idle = metrics.snapshot(SchedulerStats(0, 0, 0.0, 0, 0, 0))
    by_reason = {
        (m.labels["engine"], m.labels["reason"]): m.value
        for m in idle
        if m.name == "pagedlm:num_requests_waiting_by_reason"
    }
    assert by_reason == {("0", "capacity"): 0, ("0", "deferred"): 0}  # both, 0 included


def test_an_aborted_compiling_request_leaves_no_deferred_count_behind():
    grammars = CompilingGrammars()
    sched = scheduler(structured_output=grammars)
    sched.add_request(request("constrained", grammar=True))
    sched.add_request(request("plain"))
    assert sched.grammars.compiling == {"constrained"}
    sched.abort_requests(["constrained"])
    assert sched.grammars.compiling == set()
    assert waiting(sched) == (1, 0)


class Unwalkable(list):
    """A waiting queue that fails if walked: the common step must not walk it."""

    def __iter__(self):
        raise AssertionError("the waiting queue was walked")


def test_a_step_where_nothing_is_held_back_does_not_walk_the_queue():
    from pagedlm.core.waiting_reasons import count_deferred
    from pagedlm.lora.scheduler_gate import LoRAGate

    queue = Unwalkable([request(str(i)) for i in range(3)])
    assert count_deferred(queue, [], LoRAGate(None), (), num_held=0) == 0
    compiling = request("c", grammar=True)
    compiling.status = RequestStatus.WAITING_FOR_GRAMMAR
    assert count_deferred([request("a"), compiling], [], LoRAGate(None), (), num_held=1) == 1
