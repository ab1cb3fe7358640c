"""What core code may ask of the hardware it runs on.

Core code never branches on a device name: it asks the platform a capability question
(``supports_cuda_graphs``, ``dist_backend``, ``check_dtype``) and uses the answer.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING, ClassVar

import torch

from pagedlm.attention.backend import BatchLayout

if TYPE_CHECKING:
    from pagedlm.config import EngineConfig, ModelConfig
    from pagedlm.lora.ops import LoRAOps
    from pagedlm.model_executor.forward_context import ForwardContext
    from pagedlm.sample.rejection_sampler import FusedGreedyVerifier
    from pagedlm.sample.sampler import FusedRandomSampler
    from pagedlm.worker.spec_positions import InFlightCorrector
    from pagedlm.worker.step_inputs import StepGatherer


class GraphRunner(ABC):
    """Replays captured forwards of uniform batches: every request feeds the same number of
    tokens (1 for decode, 1 + k when speculative tokens are verified); optionally
    (``run_mixed``) other steps too, from pieces captured around eager attention calls.

    Invariants:
    - A replay reads the model runner's persistent step buffers, which the runner fills
      for the padded batch before calling ``run``: the layout and the gather indices, not
      the gathered inputs. The replay runs the step's gathers itself
      (``StepInputBuilder.gather``: input ids, slot mapping and block-table rows from the
      input batch's tables), then the forward; for an eager step the runner gathers.
    - The result equals an eager forward of the same step up to floating-point rounding,
      whatever the padding.
    """

    @abstractmethod
    def padded_num_reqs(self, num_reqs: int, query_len: int) -> int | None:
        """The captured batch size (>= ``num_reqs``) a step of ``num_reqs`` requests of
        ``query_len`` tokens each replays at, or None when no graph serves it."""

    @abstractmethod
    def run(self, layout: BatchLayout) -> torch.Tensor:
        """Replay the graph of ``layout``'s (padded) shape; returns the hidden states
        ``[layout.num_tokens, hidden_size]``. Must not wait for the device."""

    def run_mixed(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor | None:
        """Hidden states (padding rows after the real ones) of a step no uniform graph
        serves, from captured pieces of the forward around eager attention calls, or None
        to run it eagerly (the default). ``input_ids`` are the step's gathered inputs (the
        persistent buffer's prefix), ``ctx`` holds its attention metadata."""
        return None


class Platform(ABC):
    """One kind of hardware. Instances are created by the registry after the probe passed,
    with no arguments (``cls()``).

    Invariants:
    - ``name`` equals the name of the ``PlatformSpec`` that registers the class, and
      ``default_attention_backend`` and ``default_executor`` name components registered
      for it (``BackendSpec.platform == name``; an ``ExecutorSpec`` whose ``platforms``
      is empty or holds ``name``).
    - ``device`` is where model weights, activations and the KV cache live.
    - ``check_dtype`` raises ``ValueError`` naming a dtype that works for any it rejects.
    - ``kv_cache_memory_bytes`` is a budget the KV cache may fill entirely, with model
      weights already loaded.
    """

    name: ClassVar[str]
    device_type: ClassVar[str]
    """torch device type: "cpu", "cuda" (ROCm also reports "cuda")."""
    dist_backend: ClassVar[str] = "gloo"
    """torch.distributed backend for tensor parallelism on this platform."""
    async_scheduling_default: ClassVar[bool] = False
    """Whether ``async_scheduling`` is on unless the user says otherwise: True where the
    device runs a step while the host prepares the next (an asynchronous stream)."""
    default_max_num_batched_tokens: ClassVar[int] = 8192
    """A step's token budget unless the user sets ``max_num_batched_tokens`` (at least
    ``max_num_seqs``): large where a bigger step only fills the device better, smaller
    where a step's activations should stay in the caches (CPU)."""
    supports_cuda_graphs: ClassVar[bool] = False
    """Uniform steps may be replayed from captured graphs (``capture_graphs``)."""
    prefers_consecutive_blocks: ClassVar[bool] = False
    """The attention reads a request's KV blocks in place where they are consecutive (the
    CPU backend's single decode): the KV manager then gives a request the block after its
    last one when that block is free, ahead of the free queue's LRU order."""
    profiles_memory: ClassVar[bool] = False
    """The model runner should run one forward at the largest batch before sizing the KV
    cache, so that ``kv_cache_memory_bytes`` can leave room for the activation peak."""
    default_attention_backend: ClassVar[str]
    default_executor: ClassVar[str] = "uni"
    """The executor of a one-worker engine unless the user names another."""

    @property
    def device(self) -> torch.device:
        return torch.device(self.device_type)

    @property
    @abstractmethod
    def supported_dtypes(self) -> tuple[torch.dtype, ...]:
        """Dtypes the platform can run models in, preferred first."""

    def default_dtype(self, config_dtype: torch.dtype | None) -> torch.dtype:
        """The dtype for ``dtype="auto"``: the checkpoint's own if supported, else the first."""
        if config_dtype in self.supported_dtypes:
            return config_dtype
        return self.supported_dtypes[0]

    def check_dtype(self, dtype: torch.dtype) -> None:
        if dtype not in self.supported_dtypes:
            names = ", ".join(str(d).removeprefix("torch.") for d in self.supported_dtypes)
            raise ValueError(
                f"The {self.name} platform cannot run dtype {dtype}; use one of: {names}."
            )

    def bind_config(self, config: EngineConfig) -> None:  # noqa: B027 - optional
        """Called once with the final engine configuration, before the engine starts, so
        the platform can act on settings meant for it (``cache.gpu_memory_utilization``)."""

    @abstractmethod
    def kv_cache_memory_bytes(self, bytes_per_block: int | None = None) -> int:
        """How many bytes the KV cache may take when the user did not fix ``num_kv_blocks``:
        an ``int >= 0``, or ``ValueError`` saying which setting to change when the platform
        can tell that too little fits.

        ``bytes_per_block``: the size of one block on the asking worker (its share of the
        KV heads), so that a platform can say how many tokens fit when that is too few;
        None when the caller has no model yet."""

    def prepare_model(self, model: torch.nn.Module) -> None:  # noqa: B027 - optional
        """Adapt a freshly loaded model to this platform, e.g. hand its linear layers a
        faster kernel (``LinearBase.set_kernel``). Must not change the model's results
        beyond floating-point rounding."""

    def computes_on_weight_blocks(self, model_config: ModelConfig) -> bool:
        """Whether ``prepare_model`` will give every linear layer of this model (one whose
        ``model_config.has_weight_blocks``: a GGUF file, a GPTQ or AWQ checkpoint) that
        ``loader.quantized_linear_blocks`` returns a kernel over those blocks. The loader
        then never computes those layers' float weights (``block_routing.
        load_keeping_blocks``). Default False: weights are loaded dequantized."""
        return False

    gguf_groups_of_16: bool = False
    """Whether this platform's block kernels take a scale per 16 columns (GGUF Q2_K, Q3_K,
    Q6_K), so that the loader hands over those layers' blocks too (``quantized_linear_blocks(
    groups_of_16=...)``)."""

    def lora_ops(self) -> LoRAOps:
        """How LoRA layers add their batched adapter deltas (``pagedlm.lora.ops``); the
        default is batched torch ops, which are not CUDA-graph safe, so a model runner
        using them stays eager."""
        from pagedlm.lora.ops import TorchLoRAOps

        return TorchLoRAOps()

    def capture_graphs(self, runner: object) -> GraphRunner | None:
        """Capture the model runner ``runner``'s uniform steps (weights loaded, KV cache
        allocated; ``pagedlm.worker.model_runner.ModelRunner``) through its attention
        backend's graph hooks, and return what replays them, or None to stay eager. Only
        called when ``supports_cuda_graphs`` is True and the user did not ask for eager."""
        return None

    def fused_sampler(self) -> FusedRandomSampler | None:
        """A kernel doing temperature, noise and argmax in one pass (see
        ``pagedlm.sample.sampler.FusedRandomSampler``), or None for the torch stages. Its
        greedy rows get ``torch.argmax``'s answer (the first index among ties, which greedy
        parity across platforms relies on), and it never writes into the logits."""
        return None

    def argmax_rows(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """The sampler's argmax over each row of ``[N, vocab]`` logits (int64 ``[N]``,
        the first index among ties, as ``torch.max`` gives it): ``torch.max``'s indices
        unless the platform has a faster way to the same answer."""
        from pagedlm.sample.sampler import argmax_rows

        return argmax_rows

    def fused_greedy_verifier(self) -> FusedGreedyVerifier | None:
        """A kernel verifying an all-greedy speculative step with its bookkeeping (see
        ``pagedlm.sample.rejection_sampler.FusedGreedyVerifier``), or None for the torch
        ops."""
        return None

    def in_flight_corrector(self) -> InFlightCorrector | None:
        """A kernel for ``pagedlm.worker.spec_positions.correct_on_device`` (the in-flight
        rejections' shift of a step's positions, on the device), or None for the torch
        ops."""
        return None

    def step_gatherer(self) -> StepGatherer | None:
        """A kernel for ``pagedlm.worker.step_inputs.gather_on_device`` (a step's input ids,
        slot mapping and rows' block tables from the input batch's tables), or None for
        the torch ops."""
        return None

    def zeros(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A zero-filled tensor on ``device`` (the KV cache is allocated through this)."""
        return torch.zeros(shape, dtype=dtype, device=self.device)

    def device_count(self) -> int | None:
        """Devices of this kind on this node that ranks can be placed on, or None where
        ranks share the host (CPU: any number of worker processes fit)."""
        return None

    def set_device(self, local_rank: int) -> None:  # noqa: B027 - optional
        """Make device ``local_rank`` of this node the one ``device`` names in this
        process (called once per worker process, before the model is built)."""

    def synchronize(self) -> None:  # noqa: B027 - optional, a no-op by default
        """Wait for queued device work (no-op where execution is synchronous)."""

    pin_host_memory: bool = False
    """Host copies of device tensors (sleep mode's offloaded weights) are pinned, so that
    copying them back is fast; only where the device can read pinned memory."""

    def empty_host(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialized host tensor that device copies read and write without waiting
        (pinned where ``pin_host_memory``), taking its own size of host memory: for large,
        long-lived buffers such as a KV offloading pool."""
        return torch.empty(shape, dtype=dtype, device="cpu", pin_memory=self.pin_host_memory)

    def map_host_tensor(self, host: torch.Tensor) -> torch.Tensor | None:
        """A tensor on ``device`` over ``host``'s memory (an ``empty_host`` tensor), which the
        device's kernels read and write in place: same shape, dtype and values, and a
        later write to either shows in the other. None where the device cannot address
        host memory (the default); ``cpu_offload_gb`` then has no effect."""
        return None

    def release_memory(self) -> None:
        """Give memory whose tensors were just dropped (sleep mode: the KV cache, weights)
        back to the system; a device with a caching allocator empties its cache here."""
        from pagedlm.gc_heap import collect_garbage

        collect_garbage()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"
