"""The engine core loop: schedule -> launch -> collect, with one step in flight (one per
pipeline stage under pipeline parallelism).

One ``step()``:

1. schedule step N+1 (under asynchronous scheduling step N still runs: the scheduler counts
   its tokens as placeholders) and launch its forward;
2. collect step N, the one in flight, and update the scheduler with its tokens (stops,
   grammars, outputs) while step N+1's forward runs on the device;
3. launch step N+1's sampling with its grammar bitmask, built from matchers that have now
   seen step N's tokens;
4. return step N's outputs; step N+1 is collected by the next ``step()``.

Synchronous scheduling (``async_scheduling=False``) runs the same calls with step N+1
collected in the same ``step()`` (nothing stays in flight). Both give the same tokens
for greedy and seeded requests; the asynchronous order keeps the device busy while the
host does its per-step work (mini-sglang's overlap loop, vLLM's async scheduling).

Pipeline parallelism (the executor's ``max_concurrent_batches`` = P > 1; vLLM's batch
queue): ``step()`` launches a step (forward and sampling) while fewer than P are in flight,
over requests no step in flight holds (the scheduler's ``disjoint_steps``), and returns
without waiting until P are; otherwise, or when nothing new could be scheduled, it collects
the oldest. Stage 0 thus computes step N+1 while stage 1 computes step N. The steps are
disjoint, so a step's grammar bitmask is asked for right after its schedule.
"""

from __future__ import annotations

import contextlib
import logging
from collections import deque
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from pagedlm.config import EngineConfig
from pagedlm.core.outputs import EngineCoreOutput
from pagedlm.core.pause import CORE_PAUSE_MODES, aborted_outputs, check_mode
from pagedlm.core.request import Request
from pagedlm.core.scheduler import OneBudgetScheduler
from pagedlm.core.scheduler_interface import Scheduler, SchedulerStats
from pagedlm.executor import Executor
from pagedlm.kv_transfer.factory import KVConnectorRole, check_weight_update, make_connector
from pagedlm.lora.admission import AdapterAdmission
from pagedlm.model_executor.loader.replacement import check_replacement
from pagedlm.platforms import Platform
from pagedlm.plugins.registry import select_executor
from pagedlm.step import SchedulerOutput, StepResult
from pagedlm.structured_output.manager import StructuredOutputManager
from pagedlm.structured_output.params import GrammarLimits
from pagedlm.worker.rpc import WorkerRpcError
from pagedlm.worker.sleep import SLEEP_TAGS, check_level, check_tags, check_wake_order

if TYPE_CHECKING:
    from pagedlm.lora.request import LoRARequest
    from pagedlm.worker.rpc import RpcMethod

logger = logging.getLogger(__name__)


class _InFlight(NamedTuple):
    scheduler_output: SchedulerOutput
    result: StepResult


@contextlib.contextmanager
def _worker_refusal() -> Iterator[None]:
    """A worker's failure in an adapter call (say, files it cannot read) as the caller's
    ``ValueError``; the engine carries on."""
    try:
        yield
    except WorkerRpcError as error:
        raise ValueError(str(error)) from error


class EngineCore:
    """Owns the scheduler and the executor. Knows token ids only, never text."""

    def __init__(
        self, config: EngineConfig, platform: Platform, executor: Executor | None = None
    ) -> None:
        """``executor``: an executor already built (tests); by default the platform's,
        selected through the plugin registry."""
        self.config = config
        if executor is None:
            executor = select_executor(platform, config.parallel.distributed_executor_backend)(
                config, platform
            )
        self.executor = executor
        num_blocks = self.executor.determine_num_kv_blocks()
        self.executor.initialize_kv_cache(num_blocks)
        self.num_kv_blocks = num_blocks
        # Builds nothing heavy until the first constrained request (then on a thread).
        self.structured_output = StructuredOutputManager(config)
        kv_events = config.kv_events
        self.scheduler: Scheduler = OneBudgetScheduler(
            config.scheduler,
            config.cache,
            num_blocks,
            self.structured_output,
            config.speculative,
            record_kv_cache_events=kv_events.publishes,
            max_loras=None if config.lora is None else config.lora.max_loras,
            disjoint_steps=executor.max_concurrent_batches > 1,
            consecutive_blocks=platform is not None and platform.prefers_consecutive_blocks,
            kv_connector=make_connector(config, KVConnectorRole.SCHEDULER),
        )
        self._kv_event_publisher = None
        if kv_events.publishes:
            from pagedlm.kv_cache.event_publisher import ZmqEventPublisher

            self._kv_event_publisher = ZmqEventPublisher(
                kv_events, config.parallel.data_parallel_rank
            )
        self.async_scheduling = config.scheduler.async_scheduling
        self._in_flight: _InFlight | None = None
        """The step launched by the last ``step()`` and not collected yet (async only)."""
        self.max_concurrent_batches = executor.max_concurrent_batches
        self._batch_queue: deque[_InFlight] = deque()
        """Pipeline parallelism: the steps in flight, oldest first."""
        self.max_steps_in_flight_seen = 0
        """The most steps that were launched and not collected at once (diagnostics)."""
        self.sleep_level = 0
        """0 awake, else the level of ``sleep`` while any part still sleeps (no request may
        be added meanwhile)."""
        self.sleeping_tags: set[str] = set()
        """The parts asleep ("weights", "kv_cache"; ``wake_up(tags)`` wakes them)."""
        self.paused = False
        """``pause`` stopped scheduling until ``resume`` (``pagedlm.core.pause``)."""
        self.adapters = AdapterAdmission(self._read_adapter)

    def add_request(self, request: Request) -> None:
        if self.sleeping_tags == {"kv_cache"}:
            raise ValueError(
                "The engine's KV cache is still asleep; call wake_up(tags=['kv_cache']) (POST "
                "/wake_up?tags=kv_cache on a server) before adding requests."
            )
        if self.sleep_level:
            raise ValueError(
                "The engine is asleep; call wake_up() (POST /wake_up on a server) before "
                "adding requests."
            )
        if self.paused:
            raise ValueError("Generation is paused; resume_generation() before adding requests.")
        self.adapters.admit(request.lora_request)
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        self.scheduler.abort_requests(request_ids)

    @property
    def has_step_in_flight(self) -> bool:
        """A launched step awaits collection by the next ``step()``."""
        return self._in_flight is not None or bool(self._batch_queue)

    @property
    def num_steps_in_flight(self) -> int:
        return len(self._batch_queue) + (self._in_flight is not None)

    def has_unfinished_requests(self) -> bool:
        return self.has_step_in_flight or self.scheduler.has_unfinished_requests()

    def has_work(self) -> bool:
        """Whether ``step()`` would do anything: collect a step in flight, or run requests
        (none while paused)."""
        return self.has_step_in_flight or (
            not self.paused and self.scheduler.has_unfinished_requests()
        )

    def step(self) -> list[EngineCoreOutput]:
        if self.sleep_level:
            return self._step_asleep()
        if self.paused:
            return self._drain()
        pipelined = self.max_concurrent_batches > 1
        outputs = self._step_with_batch_queue() if pipelined else self._step()
        self._publish_kv_events()
        return outputs

    def _step(self) -> list[EngineCoreOutput]:
        scheduler_output = self.scheduler.schedule()
        # An empty step still tells the workers which requests ended; one with a KV
        # connector's loads and no tokens is collected like any other (it reports them).
        self.executor.execute_model(scheduler_output)
        outputs = self._collect()
        if scheduler_output.is_empty and not scheduler_output.kv_connector_metadata:
            self.executor.sample_tokens(None)
            return outputs
        bitmask = self.scheduler.get_grammar_bitmask(scheduler_output)
        self._in_flight = _InFlight(scheduler_output, self.executor.sample_tokens(bitmask))
        if not self.async_scheduling:
            outputs += self._collect()
        return outputs

    def _step_with_batch_queue(self) -> list[EngineCoreOutput]:
        queue = self._batch_queue
        if len(queue) < self.max_concurrent_batches:
            scheduler_output = self.scheduler.schedule()
            self.executor.execute_model(scheduler_output)
            if scheduler_output.is_empty:
                self.executor.sample_tokens(None)
            else:
                bitmask = self.scheduler.get_grammar_bitmask(scheduler_output)
                queue.append(_InFlight(scheduler_output, self.executor.sample_tokens(bitmask)))
                self.max_steps_in_flight_seen = max(self.max_steps_in_flight_seen, len(queue))
                if len(queue) < self.max_concurrent_batches:
                    return []  # a stage is still free: launch another before waiting
        if not queue:
            return []
        scheduler_output, result = queue.popleft()
        return self.scheduler.update_from_output(scheduler_output, result.result())

    def _step_asleep(self) -> list[EngineCoreOutput]:
        """Nothing runs while any part sleeps: the engine slept without unfinished requests
        and admits none until it is awake, so there is nothing to step (the next awake
        step tells the workers which requests ended meanwhile)."""
        if self.has_unfinished_requests():  # not reachable through the engine's API
            raise RuntimeError(
                "The engine is asleep but has unfinished requests; wake_up() before stepping."
            )
        return []

    def _drain(self) -> list[EngineCoreOutput]:
        """Collect every step in flight, launching none."""
        outputs = self._collect()
        while self._batch_queue:
            scheduler_output, result = self._batch_queue.popleft()
            outputs += self.scheduler.update_from_output(scheduler_output, result.result())
        return outputs

    def _collect(self) -> list[EngineCoreOutput]:
        """Wait for the step in flight, if any, and update the scheduler with it."""
        if self._in_flight is None:
            return []
        scheduler_output, result = self._in_flight
        self._in_flight = None
        return self.scheduler.update_from_output(scheduler_output, result.result())

    # ------------------------------------------------------------------------- admin

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (vLLM's ``/reset_prefix_cache``); False while
        requests hold blocks."""
        reset = self.scheduler.reset_prefix_cache()
        self._publish_kv_events()
        return reset

    def pause(self, mode: str = "abort", clear_cache: bool = True) -> list[EngineCoreOutput]:
        """Schedule nothing until ``resume`` (``pagedlm.core.pause``): collect the steps in
        flight, then end every unfinished request with finish reason "abort" (``mode``
        "abort") or keep them ("keep"); ``clear_cache`` forgets the cached prefixes, kept
        requests preempted first. Returns the outputs of the collected steps and of the
        aborted requests, for the front end."""
        check_mode(mode, CORE_PAUSE_MODES)
        outputs = self._drain()
        if mode == "abort":
            aborted = self.scheduler.abort_requests(self.scheduler.unfinished_request_ids())
            outputs += aborted_outputs([request.request_id for request in aborted])
        self.paused = True
        if clear_cache:
            if mode == "keep":
                self.scheduler.preempt_running()
            self.reset_prefix_cache()
        return outputs

    def resume(self) -> None:
        """Schedule again after ``pause``: kept requests continue, new ones are admitted."""
        self.paused = False

    def sleep(self, level: int) -> None:
        """Release device memory (``pagedlm.worker.sleep``). ValueError while requests
        are unfinished: the caller drains or aborts them first."""
        if not self.config.model.enable_sleep_mode:
            raise ValueError(
                "Sleep mode is off; start the engine with enable_sleep_mode=True "
                "(--enable-sleep-mode), as vLLM asks."
            )
        check_level(level)
        if "weights" in self.sleeping_tags:
            return  # all asleep (the KV cache wakes only after the weights)
        if not self.scheduler.has_unfinished_requests():
            # A step launched before its requests were aborted (asynchronous scheduling):
            # collected here, it reports nothing, and then nothing runs.
            self._drain()
        if self.has_unfinished_requests():
            num = self.scheduler.get_num_unfinished_requests()
            raise ValueError(
                f"Cannot sleep while {num} requests are unfinished; wait for them (or "
                "abort them) and call sleep again."
            )
        # The KV cache's contents are lost: no later request may hit a cached prefix.
        self.reset_prefix_cache()
        self.executor.sleep(level)
        if level == 2:
            # The workers build their model runner again on waking, its encoder cache empty.
            self.scheduler.reset_encoder_cache()
        self.sleep_level = level
        self.sleeping_tags = set(SLEEP_TAGS)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Wake the parts ``tags`` names (vLLM's "weights", "kv_cache"; None: both), in
        that order; parts already awake are skipped. The engine admits requests again once
        both are awake. ValueError for an unknown tag, or the KV cache before the weights."""
        waking = [tag for tag in check_tags(tags) if tag in self.sleeping_tags]
        if not waking:
            return
        check_wake_order(self.sleeping_tags, waking)
        if len(waking) == len(SLEEP_TAGS):
            self.executor.wake_up()
        else:
            self.executor.wake_up(waking)
        self.sleeping_tags.difference_update(waking)
        if not self.sleeping_tags:
            self.sleep_level = 0

    def update_weights(
        self,
        model_path: str | None = None,
        weights: Iterable[tuple[str, torch.Tensor]] | None = None,
    ) -> None:
        """Replace the model's weights (``pagedlm.model_executor.loader.replacement``) from the
        checkpoint at ``model_path`` or from ``weights``. ValueError while requests are
        unfinished (paused, while kept requests hold KV: the model runner is built again,
        so only requests without KV, waiting or preempted, may stay), while the weights
        sleep (the KV cache may: ``wake_up(tags=["weights"])``, update, then
        ``wake_up(tags=["kv_cache"])``), or for a checkpoint of another shape; the cached
        prefixes are forgotten (their keys and values came from the old weights)."""
        if (model_path is None) == (weights is None):
            raise ValueError("Pass model_path or weights (one of them).")
        check_weight_update(self.config)  # a KV connector whose store outlives these weights
        if "weights" in self.sleeping_tags:
            raise ValueError(
                "The weights are asleep; wake_up(tags=['weights']) (or wake_up()) before "
                "updating them."
            )
        if self.paused:
            num = self.scheduler.make_stats().num_running_reqs
            if num:
                raise ValueError(
                    f"Cannot update the weights while {num} kept requests hold KV cache; "
                    "pause_generation(mode='keep') with clear_cache=True (they recompute it "
                    "on resume), or mode='abort'."
                )
        elif self.has_unfinished_requests():
            num = self.scheduler.get_num_unfinished_requests()
            raise ValueError(
                f"Cannot update the weights while {num} requests are unfinished; wait for "
                "them (or abort them, or pause_generation()) first."
            )
        if model_path is not None:
            check_replacement(self.config.model, model_path)
        # Waiting requests may hold blocks a KV connector loaded (paused with the cache
        # kept): those keys and values are the old weights' too, so they go first.
        self.scheduler.preempt_running()
        if not self.reset_prefix_cache():
            raise RuntimeError(
                "Blocks are still held after every request gave its own back; the cached "
                "prefixes of the old weights cannot be forgotten, so the weights were not "
                "updated. Abort the waiting requests (pause_generation(mode='abort')) and "
                "update again."
            )
        # The workers build their model runner again, its encoder cache empty (the old
        # weights' image embeddings would be stale too), even when the new weights fail.
        self.scheduler.reset_encoder_cache()
        self.executor.reload_weights(model_path, weights)

    def collective_rpc(
        self,
        method: RpcMethod,
        timeout: float | None = None,
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> list[Any]:
        """Run ``method`` on every worker (``Executor.collective_rpc``), between steps;
        a step in flight stays in flight."""
        return self.executor.collective_rpc(method, timeout, tuple(args), dict(kwargs or {}))

    # ---- LoRA adapters (vLLM's): the workers' host caches ------------------------------

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Every worker reads the adapter ahead of its first request (checked by the front
        end first). ValueError if a worker cannot read it."""
        return self.adapters.add(lora_request)

    def _read_adapter(self, lora_request: LoRARequest) -> bool:
        with _worker_refusal():
            return self.executor.add_lora(lora_request)

    def remove_lora(self, lora_id: int) -> bool:
        """Every worker forgets the adapter; False if it was not loaded."""
        with _worker_refusal():
            removed = self.executor.remove_lora(lora_id)
        self.adapters.remove(lora_id)
        return removed

    def list_loras(self) -> set[int]:
        """The ids of the adapters loaded (added, or read for a request since)."""
        with _worker_refusal():
            return self.executor.list_loras()

    def pin_lora(self, lora_id: int) -> bool:
        """Keep a loaded adapter for good (``pagedlm.lora.manager``); ValueError if it is
        not loaded."""
        with _worker_refusal():
            pinned = self.executor.pin_lora(lora_id)
        if not pinned:
            raise ValueError(
                f"LoRA adapter {lora_id} is not loaded, so it cannot be pinned; add_lora() it "
                "first."
            )
        return True

    def _publish_kv_events(self) -> None:
        if self._kv_event_publisher is not None:
            events = self.scheduler.take_kv_cache_events()
            if events:
                self._kv_event_publisher.publish(events)

    def set_grammar_limits(self, limits: GrammarLimits) -> None:
        """The configured bounds on grammar compiles (the defaults until called)."""
        self.structured_output.set_limits(limits)

    def make_stats(self) -> SchedulerStats:
        return self.scheduler.make_stats()

    def shutdown(self) -> None:
        if self._kv_event_publisher is not None:
            self._kv_event_publisher.shutdown()
        self.structured_output.shutdown()
        self.executor.shutdown()
