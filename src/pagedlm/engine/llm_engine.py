"""The synchronous engine: input processing, the engine core, and output processing in
one process. ``LLM`` drives it; the async front end reuses its pieces."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from pagedlm.config import EngineConfig
from pagedlm.engine.arg_utils import EngineArgs
from pagedlm.engine.data_parallel import make_engine_core
from pagedlm.engine.input_processor import InputProcessor, ProcessedRequest, PromptType
from pagedlm.engine.output_processor import OutputProcessor
from pagedlm.gc_heap import freeze_startup_heap, thaw_heap
from pagedlm.lora.request import LoRARequest
from pagedlm.metrics import EngineMetrics, Metric
from pagedlm.metrics.stats import cache_info
from pagedlm.outputs import RequestOutput
from pagedlm.platforms import Platform
from pagedlm.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch

    from pagedlm.worker.rpc import RpcMethod

logger = logging.getLogger(__name__)

R = TypeVar("R")


class LLMEngine:
    def __init__(self, config: EngineConfig, platform: Platform, log_stats: bool = True) -> None:
        """``log_stats``: keep the metrics ``get_metrics`` reports (vLLM's ``log_stats``,
        ``not disable_log_stats``). Off, a step spends nothing per request on them: at 256
        running requests ~0.1 ms of host work per step, which the GPU waits on when the
        host sets the pace."""
        thaw_heap()  # a previous engine's frozen cycles, before this one allocates
        self.config = config
        self.platform = platform
        self.log_stats = log_stats
        self.tokenizer = None
        if not config.model.skip_tokenizer_init:
            from pagedlm.tokenizer import model_tokenizer

            self.tokenizer = model_tokenizer(config.model)
        self.input_processor = InputProcessor(
            config.model,
            self.tokenizer,
            config.structured_outputs_backend,
            config.scheduler.scheduling_policy,
            lora_config=config.lora,
            multimodal_config=config.multimodal,
            logits_processors=config.logits_processors,
            compact_json=config.structured_outputs_compact_json,
            reasoning=config.structured_outputs_reasoning,
        )
        self.output_processor = OutputProcessor(self.tokenizer, config.scheduler.stream_interval)
        self.engine_core = make_engine_core(config, platform)
        self.metrics = EngineMetrics(
            config.model.max_model_len,
            cache_info(config.cache, self.engine_core.num_kv_blocks),
            config.parallel.data_parallel_size,
        )
        freeze_startup_heap("engine")

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> LLMEngine:
        from pagedlm.structured_output.params import GrammarLimits

        config, platform = args.create_engine_config()
        engine = cls(config, platform, log_stats=not args.disable_log_stats)
        limits = GrammarLimits.of(args)
        engine.input_processor.structured_outputs_max_spec_chars = limits.max_spec_chars
        engine.engine_core.set_grammar_limits(limits)
        return engine

    def process_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
        tokenization_kwargs: dict[str, Any] | None = None,
    ) -> ProcessedRequest:
        """Validate and tokenize without touching the engine (raises ValueError)."""
        return self.input_processor.process(
            request_id, prompt, params, priority, lora_request, tokenization_kwargs
        )

    def add_processed_request(self, request: ProcessedRequest) -> None:
        # Check every child fits before queueing any, so a rejection leaves no trace.
        self.output_processor.add_request(
            request.request_id,
            request.prompt,
            request.prompt_token_ids,
            request.params,
            [child.request_id for child in request.children],
            request.arrival_time,
            request.children[0].lora_request,
        )
        try:
            for child in request.children:
                self.engine_core.add_request(child)
        except ValueError:
            child_ids = self.output_processor.abort_requests([request.request_id])
            self.engine_core.abort_requests(child_ids)
            raise
        if self.log_stats:
            self.metrics.record_request(request.request_id, request.children)

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
        tokenization_kwargs: dict[str, Any] | None = None,
    ) -> None:
        self.add_processed_request(
            self.process_request(
                request_id, prompt, params, priority, lora_request, tokenization_kwargs
            )
        )

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Check an adapter against the model (ValueError naming the problem) and have
        every worker read it into its host cache (vLLM's; ``max_cpu_loras`` adapters, least
        recently used dropped first). True."""
        self.input_processor.adapters.check(lora_request)
        return self.engine_core.add_lora(lora_request)

    def remove_lora(self, lora_id: int) -> bool:
        """Forget an adapter (host cache, device slot, pin; ``lora_id`` may then name other
        files); False if it was not loaded. A running request that uses it reads it again."""
        removed = self.engine_core.remove_lora(lora_id)
        self.input_processor.adapters.forget(lora_id)
        return removed

    def list_loras(self) -> set[int]:
        """The ids of the adapters loaded: added, or read for a request since."""
        return self.engine_core.list_loras()

    def pin_lora(self, lora_id: int) -> bool:
        """Keep a loaded adapter for good: never dropped from the host cache, its device
        slot given up only when a step needs more slots than unpinned adapters hold. True;
        ValueError if it is not loaded."""
        return self.engine_core.pin_lora(lora_id)

    def abort_request(self, request_ids: Iterable[str]) -> None:
        request_ids = list(request_ids)
        if self.log_stats:
            for request_id in request_ids:
                self.metrics.forget_request(request_id)
        child_ids = self.output_processor.abort_requests(request_ids)
        self.engine_core.abort_requests(child_ids)

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        outputs = self.engine_core.step()
        if self.log_stats:
            self.metrics.record_outputs(outputs)
        processed = self.output_processor.process_outputs(outputs)
        if processed.reqs_to_abort:
            # Finished by a stop string, which only the output processor can see.
            self.engine_core.abort_requests(processed.reqs_to_abort)
            if self.log_stats:
                self.metrics.record_stopped(processed.reqs_to_abort)
        return processed.request_outputs

    def get_metrics(self) -> list[Metric]:
        if not self.log_stats:
            raise ValueError(
                "This engine keeps no metrics: it was made with disable_log_stats=True "
                "(LLM's default, as vLLM's). Pass LLM(..., disable_log_stats=False) to "
                "collect them."
            )
        core = self.engine_core
        return self.metrics.snapshot(core.make_stats(), core.sleep_level)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; False while requests hold KV blocks."""
        return self.engine_core.reset_prefix_cache()

    def sleep(self, level: int = 1) -> None:
        """Free device memory until ``wake_up`` (level 1: the weights move to host memory;
        level 2: they are dropped and read again). ValueError while requests run."""
        self.engine_core.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Undo ``sleep`` for the parts ``tags`` names (vLLM's): "weights" back on the
        device (level 2: read again), "kv_cache" a new, empty KV cache; None wakes both.
        Requests are admitted again once both are awake. ValueError for an unknown tag or
        for the KV cache before the weights."""
        self.engine_core.wake_up(tags)

    def update_weights_from_disk(self, model_path: str) -> None:
        """Load the weights of the checkpoint at ``model_path`` (the model's shape and
        format) in place of the current ones. ValueError while requests run."""
        self.engine_core.update_weights(model_path=model_path)

    def update_weights_from_tensor(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor]
    ) -> None:
        """Load ``named_tensors`` (checkpoint names, every weight of the model) in place of
        the current weights. ValueError while requests run."""
        if isinstance(named_tensors, Mapping):
            named_tensors = named_tensors.items()
        self.engine_core.update_weights(weights=list(named_tensors))

    def collective_rpc(
        self,
        method: RpcMethod,
        timeout: float | None = None,
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> list[Any]:
        """Run ``method`` on every worker; one result per worker, in rank order
        (``LLM.collective_rpc``)."""
        return self.engine_core.collective_rpc(method, timeout, args, kwargs)

    def apply_model(self, func: Callable[[torch.nn.Module], R]) -> list[R]:
        """``func(model)`` on every worker's model; one result per worker."""
        return self.collective_rpc("apply_model", args=(func,))

    def is_sleeping(self) -> bool:
        return bool(self.engine_core.sleep_level)

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    def shutdown(self) -> None:
        self.engine_core.shutdown()
        thaw_heap()
