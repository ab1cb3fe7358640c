"""Data parallelism behind one LLM: two replicas (each its own scheduler, KV cache and
worker) share the requests by load, give one engine's tokens, route aborts, and pause
together."""

from __future__ import annotations

import pytest
from parity import assert_same_run, greedy_run, make_llm

from pagedlm import SamplingParams
from pagedlm.core.scheduler_interface import SchedulerStats
from pagedlm.engine.data_parallel import DataParallelEngineCore, least_loaded, sum_stats


def _stats(waiting: int, running: int, usage: float = 0.0) -> SchedulerStats:
    return SchedulerStats(running, waiting, usage, 0, 0, 0)


def test_least_loaded_counts_waiting_four_times_then_kv_usage() -> None:
    assert least_loaded([_stats(1, 0), _stats(0, 3)]) == 1
    assert least_loaded([_stats(0, 5), _stats(1, 0)]) == 1
    assert least_loaded([_stats(0, 2, 0.5), _stats(0, 2, 0.1)]) == 1
    assert least_loaded([_stats(0, 2), _stats(0, 2)]) == 0
    total = sum_stats([_stats(1, 2, 0.2), _stats(3, 4, 0.4)])
    assert (total.num_waiting_reqs, total.num_running_reqs) == (4, 6)
    assert total.kv_cache_usage == pytest.approx(0.3)


@pytest.fixture(scope="module")
def dp_llm(llama):
    llm = make_llm(llama, data_parallel_size=2, disable_log_stats=False)
    yield llm
    llm.llm_engine.shutdown()


def test_two_replicas_give_one_engines_tokens(dp_llm, llama_reference) -> None:
    core = dp_llm.llm_engine.engine_core
    assert isinstance(core, DataParallelEngineCore)
    ranks = [replica.config.parallel.data_parallel_rank for replica in core.replicas]
    assert ranks == [0, 1]
    assert_same_run(greedy_run(dp_llm), llama_reference)


def test_requests_spread_and_aborts_reach_their_replica(dp_llm) -> None:
    engine = dp_llm.llm_engine
    core = engine.engine_core
    params = SamplingParams(max_tokens=50, ignore_eos=True)
    for i in range(6):
        engine.add_request(f"dp-{i}", {"prompt_token_ids": [3, 4, 5 + i]}, params)
    owners = [core.owner_of(f"dp-{i}") for i in range(6)]  # n=1: the request's own id
    assert sorted(owners) == [0, 0, 0, 1, 1, 1]
    waiting = {
        metric.labels["engine"]: metric.value
        for metric in engine.get_metrics()
        if metric.name == "pagedlm:num_requests_waiting"
    }
    assert waiting == {"0": 3, "1": 3}  # each replica's own (vLLM's engine label)
    engine.abort_request([f"dp-{i}" for i in range(6)])
    assert all(not r.scheduler.has_unfinished_requests() for r in core.replicas)
    assert not engine.has_unfinished_requests()


def test_each_replica_has_its_own_metrics(dp_llm) -> None:
    """vLLM's ``engine`` label: every output names the replica that ran it, and each
    replica's counters, histograms and scheduler gauges are its own series."""
    engine = dp_llm.llm_engine
    before = _by_engine(engine.get_metrics())
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    for i in range(4):
        engine.add_request(f"labelled-{i}", {"prompt_token_ids": [7, 8, 9, i]}, params)
    owners = {f"labelled-{i}": engine.engine_core.owner_of(f"labelled-{i}") for i in range(4)}
    seen: dict[str, int] = {}
    while engine.has_unfinished_requests():
        outputs = engine.engine_core.step()
        for output in outputs:
            seen[output.req_id] = output.engine_index
        engine.metrics.record_outputs(outputs)
        engine.output_processor.process_outputs(outputs)
    assert seen == owners and sorted(owners.values()) == [0, 0, 1, 1]
    after = _by_engine(engine.get_metrics())
    for index in ("0", "1"):
        delta = {
            name: after[name, index] - before.get((name, index), 0)
            for name, i in after
            if i == index
        }
        assert delta["pagedlm:request_success"] == 2
        assert delta["pagedlm:prompt_tokens"] == 2 * 4
        assert delta["pagedlm:generation_tokens"] == 2 * 5
        assert delta["pagedlm:e2e_request_latency_seconds"] == 2
        assert delta["pagedlm:inter_token_latency_seconds"] == 2 * 4
        assert after["pagedlm:num_requests_running", index] == 0
        assert after["pagedlm:engine_sleep_state", index] == 1  # awake: 1, the others 0
        assert after["pagedlm:cache_config_info", index] == 1


def _by_engine(metrics) -> dict[tuple[str, str], float]:
    """(name, engine) -> value summed over the other labels (histograms: their count)."""
    values: dict[tuple[str, str], float] = {}
    for metric in metrics:
        key = (metric.name, metric.labels["engine"])
        value = metric.buckets[-1][1] if metric.kind == "histogram" else metric.value
        values[key] = values.get(key, 0) + value
    return values


def test_a_pause_reaches_every_replica(dp_llm) -> None:
    engine = dp_llm.llm_engine
    core = engine.engine_core
    params = SamplingParams(max_tokens=50, ignore_eos=True)
    ids = [f"pause-{i}" for i in range(4)]
    for request_id in ids:
        engine.add_request(request_id, {"prompt_token_ids": [3, 4, 5]}, params)
    engine.step()
    outputs = core.pause("abort")
    assert sorted(o.req_id for o in outputs if o.finish_reason == "abort") == ids
    assert all(replica.paused for replica in core.replicas) and not core.has_work()
    assert all(core.owner_of(request_id) is None for request_id in ids)
    with pytest.raises(ValueError, match="paused"):
        engine.add_request("late", {"prompt_token_ids": [3]}, params)
    engine.output_processor.process_outputs(outputs)
    core.resume()
    assert not any(replica.paused for replica in core.replicas)
    assert not engine.has_unfinished_requests()
