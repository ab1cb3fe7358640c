"""The CPU platform."""

from __future__ import annotations

import logging
import math
import mmap
import os
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import torch

from pagedlm.platforms import Platform
from pagedlm_cpu import prefault

if TYPE_CHECKING:
    from pagedlm.config import EngineConfig, ModelConfig

logger = logging.getLogger(__name__)

KVCACHE_SPACE_ENV = "PAGEDLM_CPU_KVCACHE_SPACE"
"""GiB the KV cache may take on CPU (like vLLM's VLLM_CPU_KVCACHE_SPACE); default 4."""
DEQUANTIZE_GGUF_ENV = "PAGEDLM_CPU_DEQUANTIZE_GGUF"
"""Set to 1 to compute GGUF models with dequantized weights (the parity reference) instead
of the file's quantized blocks."""
INT4_MAX_ROWS_ENV = "PAGEDLM_CPU_INT4_MAX_ROWS"
"""Input rows up to which quantized layers use the int4 kernel (default
``quantized_linear.DEFAULT_MAX_ROWS``); above, they dequantize and call F.linear."""
NATIVE_BF16_ENV = "PAGEDLM_CPU_NATIVE_BF16"
"""``0``/``1``: treat this CPU as without/with native bf16 (the probe decides when unset).
The test suite sets 0, so its default-dtype runs are float32 on every CI machine."""
INT8_LM_HEAD_ENV = "PAGEDLM_CPU_INT8_LM_HEAD"
"""Set to 0 to keep a two-plane (Q5_*/Q8_0) LM head on the int4 kernel at one or two rows
instead of fbgemm's int8 GEMM (``int8_rows``)."""
DENSE_FROM_ROWS_ENV = "PAGEDLM_CPU_DENSE_FROM_ROWS"
"""Rows (times the layer's 4-bit planes) from which a quantized layer computes on a dense
copy of its weights (default ``row_split_linear.DEFAULT_DENSE_FROM_ROWS`` for the copy's
dtype); 0: no copies."""


def has_native_bf16() -> bool:
    """True where the CPU computes bf16 in hardware (AVX512-BF16 or AMX): there bf16 GEMMs
    run at twice the float32 rate and move half the bytes. Elsewhere torch emulates them,
    and at batch sizes past a few rows they are slower than float32. ``NATIVE_BF16_ENV``
    overrides the probe."""
    forced = os.environ.get(NATIVE_BF16_ENV)
    if forced in ("0", "1"):
        return forced == "1"
    return _cpu_probe("_is_avx512_bf16_supported") or _cpu_probe("_is_amx_tile_supported")


def _cpu_probe(name: str) -> bool:
    """One of torch's private ``torch.cpu._is_*_supported`` probes; False where absent."""
    return bool(getattr(torch.cpu, name, lambda: False)())


def has_amx() -> bool:
    """True where the CPU has AMX tiles (oneDNN then multiplies bf16 at several times its
    AVX-512 rate; 2.7x float32 at 32 rows of SmolLM2's layers). ``NATIVE_BF16_ENV=0``
    counts as no AMX, as it counts as no native bf16."""
    if os.environ.get(NATIVE_BF16_ENV) == "0":
        return False
    return _cpu_probe("_is_amx_tile_supported")


def has_fast_bf16_gemms() -> bool:
    """True where oneDNN's bf16 GEMMs beat its float32 ones at every row count SmolLM2's
    layers were measured at: CPUs with AMX, and AMD's with AVX512-BF16 (Zen 4: 47.2
    against 76.8 ms for 32 rows of the 120 layers, 76.0 against 143.1 for 64, session 30).
    Intel's AVX512-BF16 without AMX measured slower than float32 from 16 rows (session
    9), so those CPUs get float32 copies."""
    if has_amx():
        return True
    if os.environ.get(NATIVE_BF16_ENV) == "0":
        return False
    return _cpu_probe("_is_avx512_bf16_supported") and cpu_vendor() == "AuthenticAMD"


def cpu_vendor() -> str:
    """``vendor_id`` of /proc/cpuinfo (``GenuineIntel``, ``AuthenticAMD``); "" where it
    cannot be read."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def _available_memory_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


class CpuPlatform(Platform):
    name = "cpu"
    device_type = "cpu"
    dist_backend = "gloo"
    supports_cuda_graphs = False
    default_attention_backend = "cpu_sdpa"
    # One decode on consecutive blocks attends in place; elsewhere it reads a mirror that
    # costs two appends per layer (0.6 ms a step for SmolLM2: docs/performance.md).
    prefers_consecutive_blocks = True
    # A 2,048-token step keeps a step's activations ([tokens, intermediate] rows) nearer the
    # caches: its elementwise ops run at memory speed from 4,096 tokens on. Measured on
    # prompts of 100-500 tokens (docs/performance.md): 2,048 runs 11-27% faster than 8,192.
    default_max_num_batched_tokens = 2048

    @property
    def supported_dtypes(self) -> tuple[torch.dtype, ...]:
        # float16 matmuls on CPU are slow or missing in many torch builds.
        return (torch.float32, torch.bfloat16)

    _model_config: ModelConfig | None = None

    def default_dtype(self, config_dtype: torch.dtype | None) -> torch.dtype:
        # For speed within the parity bounds, whatever the checkpoint says: bf16 where the
        # hardware has it, float32 elsewhere (float16 matmuls are slow on most CPUs).
        if has_native_bf16():
            logger.info("CPU dtype: bfloat16 (native bf16 in this CPU); dtype= overrides it.")
            return torch.bfloat16
        logger.info(
            "CPU dtype: float32 (this CPU has no native bf16: no AVX512-BF16 or AMX); "
            "dtype='bfloat16' overrides it."
        )
        return torch.float32

    def bind_config(self, config: EngineConfig) -> None:
        self._model_config = config.model

    def prepare_model(self, model: torch.nn.Module) -> None:
        from pagedlm_cpu.decode_layer import FAST_DECODE_ENV, install_decode_kernels
        from pagedlm_cpu.fused_layers import install_fused_kernels
        from pagedlm_cpu.linear import prepack_linears
        from pagedlm_cpu.threads import configure_threads

        logger.info("CPU threads: %s", configure_threads().describe())
        quantized = self._install_quantized_kernels(model)
        int8_head = self._install_int8_lm_head(model) if quantized else ""
        with_copies = self._install_dense_copies(model) if quantized else ""
        packed = prepack_linears(model)
        logger.info(
            "CPU linear layers: %d on the checkpoint's quantized blocks (int4 kernel%s%s), %d "
            "dense on oneDNN (%s=1 computes on dequantized weights).",
            quantized,
            int8_head,
            with_copies,
            packed,
            DEQUANTIZE_GGUF_ENV,
        )
        install_fused_kernels(model)
        if os.environ.get(FAST_DECODE_ENV, "1") not in ("", "0"):
            layers = install_decode_kernels(model)
            if layers:
                logger.info(
                    "CPU decode steps: %d decoder layers in one function each (%s=0: the modules).",
                    layers,
                    FAST_DECODE_ENV,
                )

    def computes_on_weight_blocks(self, model_config: ModelConfig) -> bool:
        from pagedlm_cpu.quantized_linear import int4_kernel_available

        return (
            model_config.has_weight_blocks
            and os.environ.get(DEQUANTIZE_GGUF_ENV, "0") in ("", "0")
            and int4_kernel_available()
        )

    def _install_quantized_kernels(self, model: torch.nn.Module) -> int:
        """Give the layers of a GGUF, GPTQ or AWQ model int4 kernels over the checkpoint's
        blocks; how many."""
        config = self._model_config
        if config is None or not self.computes_on_weight_blocks(config):
            if config is not None and config.has_weight_blocks:
                logger.info(
                    "Quantized weights stay dequantized (no CPU int4 kernel, or %s=1).",
                    DEQUANTIZE_GGUF_ENV,
                )
            return 0
        from pagedlm.model_executor.loader import quantized_linear_blocks
        from pagedlm_cpu.quantized_linear import DEFAULT_MAX_ROWS, install_int4_kernels

        try:
            max_rows = int(os.environ.get(INT4_MAX_ROWS_ENV, DEFAULT_MAX_ROWS))
        except ValueError:
            raise ValueError(
                f"{INT4_MAX_ROWS_ENV} must be a whole number of rows, "
                f"got {os.environ[INT4_MAX_ROWS_ENV]!r}."
            ) from None
        return install_int4_kernels(model, quantized_linear_blocks(model, config), max_rows)

    def _install_int8_lm_head(self, model: torch.nn.Module) -> str:
        """Put a two-plane LM head's one or two rows on fbgemm's int8 GEMM; says so."""
        if os.environ.get(INT8_LM_HEAD_ENV, "1") in ("", "0"):
            return ""
        from pagedlm_cpu.int8_rows import MAX_ROWS, install_int8_rows

        available = _available_memory_bytes()
        if install_int8_rows(model, None if available is None else available // 4) == 0:
            return ""
        return f"; the LM head's 1-{MAX_ROWS} rows on fbgemm int8 ({INT8_LM_HEAD_ENV}=0: int4)"

    def _dense_copy_dtype(self) -> torch.dtype:
        """bf16 copies where the model computes in bf16 and the CPU multiplies bf16 faster
        than float32 (``has_fast_bf16_gemms``); float32 elsewhere (float32 copies are the
        dequantized float32 reference)."""
        config = self._model_config
        if config is not None and config.dtype == torch.bfloat16 and has_fast_bf16_gemms():
            return torch.bfloat16
        return torch.float32

    def _install_dense_copies(self, model: torch.nn.Module) -> str:
        """Give the int4 layers dense copies for larger batches where memory allows
        (a quarter of the memory available, as the KV cache's default); says what it did."""
        from pagedlm_cpu.linear import onednn_available
        from pagedlm_cpu.row_split_linear import (
            DEFAULT_DENSE_FROM_ROWS,
            dense_copy_bytes,
            install_dense_copies,
        )

        dtype = self._dense_copy_dtype()
        kind = str(dtype).removeprefix("torch.")
        try:
            dense_from_rows = int(
                os.environ.get(DENSE_FROM_ROWS_ENV, DEFAULT_DENSE_FROM_ROWS[dtype])
            )
        except ValueError:
            raise ValueError(
                f"{DENSE_FROM_ROWS_ENV} must be a whole number of rows (0: no copies), "
                f"got {os.environ[DENSE_FROM_ROWS_ENV]!r}."
            ) from None
        if dense_from_rows <= 0:
            return f"; no dense copies ({DENSE_FROM_ROWS_ENV}=0)"
        if not onednn_available():
            return "; no dense copies for larger batches: this torch build has no oneDNN"
        available = _available_memory_bytes()
        budget = 1 << 62 if available is None else available // 4
        size_mb = dense_copy_bytes(model, dtype) / 2**20
        if install_dense_copies(model, dense_from_rows, budget, dtype) == 0:
            return (
                f"; no {kind} copies for larger batches: {size_mb:.0f} MB exceed a quarter "
                "of the memory available"
            )
        return (
            f", and from {dense_from_rows} rows a {kind} copy on oneDNN: +{size_mb:.0f} MB; "
            f"{DENSE_FROM_ROWS_ENV}=0 drops it"
        )

    def argmax_rows(self) -> Callable[[torch.Tensor], torch.Tensor]:
        from pagedlm_cpu.argmax import chunked_argmax_rows

        return chunked_argmax_rows

    def zeros(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        # An anonymous mapping: the OS hands out zero pages lazily, so a multi-GiB KV cache
        # costs nothing until it is written (torch.zeros memsets it all). Not numpy's
        # calloc: numpy asks for transparent huge pages on large arrays, and where THP is
        # "madvise" each first write to 2 MiB of the cache then stalled its step 4-5 ms in
        # the kernel's compaction (~0.3 s of a 13 s batch-32 run on Zen 4, against ~0.08 s
        # for the same memory in 4 KiB pages). The system's own THP policy still applies.
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        if hasattr(mmap, "MAP_ANONYMOUS"):
            # Private, as malloc's memory is (Python's default, MAP_SHARED, is shared
            # memory: counted as shmem, and written through by a forked child). The tensor
            # holds a reference to the mapping, which lives as long as it does.
            mapping = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            raw = torch.frombuffer(mapping, dtype=torch.uint8)[:nbytes]
            # Its pages are faulted in ahead of the attention's writes, off the steps.
            prefault.PREFAULTER.register(mapping, raw.data_ptr(), nbytes)
        else:  # Windows: numpy's calloc, lazy there too
            raw = torch.from_numpy(np.zeros(nbytes, dtype=np.uint8))
        return raw.view(dtype).view(shape)

    def kv_cache_memory_bytes(self, bytes_per_block: int | None = None) -> int:
        if KVCACHE_SPACE_ENV in os.environ:
            try:
                gib = float(os.environ[KVCACHE_SPACE_ENV])
            except ValueError:
                raise ValueError(
                    f"{KVCACHE_SPACE_ENV} must be a number of GiB, "
                    f"got {os.environ[KVCACHE_SPACE_ENV]!r}."
                ) from None
            return int(gib * 2**30)
        budget = 4 * 2**30
        available = _available_memory_bytes()
        if available is not None:
            budget = min(budget, available // 4)
        return budget
