"""The Executor interface: the engine core's only handle on workers and devices."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping, Sequence

    import torch

    from pagedlm.config import EngineConfig
    from pagedlm.lora.request import LoRARequest
    from pagedlm.platforms import Platform
    from pagedlm.step import GrammarBitmask, ModelRunnerOutput, SchedulerOutput, StepResult
    from pagedlm.worker.rpc import RpcMethod


class Executor(ABC):
    """Runs steps on the workers it owns.

    Lifecycle: ``__init__`` loads the model on every worker; ``determine_num_kv_blocks``
    sizes the cache (the minimum over workers); ``initialize_kv_cache`` allocates it;
    then, once per step, ``execute_model`` followed by ``sample_tokens``; ``shutdown``
    last (idempotent).

    Invariants:
    - ``name`` equals the name of the ``ExecutorSpec`` that registers the class; the engine
      core creates it as ``cls(config, platform)``. Executors in plugins may build on
      ``pagedlm.worker.worker.Worker(config, platform, attn_backend_cls)``, as the uniproc
      executor does.
    - Every worker applies the same ``SchedulerOutput``s in the same order.
    - ``execute_model`` and ``sample_tokens`` alternate, and neither waits for the
      device where the workers can avoid it: the engine may queue step N+1 before it
      collects step N's ``StepResult``. Results are collected in launch order.
    - A step's ``ModelRunnerOutput`` has one entry per scheduled request, in the order of
      the ``SchedulerOutput``.
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
    def execute_model(self, scheduler_output: SchedulerOutput) -> None:
        """Launch the step's forward (an empty step only updates the workers' requests)."""

    @abstractmethod
    def sample_tokens(self, grammar_bitmask: GrammarBitmask | None) -> StepResult:
        """Launch the sampling of the step ``execute_model`` launched last, with the
        structured-output masks of its constrained requests."""

    @property
    def max_concurrent_batches(self) -> int:
        """Steps the engine may keep in flight over disjoint requests: one per pipeline
        stage (vLLM's name). 1: the one-step-ahead path of asynchronous scheduling."""
        return 1

    def execute_and_sample(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """One whole unconstrained step, waited for (tests and simple drivers)."""
        self.execute_model(scheduler_output)
        return self.sample_tokens(None).result()

    def sleep(self, level: int) -> None:
        """Release device memory until ``wake_up`` (``pagedlm.worker.sleep``: level 1 keeps
        the weights in host memory, level 2 drops them). Only called without unfinished
        requests."""
        raise NotImplementedError(f"the {self.name!r} executor does not support sleep mode")

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Undo ``sleep`` for the parts ``tags`` names (``pagedlm.worker.sleep``: "weights",
        "kv_cache"; None: both): weights on the device again, a new, empty KV cache."""
        raise NotImplementedError(f"the {self.name!r} executor does not support sleep mode")

    def reload_weights(
        self, model_path: str | None, weights: Iterable[tuple[str, torch.Tensor]] | None
    ) -> None:
        """Replace the model's weights (``Worker.reload_weights``): from the checkpoint at
        ``model_path`` or from ``weights``. Only called awake, without unfinished requests."""
        raise NotImplementedError(f"the {self.name!r} executor does not support weight updates")

    def collective_rpc(
        self,
        method: RpcMethod,
        timeout: float | None,
        args: Sequence[Any],
        kwargs: Mapping[str, Any],
    ) -> list[Any]:
        """Run ``method`` on every worker (``pagedlm.worker.rpc``): one result per worker,
        in rank order. ``WorkerRpcError`` if a worker's call raised (the workers carry on);
        ``TimeoutError`` if workers in other processes have not answered after ``timeout``
        seconds; ``TypeError`` for what cannot reach them."""
        raise NotImplementedError(f"the {self.name!r} executor does not support collective_rpc")

    # ---- LoRA adapters: every worker's, through collective_rpc (vLLM's executor) -----

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Every worker reads the adapter into its host cache (``Worker.add_lora``)."""
        return all(self.collective_rpc("add_lora", None, (lora_request,), {}))

    def remove_lora(self, lora_id: int) -> bool:
        """Every worker forgets the adapter; False if one had not loaded it."""
        return all(self.collective_rpc("remove_lora", None, (lora_id,), {}))

    def list_loras(self) -> set[int]:
        """The adapters the workers hold (each receives the same calls: the same set)."""
        return {int(i) for i in self.collective_rpc("list_loras", None, (), {})[0]}

    def pin_lora(self, lora_id: int) -> bool:
        """Every worker keeps the adapter for good; False if one had not loaded it."""
        return all(self.collective_rpc("pin_lora", None, (lora_id,), {}))

    def shutdown(self) -> None:  # noqa: B027 - optional hook
        """Release workers and device memory."""
