"""Data parallelism in one process: ``data_parallel_size`` engine cores behind one front end.

``LLM`` runs them in its own process; ``AsyncLLM`` and the API server in the engine-core
process (``core_proc.py``), so one front end serves them all either way.

Each replica is a whole ``EngineCore`` (its own scheduler, KV cache and executor, the
config's ``data_parallel_rank`` set to its index, so an executor with worker processes
places them on that replica's devices). ``DataParallelEngineCore`` offers the interface
``LLMEngine`` uses of one core: a new request goes to the least loaded replica (vLLM's
score: four times its waiting requests plus its running ones, then KV-cache usage); an
abort goes to the replica that holds the request; stats are summed, each replica's kept
beside the sum, and every output names its replica (``engine_index``): the metrics carry
vLLM's ``engine`` label per replica.

One ``step()`` steps every replica that has work, in turn. With worker processes (the
"mp" executor, the default for replicas on a device platform) and asynchronous scheduling
(the default there) the replicas' devices run at the same time: a replica's step launches
its next step before it waits for the previous one, so while one replica's host waits the
others' devices compute. Under synchronous scheduling each replica's step is waited for
before the next replica's is launched.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from pagedlm.config import EngineConfig
from pagedlm.core.engine_core import EngineCore
from pagedlm.core.outputs import EngineCoreOutput
from pagedlm.core.request import Request
from pagedlm.core.scheduler_interface import SchedulerStats
from pagedlm.platforms import Platform
from pagedlm.structured_output.params import GrammarLimits

if TYPE_CHECKING:
    import torch

    from pagedlm.lora.request import LoRARequest
    from pagedlm.worker.rpc import RpcMethod


def load_score(stats: SchedulerStats) -> tuple[int, float]:
    """Smaller is less loaded: queue length first (a waiting request counts four times,
    as in vLLM's balancer), then the fraction of KV blocks in use."""
    return 4 * stats.num_waiting_reqs + stats.num_running_reqs, stats.kv_cache_usage


def least_loaded(stats: Sequence[SchedulerStats]) -> int:
    """Index of the replica a new request should go to (the lowest index on a tie)."""
    return min(range(len(stats)), key=lambda i: load_score(stats[i]))


def sum_stats(stats: Sequence[SchedulerStats]) -> SchedulerStats:
    """One snapshot for the whole engine: counts added, KV usage averaged, and each
    replica's own in ``engines`` (the metrics' ``engine`` label)."""
    return SchedulerStats(
        num_running_reqs=sum(s.num_running_reqs for s in stats),
        num_waiting_reqs=sum(s.num_waiting_reqs for s in stats),
        kv_cache_usage=sum(s.kv_cache_usage for s in stats) / len(stats),
        num_preemptions=sum(s.num_preemptions for s in stats),
        prefix_cache_queries=sum(s.prefix_cache_queries for s in stats),
        prefix_cache_hits=sum(s.prefix_cache_hits for s in stats),
        max_loras=max(s.max_loras for s in stats),
        running_lora_adapters=_sum_counts(s.running_lora_adapters for s in stats),
        waiting_lora_adapters=_sum_counts(s.waiting_lora_adapters for s in stats),
        external_prefix_cache_queries=sum(s.external_prefix_cache_queries for s in stats),
        external_prefix_cache_hits=sum(s.external_prefix_cache_hits for s in stats),
        num_deferred_reqs=sum(s.num_deferred_reqs for s in stats),
        prefix_cache_requests=sum(s.prefix_cache_requests for s in stats),
        external_prefix_cache_requests=sum(s.external_prefix_cache_requests for s in stats),
        prefix_cache_resets=sum(s.prefix_cache_resets for s in stats),
        engines=list(stats),
    )


def _sum_counts(counts: Iterable[dict[str, int]]) -> dict[str, int]:
    total: Counter[str] = Counter()
    for count in counts:
        total.update(count)
    return dict(total)


def replica_config(config: EngineConfig, rank: int) -> EngineConfig:
    return dataclasses.replace(
        config, parallel=dataclasses.replace(config.parallel, data_parallel_rank=rank)
    )


def make_engine_core(
    config: EngineConfig, platform: Platform
) -> EngineCore | DataParallelEngineCore:
    """The engine core of ``config``: one, or one per data-parallel replica."""
    if config.parallel.data_parallel_size > 1:
        return DataParallelEngineCore(config, platform)
    return EngineCore(config, platform)


class DataParallelEngineCore:
    """``data_parallel_size`` engine cores with the interface of one."""

    def __init__(self, config: EngineConfig, platform: Platform) -> None:
        self.config = config
        self.replicas: list[EngineCore] = []
        try:
            for rank in range(config.parallel.data_parallel_size):
                self.replicas.append(EngineCore(replica_config(config, rank), platform))
        except BaseException:
            self.shutdown()
            raise
        self.num_kv_blocks = min(core.num_kv_blocks for core in self.replicas)
        self._owner: dict[str, int] = {}
        """Unfinished request id -> index of the replica that holds it."""

    def add_request(self, request: Request) -> None:
        index = least_loaded([core.make_stats() for core in self.replicas])
        self.replicas[index].add_request(request)
        self._owner[request.request_id] = index

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        by_replica: dict[int, list[str]] = {}
        for request_id in request_ids:
            index = self._owner.pop(request_id, None)
            if index is not None:
                by_replica.setdefault(index, []).append(request_id)
        for index, ids in by_replica.items():
            self.replicas[index].abort_requests(ids)

    def owner_of(self, request_id: str) -> int | None:
        """The replica holding an unfinished request (None: unknown or finished)."""
        return self._owner.get(request_id)

    def has_unfinished_requests(self) -> bool:
        return any(core.has_unfinished_requests() for core in self.replicas)

    def has_work(self) -> bool:
        return any(core.has_work() for core in self.replicas)

    def step(self) -> list[EngineCoreOutput]:
        outputs: list[EngineCoreOutput] = []
        for index, core in enumerate(self.replicas):
            if core.has_work():
                outputs += self._tagged(index, core.step())
        return self._forget_finished(outputs)

    @staticmethod
    def _tagged(index: int, outputs: list[EngineCoreOutput]) -> list[EngineCoreOutput]:
        """``outputs`` of replica ``index``, each naming it (``engine_index``, 0 already)."""
        if not index:
            return outputs
        return [output._replace(engine_index=index) for output in outputs]

    def _forget_finished(self, outputs: list[EngineCoreOutput]) -> list[EngineCoreOutput]:
        for output in outputs:
            if output.finished:
                self._owner.pop(output.req_id, None)
        return outputs

    def pause(self, mode: str = "abort", clear_cache: bool = True) -> list[EngineCoreOutput]:
        outputs: list[EngineCoreOutput] = []
        # The first refuses a bad mode before any replica pauses.
        for index, core in enumerate(self.replicas):
            outputs += self._tagged(index, core.pause(mode, clear_cache))
        return self._forget_finished(outputs)

    def resume(self) -> None:
        for core in self.replicas:
            core.resume()

    @property
    def paused(self) -> bool:
        return self.replicas[0].paused

    def make_stats(self) -> SchedulerStats:
        return sum_stats([core.make_stats() for core in self.replicas])

    def reset_prefix_cache(self) -> bool:
        return all([core.reset_prefix_cache() for core in self.replicas])

    def sleep(self, level: int) -> None:
        # A busy replica refuses before any replica has slept: all sleep, or none.
        busy = [core for core in self.replicas if core.has_unfinished_requests()]
        for core in busy[:1] + self.replicas:
            core.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        for core in self.replicas:  # the first refuses a bad call before any replica wakes
            core.wake_up(tags)

    def update_weights(
        self,
        model_path: str | None = None,
        weights: Iterable[tuple[str, torch.Tensor]] | None = None,
    ) -> None:
        # A busy replica refuses before any replica has changed: all update, or none.
        busy = [core for core in self.replicas if core.has_unfinished_requests()]
        weights = None if weights is None else list(weights)
        for core in busy[:1] + self.replicas:
            core.update_weights(model_path, weights)

    def collective_rpc(
        self,
        method: RpcMethod,
        timeout: float | None = None,
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> list[Any]:
        """Every replica's workers' results: replica 0's ranks first, then replica 1's, ..."""
        results: list[Any] = []
        for core in self.replicas:
            results += core.collective_rpc(method, timeout, args, kwargs)
        return results

    def add_lora(self, lora_request: LoRARequest) -> bool:
        return all([core.add_lora(lora_request) for core in self.replicas])

    def remove_lora(self, lora_id: int) -> bool:
        """True if any replica had it loaded (a request loads it only where it runs)."""
        return any([core.remove_lora(lora_id) for core in self.replicas])

    def list_loras(self) -> set[int]:
        """Every replica's (requests load adapters on the replica that runs them)."""
        return set().union(*(core.list_loras() for core in self.replicas))

    def pin_lora(self, lora_id: int) -> bool:
        # One that has not loaded it refuses before any replica pins.
        missing = [core for core in self.replicas if lora_id not in core.list_loras()]
        for core in missing[:1] + self.replicas:
            core.pin_lora(lora_id)
        return True

    @property
    def sleep_level(self) -> int:
        return self.replicas[0].sleep_level

    @property
    def sleeping_tags(self) -> set[str]:
        return self.replicas[0].sleeping_tags

    def set_grammar_limits(self, limits: GrammarLimits) -> None:
        for core in self.replicas:
            core.set_grammar_limits(limits)

    def shutdown(self) -> None:
        for core in self.replicas:
            core.shutdown()
