"""The Executor interface: the engine core's only handle on workers and devices."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, ClassVar, Protocol

if TYPE_CHECKING:
    from pagedlm.config import EngineConfig
    from pagedlm.core.outputs import ModelRunnerOutput, SchedulerOutput
    from pagedlm.platforms import Platform


class StepResult(Protocol):
    """A launched step; ``result()`` waits for it (once, in launch order)."""

    def result(self) -> ModelRunnerOutput: ...


class FinishedStep:
    """A step that already ran: ``result()`` returns its output."""

    def __init__(self, output: ModelRunnerOutput) -> None:
        self.output = output

    def result(self) -> ModelRunnerOutput:
        return self.output


class Executor(ABC):
    """Runs steps on the workers it owns.

    Lifecycle: ``__init__`` loads the model on every worker; ``determine_num_kv_blocks``
    sizes the cache (the minimum over workers); ``initialize_kv_cache`` allocates it;
    then ``execute_model`` (or ``launch_model``) once per step; ``shutdown`` last
    (idempotent).

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

    def launch_model(self, scheduler_output: SchedulerOutput) -> StepResult:
        """Start a step and return without waiting for the device where the workers can
        (a multi-step window), so the engine may schedule the next window meanwhile.
        Results are taken in launch order. Default: run the step to completion."""
        return FinishedStep(self.execute_model(scheduler_output))

    def shutdown(self) -> None:  # noqa: B027 - optional hook
        """Release workers and device memory."""
