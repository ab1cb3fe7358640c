"""The scheduler's side of KV transfer (``core/external_kv.py``) with a fake connector and
a fake model runner: pure Python, no model."""

from __future__ import annotations

from pagedlm.config import CacheConfig, SchedulerConfig
from pagedlm.core.outputs import EngineCoreOutput
from pagedlm.core.request import Request, RequestStatus
from pagedlm.core.scheduler import OneBudgetScheduler
from pagedlm.kv_cache.hashing import update_block_hashes
from pagedlm.kv_transfer.base import KVConnectorBase
from pagedlm.sampling_params import SamplingParams
from pagedlm.step import (
    BlockTransfer,
    KVConnectorMetadata,
    KVConnectorOutput,
    ModelRunnerOutput,
    SchedulerOutput,
)

BLOCK = 4
NUM_BLOCKS = 32


class FakeConnector(KVConnectorBase):
    """Scheduler side only: the blocks whose digests are in ``stored`` can be loaded."""

    def __init__(self) -> None:  # no EngineConfig: the scheduler needs none
        self.stored: set[bytes] = set()
        self.planned: list[BlockTransfer] = []
        self.finished: list[str] = []

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        hashes = update_block_hashes(request, BLOCK)
        last = (request.num_tokens - 1) // BLOCK
        index = num_computed_tokens // BLOCK
        while index < min(last, len(hashes)) and hashes[index] in self.stored:
            index += 1
        return max(0, index * BLOCK - num_computed_tokens)

    def update_state_after_alloc(self, request, block_ids, num_external_tokens) -> None:
        if num_external_tokens:
            first = request.num_computed_tokens // BLOCK
            end = first + num_external_tokens // BLOCK
            keys = [h.hex() for h in request.block_hashes[first:end]]
            self.planned.append(BlockTransfer(request.request_id, block_ids[first:end], keys))

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        loads, self.planned = self.planned, []
        return KVConnectorMetadata(loads=loads)

    def request_finished(self, request: Request) -> None:
        self.finished.append(request.request_id)

    def register_kv_caches(self, blocks) -> None:
        raise AssertionError("scheduler side only")

    def start_load_kv(self, metadata) -> None:
        raise AssertionError("scheduler side only")

    def wait_for_save(self, metadata) -> None:
        raise AssertionError("scheduler side only")

    def get_connector_output(self):
        raise AssertionError("scheduler side only")


def make(
    max_seqs: int = 8, num_blocks: int = NUM_BLOCKS, **config
) -> tuple[OneBudgetScheduler, FakeConnector]:
    connector = FakeConnector()
    scheduler = OneBudgetScheduler(
        SchedulerConfig(
            max_num_seqs=max_seqs, max_num_batched_tokens=64, max_model_len=128, **config
        ),
        CacheConfig(block_size=BLOCK),
        num_blocks,
        kv_connector=connector,
    )
    return scheduler, connector


def request(request_id: str, prompt: list[int]) -> Request:
    return Request(request_id, list(prompt), SamplingParams(max_tokens=2), eos_token_ids=set())


def store(connector: FakeConnector, prompt: list[int], num_blocks: int) -> None:
    connector.stored.update(update_block_hashes(request("x", prompt), BLOCK)[:num_blocks])


def collect(
    scheduler: OneBudgetScheduler,
    output: SchedulerOutput,
    invalid: set[int] = frozenset(),
) -> list[EngineCoreOutput]:
    """The fake workers: every load ends (``invalid`` blocks failing), samples token 7;
    returns the scheduler's outputs."""
    report = None
    if output.kv_connector_metadata is not None:
        loads = output.kv_connector_metadata.loads
        report = KVConnectorOutput(
            finished_recving={t.req_id for t in loads}, invalid_block_ids=set(invalid)
        )
    req_ids = output.req_ids
    sampled = []
    for req_id in req_ids:
        state = scheduler.requests[req_id]
        sampled.append([7] if state.num_computed_tokens >= state.num_tokens else [])
    runner_output = ModelRunnerOutput(req_ids, sampled, kv_connector_output=report)
    return scheduler.update_from_output(output, runner_output)


PROMPT = list(range(100, 114))  # 14 tokens: 3 full blocks may load, the last is computed


def test_a_stored_prefix_loads_in_a_step_of_its_own_then_counts_as_computed():
    scheduler, connector = make()
    store(connector, PROMPT, 4)
    req = request("a", PROMPT)
    scheduler.add_request(req)

    first = scheduler.schedule()
    assert first.is_empty and first.num_scheduled_tokens == {}
    (load,) = first.kv_connector_metadata.loads
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    table = scheduler.kv_manager.get_block_ids(req)
    assert len(table) == 4 and load.block_ids == table[:3]  # slots for the whole prompt
    collect(scheduler, first)

    second = scheduler.schedule()
    (new,) = second.scheduled_new_reqs
    assert (new.num_computed_tokens, second.num_scheduled_tokens) == (12, {"a": 2})
    assert new.block_ids == table
    assert req.num_cached_tokens == 12 and req.num_external_computed_tokens == 12
    assert scheduler.external.num_loaded_tokens == 12


def test_blocks_after_a_failed_one_are_computed_and_never_hit_before_loading():
    scheduler, connector = make()
    store(connector, PROMPT, 3)
    req = request("a", PROMPT)
    scheduler.add_request(req)
    first = scheduler.schedule()
    table = scheduler.kv_manager.get_block_ids(req)
    # While the load is in flight no block of it is in the prefix cache.
    assert scheduler.kv_manager.get_computed_blocks(request("probe", PROMPT)).blocks == ()
    collect(scheduler, first, invalid={table[1]})
    hit = scheduler.kv_manager.get_computed_blocks(request("probe", PROMPT))
    assert [b.block_id for b in hit.blocks] == table[:1]  # the failed blocks are not indexed

    second = scheduler.schedule()
    assert second.num_scheduled_tokens == {"a": 10}  # from block 1 on
    assert req.num_cached_tokens == 4
    assert scheduler.external.num_failed_tokens == 8
    # Blocks 1 and 2 are indexed by the step that computes them, as any scheduled block.
    hit = scheduler.kv_manager.get_computed_blocks(request("probe", PROMPT))
    assert [b.block_id for b in hit.blocks] == table[:3]


def test_an_aborted_loading_request_frees_its_blocks_and_its_late_report_is_ignored():
    scheduler, connector = make()
    store(connector, PROMPT, 3)
    scheduler.add_request(request("a", PROMPT))
    first = scheduler.schedule()
    assert scheduler.kv_manager.num_free_blocks == NUM_BLOCKS - 4
    scheduler.abort_requests(["a"])
    assert scheduler.kv_manager.num_free_blocks == NUM_BLOCKS
    assert connector.finished == ["a"]
    collect(scheduler, first)  # the load step reports a request that is gone
    assert not scheduler.has_unfinished_requests()
    assert scheduler.external.num_holding == 0


def test_a_load_waits_for_a_seat():
    scheduler, connector = make(max_seqs=1)
    store(connector, PROMPT, 3)
    scheduler.add_request(request("runs", [1, 2, 3]))
    scheduler.add_request(request("loads", PROMPT))
    first = scheduler.schedule()
    assert first.num_scheduled_tokens == {"runs": 3} and first.kv_connector_metadata is None
    collect(scheduler, first)
    while "runs" in scheduler.requests:
        collect(scheduler, scheduler.schedule())
    output = scheduler.schedule()
    assert [t.req_id for t in output.kv_connector_metadata.loads] == ["loads"]


def test_preempting_for_a_pause_releases_loaded_blocks():
    scheduler, connector = make()
    store(connector, PROMPT, 3)
    req = request("a", PROMPT)
    scheduler.add_request(req)
    collect(scheduler, scheduler.schedule())
    assert scheduler.external.is_loaded(req)
    scheduler.preempt_running()
    assert scheduler.kv_manager.num_free_blocks == NUM_BLOCKS
    assert scheduler.reset_prefix_cache()
    # Resumed, it loads again from storage.
    again = scheduler.schedule()
    assert [t.req_id for t in again.kv_connector_metadata.loads] == ["a"]


def run_to_completion(scheduler: OneBudgetScheduler, max_steps: int = 60) -> list[str]:
    """Steps until every request ends; returns the order they ended in. A hang fails."""
    ended = []
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            return ended
        before = set(scheduler.requests)
        collect(scheduler, scheduler.schedule())
        ended += sorted(before - set(scheduler.requests))
    raise AssertionError(
        f"no progress: waiting {[(r.request_id, r.status.name) for r in scheduler.waiting]}, "
        f"running {[r.request_id for r in scheduler.running]}, "
        f"{scheduler.kv_manager.num_free_blocks} blocks free"
    )


def test_a_loaded_request_gives_its_blocks_back_before_a_running_one_is_preempted():
    scheduler, connector = make(num_blocks=5)
    store(connector, PROMPT, 3)
    runs = Request("runs", [1, 2, 3, 4], SamplingParams(max_tokens=12), eos_token_ids=set())
    scheduler.add_request(runs)
    scheduler.add_request(request("loads", PROMPT))
    first = scheduler.schedule()  # "loads" takes the 4 blocks "runs" does not hold
    assert [t.req_id for t in first.kv_connector_metadata.loads] == ["loads"]
    assert scheduler.kv_manager.num_free_blocks == 0
    collect(scheduler, first)

    second = scheduler.schedule()  # "runs" needs a second block: the loaded ones go back
    assert second.num_scheduled_tokens == {"runs": 1} and not second.preempted_req_ids
    assert scheduler.external.num_holding == 0
    collect(scheduler, second)
    assert run_to_completion(scheduler) == ["runs", "loads"]
    assert scheduler.num_preemptions == 0


def test_a_head_that_cannot_be_admitted_takes_back_the_blocks_of_loaded_requests():
    scheduler, connector = make(num_blocks=5, scheduling_policy="priority")
    store(connector, PROMPT, 3)
    scheduler.add_request(request("loads", PROMPT))
    collect(scheduler, scheduler.schedule())
    assert scheduler.external.is_loaded(scheduler.requests["loads"])
    urgent = Request("urgent", list(range(8)), SamplingParams(max_tokens=2), priority=-1)
    scheduler.add_request(urgent)  # ahead of "loads"; needs 3 blocks, 1 is free

    output = scheduler.schedule()
    assert output.num_scheduled_tokens == {"urgent": 8}
    assert not scheduler.external.is_loaded(scheduler.requests["loads"])
    collect(scheduler, output)
    assert run_to_completion(scheduler) == ["urgent", "loads"]


def test_a_head_with_stored_blocks_takes_back_the_seats_of_loaded_requests():
    scheduler, connector = make(num_blocks=32, max_seqs=1, scheduling_policy="priority")
    urgent_prompt = list(range(200, 214))
    store(connector, PROMPT, 3)
    store(connector, urgent_prompt, 3)
    scheduler.add_request(request("loads", PROMPT))
    collect(scheduler, scheduler.schedule())
    urgent = Request("urgent", urgent_prompt, SamplingParams(max_tokens=2), priority=-1)
    scheduler.add_request(urgent)  # ahead of "loads", whose load holds the only seat

    output = scheduler.schedule()
    assert [t.req_id for t in output.kv_connector_metadata.loads] == ["urgent"]
    collect(scheduler, output)
    # "loads" finds its released blocks as a local hit, with nothing left to load.
    assert sorted(run_to_completion(scheduler)) == ["loads", "urgent"]


def collect_in_flight(scheduler: OneBudgetScheduler, output: SchedulerOutput) -> None:
    """The fake workers for a step collected after the next was scheduled: a request samples
    token 7 when the step reaches past its prompt (its count at collection may differ)."""
    report = None
    if output.kv_connector_metadata is not None:
        loads = output.kv_connector_metadata.loads
        report = KVConnectorOutput(finished_recving={t.req_id for t in loads})
    sampled = [
        [7]
        if start + output.num_scheduled_tokens[req_id]
        >= len(scheduler.requests[req_id].prompt_token_ids)
        else []
        for req_id, start in zip(output.req_ids, output.num_computed_tokens, strict=True)
    ]
    runner_output = ModelRunnerOutput(output.req_ids, sampled, kv_connector_output=report)
    scheduler.update_from_output(output, runner_output)


def test_a_preempted_head_takes_back_blocks_loaded_while_its_step_was_in_flight():
    scheduler, connector = make(num_blocks=5, async_scheduling=True)
    store(connector, PROMPT, 3)
    runs = Request("runs", [1, 2, 3, 4], SamplingParams(max_tokens=12), eos_token_ids=set())
    scheduler.add_request(runs)
    scheduler.add_request(request("loads", PROMPT))
    in_flight = scheduler.schedule()  # "runs" computes its prompt, "loads" loads
    assert scheduler.kv_manager.num_free_blocks == 0
    # "runs" needs a second block while the load (not releasable) is in flight.
    in_flight, collected = scheduler.schedule(), in_flight
    assert in_flight.preempted_req_ids == {"runs"}
    collect_in_flight(scheduler, collected)
    assert scheduler.external.is_loaded(scheduler.requests["loads"])

    ended = []
    for _ in range(40):  # the preempted head needs the loaded request's blocks
        if not scheduler.has_unfinished_requests():
            break
        before = set(scheduler.requests)
        in_flight, collected = scheduler.schedule(), in_flight
        collect_in_flight(scheduler, collected)
        ended += sorted(before - set(scheduler.requests))
    collect_in_flight(scheduler, in_flight)
    assert ended == ["runs", "loads"] and not scheduler.has_unfinished_requests()


def test_connector_queries_and_hits_count_once_per_admission():
    """vLLM's ``external_prefix_cache_queries``/``_hits``: each admitted request's prompt
    tokens past its local hit, and of those the ones the connector had; the admission of
    a request whose load finished, and a preempted request's, add nothing. The admissions
    are counted too (``external_prefix_cache_requests``: the log line's hit-rate window)."""
    scheduler, connector = make()
    store(connector, PROMPT, 3)

    def counts() -> tuple[int, int]:
        stats = scheduler.make_stats()
        requests.append(stats.external_prefix_cache_requests)
        return stats.external_prefix_cache_queries, stats.external_prefix_cache_hits

    requests: list[int] = []

    def long_request(request_id: str, prompt: list[int]) -> Request:
        return Request(request_id, prompt, SamplingParams(max_tokens=8), eos_token_ids=set())

    scheduler.add_request(long_request("a", PROMPT))
    collect(scheduler, scheduler.schedule())  # the load: 14 tokens asked for, 12 stored
    assert counts() == (14, 12)
    collect(scheduler, scheduler.schedule())  # admitted with its loaded blocks
    assert counts() == (14, 12)
    scheduler.add_request(long_request("b", PROMPT))  # its 3 blocks hit locally now
    scheduler.add_request(long_request("c", [1, 2, 3, 4, 5, 6]))  # nothing stored
    collect(scheduler, scheduler.schedule())
    assert counts() == (14 + 2 + 6, 12)
    assert scheduler.preempt_running() == 3
    collect(scheduler, scheduler.schedule())  # all three resume
    assert [req.num_preemptions for req in scheduler.requests.values()] == [1, 1, 1]
    assert counts() == (14 + 2 + 6, 12)
    assert requests == [1, 1, 3, 3]


def test_outputs_split_the_cached_tokens_into_loaded_and_local_hits():
    """vLLM's ``num_external_computed_tokens`` beside ``num_cached_tokens`` (the front
    end's ``prompt_tokens_by_source``): a loaded prefix is external; the same prefix, in
    the prefix cache since, is a local hit for the next request."""
    scheduler, connector = make()
    store(connector, PROMPT, 3)
    scheduler.add_request(request("a", PROMPT))
    collect(scheduler, scheduler.schedule())  # the load
    (first,) = collect(scheduler, scheduler.schedule())
    assert (first.num_cached_tokens, first.num_external_computed_tokens) == (12, 12)
    scheduler.add_request(request("b", PROMPT))
    (first,) = [out for out in collect(scheduler, scheduler.schedule()) if out.req_id == "b"]
    assert (first.num_cached_tokens, first.num_external_computed_tokens) == (12, 0)


def test_the_split_is_the_first_admissions_like_the_cached_count():
    """A request preempted mid-prefill and loaded again (less, this time) reports the
    split of its first admission, as its ``num_cached_tokens`` is: loaded tokens never
    exceed the cached ones."""
    scheduler, connector = make(long_prefill_token_threshold=4)
    prompt = list(range(300, 324))  # 6 blocks
    store(connector, prompt, 3)
    scheduler.add_request(request("a", prompt))
    collect(scheduler, scheduler.schedule())  # loads 12 tokens
    assert collect(scheduler, scheduler.schedule()) == []  # 4 more computed, no token yet
    scheduler.preempt_running()
    scheduler.reset_prefix_cache()
    connector.stored.clear()
    store(connector, prompt, 1)
    outputs = []
    while not outputs:
        outputs = collect(scheduler, scheduler.schedule())
    assert scheduler.requests["a"].num_external_computed_tokens == 4  # the second load
    (first,) = outputs
    assert (first.num_cached_tokens, first.num_external_computed_tokens) == (12, 12)


def test_a_loading_request_is_deferred_and_a_loaded_one_waits_for_capacity():
    """vLLM's ``num_requests_waiting_by_reason``: a KV transfer in progress defers a
    request ("deferred"); once loaded it waits for a seat like any other ("capacity")."""
    scheduler, connector = make(max_seqs=2)
    store(connector, PROMPT, 3)
    scheduler.add_request(request("runs", [1, 2, 3]))
    scheduler.add_request(request("loads", PROMPT))
    output = scheduler.schedule()
    stats = scheduler.make_stats()
    assert (stats.num_waiting_reqs, stats.num_deferred_reqs) == (1, 1)
    collect(scheduler, output)
    assert scheduler.external.is_loaded(scheduler.requests["loads"])
    stats = scheduler.make_stats()
    assert (stats.num_waiting_reqs, stats.num_deferred_reqs) == (1, 0)
