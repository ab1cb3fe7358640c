"""The default executor: one worker in the engine's own process."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pagedlm.executor.interface import Executor
from pagedlm.plugins.registry import select_attention_backend
from pagedlm.worker.extension import make_worker
from pagedlm.worker.rpc import call_on_worker, check_call

if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping, Sequence

    import torch

    from pagedlm.config import EngineConfig
    from pagedlm.platforms import Platform
    from pagedlm.step import GrammarBitmask, SchedulerOutput, StepResult
    from pagedlm.worker.rpc import RpcMethod


class UniprocExecutor(Executor):
    name = "uni"

    def __init__(self, config: EngineConfig, platform: Platform) -> None:
        super().__init__(config, platform)
        backend_cls = select_attention_backend(platform, config.attention_backend)
        self.worker = make_worker(config, platform, backend_cls)

    def determine_num_kv_blocks(self) -> int:
        return self.worker.determine_num_kv_blocks()

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.worker.initialize_kv_cache(num_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> None:
        self.worker.execute_model(scheduler_output)

    def sample_tokens(self, grammar_bitmask: GrammarBitmask | None) -> StepResult:
        return self.worker.sample_tokens(grammar_bitmask)

    def sleep(self, level: int) -> None:
        self.worker.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.worker.wake_up(tags)

    def reload_weights(
        self, model_path: str | None, weights: Iterable[tuple[str, torch.Tensor]] | None
    ) -> None:
        self.worker.reload_weights(model_path, weights)

    def collective_rpc(
        self,
        method: RpcMethod,
        timeout: float | None,
        args: Sequence[Any],
        kwargs: Mapping[str, Any],
    ) -> list[Any]:
        # The call runs on this thread, where nothing can interrupt it: ``timeout`` bounds
        # waits for other processes only (as in vLLM's uniproc executor).
        check_call(method, timeout)
        return [call_on_worker(self.worker, 0, method, args, kwargs)]

    def shutdown(self) -> None:
        self.worker.shutdown()
