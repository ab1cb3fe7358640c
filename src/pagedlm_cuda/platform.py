"""The CUDA platform: Triton attention and fused layers, CUDA graphs for decode steps,
and a KV-cache budget taken from the memory left after a profiling forward."""

from __future__ import annotations

import logging
import math
import os
import weakref
from typing import TYPE_CHECKING, NamedTuple

import torch

from pagedlm.kv_cache.fp8 import kv_cache_torch_dtype
from pagedlm.kv_cache.interface import kv_bytes_per_block
from pagedlm.platforms import Platform

if TYPE_CHECKING:
    from pagedlm.config import EngineConfig, ModelConfig
    from pagedlm.platforms.interface import GraphRunner
    from pagedlm.sample.rejection_sampler import FusedGreedyVerifier
    from pagedlm.sample.sampler import FusedRandomSampler
    from pagedlm.worker.spec_positions import InFlightCorrector
    from pagedlm.worker.step_inputs import StepGatherer
    from pagedlm_cuda.kernels.lora import TritonLoRAOps

logger = logging.getLogger(__name__)

DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
RETIRED_GPU_MEMORY_UTILIZATION_ENV = "PAGEDLM_GPU_MEMORY_UTILIZATION"
"""No longer read: ``--gpu-memory-utilization`` / ``gpu_memory_utilization=`` replace it."""


class GpuMemory(NamedTuple):
    """Device memory in bytes, measured after the weights loaded and the profiling forward."""

    total: int
    in_use: int
    """``total - free``: weights, other processes, and the caching allocator's reserve."""
    activation_peak: int
    """How far the profiling forward's peak rose above what is allocated now."""


class _HostBytes:
    """A pinned host tensor's bytes as a ``__cuda_array_interface__`` (version 3), holding
    the tensor alive for as long as a CUDA tensor built from it."""

    def __init__(self, host: torch.Tensor) -> None:
        self.host = host
        nbytes = host.numel() * host.element_size()
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (host.data_ptr(), False),
            "strides": None,
            "version": 3,
        }


def kv_cache_budget(memory: GpuMemory, gpu_memory_utilization: float) -> int:
    """Bytes the KV cache may take: ``utilization * total`` minus what is in use now and
    minus room for the activation peak of the largest step (never negative)."""
    allowed = int(memory.total * gpu_memory_utilization)
    return max(0, allowed - memory.in_use - memory.activation_peak)


def check_kv_cache_fits(
    memory: GpuMemory,
    gpu_memory_utilization: float,
    bytes_per_block: int,
    block_size: int,
    max_model_len: int,
) -> None:
    """Raise ``ValueError`` if the budget cannot hold one ``max_model_len``-token sequence.

    The message says how many tokens fit and which flags change that: a shorter
    ``--max-model-len``, a larger ``--gpu-memory-utilization`` (with the smallest value
    that would do, when one exists), or a smaller ``--max-num-batched-tokens``.
    """
    budget = kv_cache_budget(memory, gpu_memory_utilization)
    tokens_that_fit = budget // bytes_per_block * block_size
    if tokens_that_fit >= max_model_len:
        return
    gib = 2**30
    needed = (
        memory.in_use
        + memory.activation_peak
        + math.ceil(max_model_len / block_size) * (bytes_per_block)
    )
    # Rounded up to hundredths so that the suggested value is enough as printed.
    needed_fraction = math.ceil(needed / memory.total * 100) / 100
    if needed_fraction <= 1.0:
        raise_hint = f"raise --gpu-memory-utilization to at least {needed_fraction:.2f}"
    else:
        raise_hint = "--gpu-memory-utilization cannot help (even 1.0 is too little)"
    shorten = (
        f"lower --max-model-len to at most {tokens_that_fit}"
        if tokens_that_fit > 0
        else "no --max-model-len is short enough; free GPU memory held by other processes"
    )
    raise ValueError(
        f"Not enough GPU memory for max_model_len={max_model_len}: the KV cache budget is "
        f"{budget / gib:.2f} GiB ({gpu_memory_utilization} x {memory.total / gib:.1f} GiB, "
        f"minus {memory.in_use / gib:.2f} GiB in use by weights and other processes, minus a "
        f"{memory.activation_peak / gib:.2f} GiB activation peak), which holds "
        f"{tokens_that_fit} tokens. To start: {shorten}; or {raise_hint}; or lower "
        "--max-num-batched-tokens to shrink the activation peak."
    )


class CudaPlatform(Platform):
    name = "cuda"
    device_type = "cuda"
    dist_backend = "nccl"
    supports_cuda_graphs = True
    async_scheduling_default = True
    profiles_memory = True
    default_attention_backend = "triton"

    def __init__(self) -> None:
        self.config: EngineConfig | None = None

    @property
    def supported_dtypes(self) -> tuple[torch.dtype, ...]:
        return (torch.bfloat16, torch.float16, torch.float32)

    def bind_config(self, config: EngineConfig) -> None:
        self.config = config

    @property
    def gpu_memory_utilization(self) -> float:
        """Fraction of the device's memory pagedlm may use in all (the bound config's)."""
        if self.config is None:
            return DEFAULT_GPU_MEMORY_UTILIZATION
        return self.config.cache.gpu_memory_utilization

    gguf_groups_of_16 = True  # Q2_K, Q3_K and Q6_K layers stay quantized too

    def computes_on_weight_blocks(self, model_config: ModelConfig) -> bool:
        from pagedlm_cuda.quantized_linear import computes_on_weight_blocks

        return computes_on_weight_blocks(model_config)

    def prepare_model(self, model: torch.nn.Module) -> None:
        from pagedlm_cuda.fused_layers import install_fused_kernels
        from pagedlm_cuda.quantized_linear import install_quantized_kernels

        # Quantized layers first: install_fused_kernels leaves layers with a kernel alone.
        install_quantized_kernels(model, None if self.config is None else self.config.model)
        install_fused_kernels(model)
        # The model runner's profiling forward comes next; its peak is measured from here.
        torch.cuda.reset_peak_memory_stats()

    def lora_ops(self) -> TritonLoRAOps:
        from pagedlm_cuda.kernels.lora import TritonLoRAOps

        return TritonLoRAOps()

    def zeros(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(shape, dtype=dtype, device=self.device)

    pin_host_memory = True

    def empty_host(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Pinned by registering an exact allocation with the driver: torch's pinned
        allocator rounds each request up to a power of two (2.5 GiB asked took 4 GiB of
        host memory on an H100 host, torch 2.11), where this takes 2.5 (measured the same
        way). Unregistered, after queued copies finish, when the tensor is collected. On
        the host even inside a ``torch.device`` context (a model being built)."""
        tensor = torch.empty(shape, dtype=dtype, device="cpu")
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes == 0:
            return tensor
        try:  # (ROCm's runtime bindings may lack it: then torch's way, rounded)
            cudart = torch.cuda.cudart()
            registered = cudart.cudaHostRegister(tensor.data_ptr(), nbytes, 0)
            success = registered == cudart.cudaError.success
        except (AttributeError, RuntimeError):
            success = False
        if not success:
            return torch.empty(shape, dtype=dtype, device="cpu", pin_memory=True)
        weakref.finalize(tensor, _unregister_host, tensor.data_ptr())
        return tensor

    def map_host_tensor(self, host: torch.Tensor) -> torch.Tensor:
        """Unified virtual addressing: pinned host memory has one address on the host and
        the device, so a CUDA tensor over that address reads it across the host link
        (torch builds it from a ``__cuda_array_interface__``, as bytes: the interface has
        no bfloat16 or float8 type string). The view keeps ``host`` alive."""
        if not host.is_contiguous() or not host.is_pinned():
            raise ValueError("map_host_tensor takes a contiguous pinned tensor (empty_host)")
        view = torch.as_tensor(_HostBytes(host), device=self.device)
        return view.view(host.dtype).view(host.shape)

    def release_memory(self) -> None:
        super().release_memory()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # cached blocks back to the driver: mem_get_info sees them

    def measure_memory(self) -> GpuMemory:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info()
        activation_peak = torch.cuda.max_memory_allocated() - torch.cuda.memory_allocated()
        return GpuMemory(total=total, in_use=total - free, activation_peak=activation_peak)

    def kv_cache_memory_bytes(self, bytes_per_block: int | None = None) -> int:
        """``gpu_memory_utilization * total`` minus what is in use now (weights, other
        processes) and minus the activation peak that the profiling forward reached above
        it. With a bound config, fails with the fix when one sequence cannot fit."""
        if RETIRED_GPU_MEMORY_UTILIZATION_ENV in os.environ:
            logger.warning(
                "%s is no longer read; pass --gpu-memory-utilization (LLM("
                "gpu_memory_utilization=...)) instead.",
                RETIRED_GPU_MEMORY_UTILIZATION_ENV,
            )
        memory = self.measure_memory()
        utilization = self.gpu_memory_utilization
        budget = kv_cache_budget(memory, utilization)
        logger.info(
            "GPU memory: %.1f GiB total, %.1f GiB in use, %.2f GiB activation peak; "
            "KV cache budget %.1f GiB (gpu_memory_utilization=%s)",
            memory.total / 2**30,
            memory.in_use / 2**30,
            memory.activation_peak / 2**30,
            budget / 2**30,
            utilization,
        )
        if self.config is not None:
            model, cache = self.config.model, self.config.cache
            arch = model.arch
            per_block = bytes_per_block or kv_bytes_per_block(
                cache.block_size,
                arch.num_hidden_layers,
                arch.num_key_value_heads,
                arch.head_dim,
                kv_cache_torch_dtype(cache.cache_dtype, model.dtype),
            )
            check_kv_cache_fits(
                memory,
                utilization,
                per_block,
                cache.block_size,
                self.config.scheduler.max_model_len,
            )
        return budget

    def fused_sampler(self) -> FusedRandomSampler:
        from pagedlm_cuda.kernels.sampling import gumbel_sample

        return gumbel_sample

    def fused_greedy_verifier(self) -> FusedGreedyVerifier:
        from pagedlm_cuda.kernels.greedy_verify import greedy_verify

        return greedy_verify

    def in_flight_corrector(self) -> InFlightCorrector:
        from pagedlm_cuda.kernels.in_flight import correct_in_flight

        return correct_in_flight

    def step_gatherer(self) -> StepGatherer:
        from pagedlm_cuda.kernels.step_gather import gather_step_inputs

        return gather_step_inputs

    def capture_graphs(self, runner: object) -> GraphRunner | None:
        """The runner's graphs; what they hold is logged, since it comes after the KV
        cache was sized and must fit in the rest of ``gpu_memory_utilization``'s margin."""
        from pagedlm_cuda.graph_runner import CudaGraphRunner

        torch.cuda.synchronize()
        before = torch.cuda.memory_reserved()
        graphs = CudaGraphRunner.for_model_runner(runner)
        torch.cuda.synchronize()
        free = torch.cuda.mem_get_info()[0]
        logger.info(
            "CUDA graphs hold %.2f GiB; %.1f GiB of the GPU left free",
            (torch.cuda.memory_reserved() - before) / 2**30,
            free / 2**30,
        )
        return graphs

    def device_count(self) -> int | None:
        return torch.cuda.device_count()

    def set_device(self, local_rank: int) -> None:
        torch.cuda.set_device(local_rank)

    def synchronize(self) -> None:
        torch.cuda.synchronize()


def _unregister_host(pointer: int) -> None:
    """``CudaPlatform.empty_host``'s registration undone once the copies queued on it are
    done (at interpreter exit the driver may be gone: then nothing is left to undo)."""
    try:
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaHostUnregister(pointer)
    except Exception:
        pass
