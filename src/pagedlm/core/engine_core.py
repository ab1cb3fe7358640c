"""The engine core loop: schedule -> execute -> update, one step at a time.

Multi-step windows chain: once a window is queued on the device, the scheduler is asked
for the next one (``Scheduler.schedule_continuation``) and that is queued too before the
host waits for the first window's tokens. The host's work between windows (stops,
outputs, the next schedule) then overlaps the device's next window instead of leaving
the device idle. A chained window is collected by the next ``step()``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from pagedlm.config import EngineConfig
from pagedlm.core.outputs import EngineCoreOutput, SchedulerOutput
from pagedlm.core.request import Request
from pagedlm.core.scheduler import OneBudgetScheduler
from pagedlm.core.scheduler_interface import Scheduler, SchedulerStats
from pagedlm.executor import Executor
from pagedlm.executor.interface import StepResult
from pagedlm.platforms import Platform
from pagedlm.plugins.registry import select_executor
from pagedlm.structured_output.manager import StructuredOutputManager

logger = logging.getLogger(__name__)


class EngineCore:
    """Owns the scheduler and the executor. Knows token ids only, never text."""

    def __init__(self, config: EngineConfig, platform: Platform) -> None:
        self.config = config
        executor_cls = select_executor(platform, config.executor)
        self.executor: Executor = executor_cls(config, platform)
        num_blocks = self.executor.determine_num_kv_blocks()
        self.executor.initialize_kv_cache(num_blocks)
        self.num_kv_blocks = num_blocks
        # Builds nothing heavy until the first constrained request (then on a thread).
        self.structured_output = StructuredOutputManager(config)
        self.scheduler: Scheduler = OneBudgetScheduler(
            config.scheduler, config.cache, num_blocks, self.structured_output
        )
        self._queued: tuple[SchedulerOutput, StepResult] | None = None
        """A chained window launched by the last step, collected by the next."""

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        self.scheduler.abort_requests(request_ids)

    @property
    def has_queued_window(self) -> bool:
        """A chained window is on the device; the next ``step()`` collects it."""
        return self._queued is not None

    def has_unfinished_requests(self) -> bool:
        return self.has_queued_window or self.scheduler.has_unfinished_requests()

    def step(self) -> list[EngineCoreOutput]:
        if self._queued is not None:
            scheduler_output, launched = self._queued
            self._queued = None
        else:
            scheduler_output = self.scheduler.schedule()
            if scheduler_output.is_empty:
                if scheduler_output.finished_req_ids:
                    # Nothing to run, but workers must still drop finished requests' state.
                    self.executor.execute_model(scheduler_output)
                return []
            launched = self.executor.launch_model(scheduler_output)
        if scheduler_output.num_steps > 1:
            following = self.scheduler.schedule_continuation(scheduler_output)
            if following is not None:
                self._queued = (following, self.executor.launch_model(following))
        return self.scheduler.update_from_output(scheduler_output, launched.result())

    def make_stats(self) -> SchedulerStats:
        return self.scheduler.make_stats()

    def shutdown(self) -> None:
        self.structured_output.shutdown()
        self.executor.shutdown()
