"""A worker owns one device and its model runner (one per tensor/pipeline-parallel rank)."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import torch

from pagedlm.attention import AttentionBackend
from pagedlm.config import EngineConfig
from pagedlm.distributed import (
    destroy_model_parallel,
    get_pipeline_state,
    get_tensor_model_parallel_rank,
    init_worker_distributed,
)
from pagedlm.lora.manager import HostState
from pagedlm.lora.request import LoRARequest
from pagedlm.platforms import Platform
from pagedlm.spec_decode import after_update_from_disk
from pagedlm.step import GrammarBitmask, SchedulerOutput, StepResult
from pagedlm.worker.model_runner import ModelRunner
from pagedlm.worker.sleep import (
    SLEEP_TAGS,
    OffloadedWeights,
    check_level,
    check_tags,
    check_wake_order,
)

logger = logging.getLogger(__name__)

R = TypeVar("R")


@dataclass(frozen=True)
class RankPlacement:
    """Where a worker of a multi-rank engine sits."""

    rank: int
    """Global rank: tensor-parallel rank ``rank % tp`` of stage ``rank // tp``."""
    local_rank: int
    """Index of its device on its node."""
    distributed_init_method: str
    """``torch.distributed`` rendezvous shared by every rank (``tcp://host:port``)."""


class Worker:
    """Builds the model for its rank and runs steps on it.

    With a ``placement`` it first takes its device and joins the engine's
    ``torch.distributed`` world (TP and PP groups, over ``platform.dist_backend``); every
    rank then receives the same calls in the same order, and every rank samples the same
    tokens (identical logits, identical seeds), so their device token tables agree.
    """

    def __init__(
        self,
        config: EngineConfig,
        platform: Platform,
        attn_backend_cls: type[AttentionBackend],
        placement: RankPlacement | None = None,
    ) -> None:
        self.config = config
        self.platform = platform
        self.placement = placement
        if placement is not None:
            parallel = config.parallel
            platform.set_device(placement.local_rank)
            init_worker_distributed(
                placement.rank,
                parallel.tensor_parallel_size,
                parallel.pipeline_parallel_size,
                platform.dist_backend,
                placement.distributed_init_method,
                parallel.enable_expert_parallel,
            )
        torch.manual_seed(config.model.seed)
        self.attn_backend_cls = attn_backend_cls
        # Progress for a user waiting on start-up: the weights are the slow part.
        logger.info("Loading %s on %s ...", config.model.model, platform.device)
        started = time.monotonic()
        self.model_runner: ModelRunner | None = ModelRunner(config, platform, attn_backend_cls)
        logger.info("Model loaded in %.1f s", time.monotonic() - started)
        self.num_kv_blocks = 0
        self.sleep_level = 0
        """0 awake; else the level of the last ``sleep`` while any part still sleeps (see
        ``worker.sleep``)."""
        self.sleeping_tags: set[str] = set()
        """The parts asleep: "weights", "kv_cache" (vLLM's tags)."""
        self._offloaded: OffloadedWeights | None = None
        self._lora_host_state: HostState | None = None
        """The adapters of a model runner dropped by a level-2 sleep, for the next one."""

    @property
    def is_output_rank(self) -> bool:
        """The rank whose ``ModelRunnerOutput`` the executor reads: TP rank 0 of the last
        pipeline stage (every other rank computes the same or nothing)."""
        return get_pipeline_state().is_last and get_tensor_model_parallel_rank() == 0

    @property
    def rank(self) -> int:
        """Global rank (0 for the one worker of the "uni" executor)."""
        return 0 if self.placement is None else self.placement.rank

    @property
    def device(self) -> torch.device:
        """The ``torch.device`` this worker's model and KV cache live on."""
        return self.platform.device

    def get_model(self) -> torch.nn.Module:
        """This rank's model (its shard under tensor or pipeline parallelism)."""
        return self.runner.model

    def apply_model(self, func: Callable[[torch.nn.Module], R]) -> R:
        """``func(model)`` on this rank's model (vLLM's ``LLM.apply_model``)."""
        return func(self.get_model())

    def shutdown(self) -> None:
        if self.placement is not None:
            destroy_model_parallel()

    def determine_num_kv_blocks(self) -> int:
        """Blocks that fit in the platform's KV budget, capped at what could ever be used.
        A block's size is this worker's: the KV heads it holds, every layer."""
        cache, sched = self.config.cache, self.config.scheduler
        if cache.num_kv_blocks is not None:
            return cache.num_kv_blocks
        per_block = self.runner.kv_bytes_per_block()
        budget = cache.kv_cache_memory_bytes or self.platform.kv_cache_memory_bytes(per_block)
        blocks_per_seq = math.ceil(sched.max_model_len / cache.block_size)
        num_blocks = min(budget // per_block, blocks_per_seq * sched.max_num_seqs)
        if num_blocks < blocks_per_seq:
            fits = num_blocks * cache.block_size
            raise ValueError(
                f"The KV cache budget ({budget / 2**30:.2f} GiB) holds {fits} tokens, fewer "
                f"than max_model_len={sched.max_model_len}; lower --max-model-len to at most "
                f"{fits}, or give the KV cache more memory (--kv-cache-memory-bytes or "
                "--num-kv-blocks; PAGEDLM_CPU_KVCACHE_SPACE GiB on CPU)."
            )
        return int(num_blocks)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate the cache (and capture graphs, where the platform has them)."""
        self.num_kv_blocks = num_blocks
        started = time.monotonic()
        self.runner.initialize_kv_cache(num_blocks)
        logger.info(
            "KV cache allocated (and graphs captured) in %.1f s", time.monotonic() - started
        )

    @property
    def runner(self) -> ModelRunner:
        if self.model_runner is None:
            raise RuntimeError(
                "the worker's weights are asleep (level 2); wake_up() (or "
                "wake_up(tags=['weights'])) first"
            )
        return self.model_runner

    def sleep(self, level: int) -> None:
        """Release the KV cache and (level 1) move the weights to host memory or (level 2)
        drop them; the engine must have no unfinished requests. After a partial
        ``wake_up`` the weights are awake (the KV cache wakes only after them), and sleep
        again at ``level``."""
        check_level(level)
        if "weights" in self.sleeping_tags:
            return  # and so is the KV cache
        runner = self.runner
        runner.release_kv_cache()
        if level == 1:
            offload = runner.weight_offload
            self._offloaded = OffloadedWeights.offload(
                runner.weight_modules(),
                self.platform.pin_host_memory,
                in_host_memory=offload.holds if offload is not None else lambda tensor: False,
            )
        else:
            self._lora_host_state = runner.lora.host_state()  # host memory: kept
            self.model_runner = None
        del runner
        self.sleep_level = level
        self.sleeping_tags = set(SLEEP_TAGS)
        self.platform.release_memory()

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Undo ``sleep`` for the parts ``tags`` names (None: all): "weights" back on the
        device (level 2: loaded again from the checkpoint), "kv_cache" a new, empty cache of
        the same size. Parts already awake are skipped; the KV cache wakes only with or
        after the weights (ValueError otherwise, nothing woken)."""
        waking = [tag for tag in check_tags(tags) if tag in self.sleeping_tags]
        check_wake_order(self.sleeping_tags, waking)
        if "weights" in waking:
            self._wake_weights()
            self.sleeping_tags.discard("weights")
        if "kv_cache" in waking:
            self.runner.initialize_kv_cache(self.num_kv_blocks)
            self.sleeping_tags.discard("kv_cache")
        if not self.sleeping_tags:
            self.sleep_level = 0

    def _wake_weights(self) -> None:
        if self.model_runner is None:
            torch.manual_seed(self.config.model.seed)  # dummy weights come out the same
            self.model_runner = ModelRunner(self.config, self.platform, self.attn_backend_cls)
            self.model_runner.lora.adopt(self._lora_host_state)
            self._lora_host_state = None
        elif self._offloaded is not None:
            self._offloaded.restore(self.platform.device)
            self._offloaded = None

    def _check_kv_cache_awake(self) -> None:
        if "kv_cache" in self.sleeping_tags:
            raise RuntimeError(
                f"worker {self.rank}: the KV cache is asleep, so no step can run; call "
                "wake_up(tags=['kv_cache']) (or wake_up()) first."
            )

    def reload_weights(
        self,
        model_path: str | None = None,
        weights: Iterable[tuple[str, torch.Tensor]] | None = None,
    ) -> None:
        """Replace the model's weights, read from ``model_path`` (a checkpoint of the same
        architecture and shapes, which later level-2 wake-ups read too) or taken from
        ``weights`` (``(name, tensor)`` pairs with the checkpoint's names). The model is
        built again (the platform's kernels, graphs and an empty KV cache included), so the
        old weights are dropped first: at no point are there two copies on the device. If
        the new weights fail to load, the last checkpoint's are loaded again and the error
        is raised (``ValueError``). Only while the weights are awake (the KV cache may still
        sleep: it is then allocated when it wakes); the engine has no running requests."""
        if "weights" in self.sleeping_tags:
            raise ValueError(
                "The weights are asleep; wake_up(tags=['weights']) (or wake_up()) before "
                "updating them."
            )
        config = self.config
        if model_path is not None:
            model = replace(config.model, model=model_path, load_format="auto")
            speculative = after_update_from_disk(config.speculative, config.model, model)
            config = replace(config, model=model, speculative=speculative)
        lora_host_state = self.runner.lora.host_state()
        self.model_runner = None
        self.platform.release_memory()
        started = time.monotonic()
        try:
            runner = ModelRunner(config, self.platform, self.attn_backend_cls, weights)
        except (ValueError, KeyError, RuntimeError, OSError) as error:
            self.platform.release_memory()
            self.model_runner = ModelRunner(self.config, self.platform, self.attn_backend_cls)
            self.model_runner.lora.adopt(lora_host_state)
            if "kv_cache" not in self.sleeping_tags:
                self.model_runner.initialize_kv_cache(self.num_kv_blocks)
            raise ValueError(
                f"The new weights did not load ({error}); the model has the weights of "
                f"{self.config.model.model} again."
            ) from error
        self.config = config
        self.model_runner = runner
        runner.lora.adopt(lora_host_state)
        if "kv_cache" not in self.sleeping_tags:
            runner.initialize_kv_cache(self.num_kv_blocks)
        logger.info("Weights updated in %.1f s", time.monotonic() - started)

    # ---- LoRA adapters (vLLM's worker methods; ``pagedlm.lora.manager``) ------------

    def add_lora(self, lora_request: LoRARequest | Mapping[str, Any]) -> bool:
        """Read an adapter into this rank's host cache ahead of its first request. From
        another process (``collective_rpc``) the request arrives as a dict of its fields."""
        if isinstance(lora_request, Mapping):
            lora_request = LoRARequest(**lora_request)
        return self.runner.lora.add(lora_request)

    def remove_lora(self, lora_id: int) -> bool:
        """Forget an adapter; False if this rank had not loaded it."""
        return self.runner.lora.remove(lora_id)

    def list_loras(self) -> set[int]:
        """The ids of the adapters this rank holds (host cache or device slot)."""
        return self.runner.lora.list_ids()

    def pin_lora(self, lora_id: int) -> bool:
        """Keep an adapter loaded for good; False if this rank has not loaded it."""
        return self.runner.lora.pin(lora_id)

    def execute_model(self, scheduler_output: SchedulerOutput) -> None:
        self._check_kv_cache_awake()
        self.runner.execute_model(scheduler_output)

    def sample_tokens(self, grammar_bitmask: GrammarBitmask | None) -> StepResult:
        return self.runner.sample_tokens(grammar_bitmask)
