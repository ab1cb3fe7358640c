"""The example executor: one worker in the engine's process, written against the Executor
interface (``pagedlm.executor.interface``) and pagedlm's ``Worker``.

A device plugin's executor is where its runtime is set up per worker (a process per
device, thread pinning, a device context); this one has none to set up, so it only counts
the steps it launched and logs them at shutdown, to show the lifecycle it is called in.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from pagedlm.executor import Executor
from pagedlm.plugins.registry import select_attention_backend
from pagedlm.worker.worker import Worker

if TYPE_CHECKING:
    from pagedlm.config import EngineConfig
    from pagedlm.platforms import Platform
    from pagedlm.step import GrammarBitmask, SchedulerOutput, StepResult

logger = logging.getLogger(__name__)


class ExampleExecutor(Executor):
    name = "example_uniproc"

    def __init__(self, config: EngineConfig, platform: Platform) -> None:
        super().__init__(config, platform)
        backend_cls = select_attention_backend(platform, config.attention_backend)
        self.worker = Worker(config, platform, backend_cls)
        self.num_steps = 0
        self._shut_down = False

    def determine_num_kv_blocks(self) -> int:
        return self.worker.determine_num_kv_blocks()

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.worker.initialize_kv_cache(num_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> None:
        # Launch only: the engine may queue the next step before collecting this one.
        self.worker.execute_model(scheduler_output)
        self.num_steps += 1

    def sample_tokens(self, grammar_bitmask: GrammarBitmask | None) -> StepResult:
        return self.worker.sample_tokens(grammar_bitmask)

    def shutdown(self) -> None:
        if not self._shut_down:  # idempotent, as the interface asks
            self._shut_down = True
            logger.info("example executor: %d steps launched", self.num_steps)
