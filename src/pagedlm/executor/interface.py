"""The Executor interface: the engine core's only handle on workers and devices."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    from pagedlm.config import EngineConfig
    from pagedlm.core.outputs import ModelRunnerOutput, SchedulerOutput
    from pagedlm.platforms import Platform


class Executor(ABC):
    """Runs steps on the workers it owns.

    Lifecycle: ``__init__`` loads the model on every worker; ``determine_num_kv_blocks``
    sizes the cache (the minimum over workers); ``initialize_kv_cache`` allocates it;
    then ``execute_model`` once per step; ``shutdown`` last (idempotent).

    Invariant: ``execute_model`` returns one entry per scheduled request, in the order
    of the SchedulerOutput, and every worker has applied the same SchedulerOutput.
    """

    name: ClassVar[str]

    def __init__(self, config: EngineConfig, platform: Platform) -> None:
        self.config = config
        self.platform = platform

    @abstractmethod
    def determine_num_kv_blocks(self) -> int:
        """How many KV blocks fit (honouring ``CacheConfig.num_kv_blocks`` when set)."""

    @abstractmethod
    def initialize_kv_cache(self, num_blocks: int) -> None: ...

    @abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...

    def shutdown(self) -> None:  # noqa: B027 - optional hook
        """Release workers and device memory."""
