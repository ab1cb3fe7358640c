"""Hands the model's norm, rotary, activation, linear and MoE layers their Triton kernels.

Called from ``CudaPlatform.prepare_model`` (and ROCm's): the layers keep their weights and
torch code; only their ``kernel`` hook changes, so core model code never asks which device
it runs on.
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F
from torch import nn

from pagedlm.model_executor.layers.activation import SiluAndMul
from pagedlm.model_executor.layers.layernorm import RMSNorm
from pagedlm.model_executor.layers.linear_base import LinearBase
from pagedlm.model_executor.layers.moe import FusedMoE
from pagedlm.model_executor.layers.rotary_embedding import RotaryEmbedding
from pagedlm.model_executor.layers.rotary_mrope import MRotaryEmbedding
from pagedlm.model_executor.quantization.fp8 import FP8_DTYPE


def _rms_norm_kernel(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    from pagedlm_cuda.kernels import fused_add_rms_norm, rms_norm

    if residual is None:
        return rms_norm(x, weight, eps)
    return fused_add_rms_norm(x, residual, weight, eps)


def _rotary_kernel(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    head_dim: int,
    is_neox_style: bool,
    qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    from pagedlm_cuda.kernels import rotary_embedding

    return rotary_embedding(
        positions, query, key, cos_sin_cache, head_dim, is_neox_style, qk_norm=qk_norm
    )


def _silu_and_mul_kernel(x: torch.Tensor) -> torch.Tensor:
    from pagedlm_cuda.kernels import silu_and_mul

    return silu_and_mul(x)


class SingleRowLinear:
    """A linear layer's kernel: one-row inputs (a lone sequence's decode step) through the
    Triton GEMV, 2 to 32 rows of a 16-bit layer (a speculative verification step, a small
    batch, a short chunk's padded piece; from 17 rows not the LM head) on Hopper through
    the few-row GEMM (``gemm_rows``),
    which both stream the weight faster than cuBLAS at those shapes; every other batch
    through ``F.linear``. The choice depends on the row count and dtypes only, so a step
    gives the same result from a CUDA graph or eagerly."""

    def __init__(self, layer: LinearBase) -> None:
        self.layer = layer

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        from pagedlm_cuda.kernels.gemm_rows import gemm_rows
        from pagedlm_cuda.kernels.gemv import gemv

        layer = self.layer
        if _one_row(x):
            return gemv(x, layer.weight, layer.linear_bias)
        if _few_rows(x, layer.weight):
            return gemm_rows(x, layer.weight, layer.linear_bias)
        return F.linear(x, layer.weight, layer.linear_bias)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor | None:
        """``silu_and_mul`` of this (gate over up) layer's output in the GEMV's (one row) or
        the few-row GEMM's (2 to 32 rows) epilogue (``SiluAndMul.after``); None for other
        inputs."""
        from pagedlm_cuda.kernels.gemm_rows import gemm_rows
        from pagedlm_cuda.kernels.gemv import gemv

        layer = self.layer
        if layer.weight.shape[0] % 2 or not _gemv_silu_on():
            return None
        if _one_row(x):
            return gemv(x, layer.weight, layer.linear_bias, silu_and_mul=True)
        if _few_rows(x, layer.weight):
            return gemm_rows(x, layer.weight, layer.linear_bias, silu_and_mul=True)
        return None


def _one_row(x: torch.Tensor) -> bool:
    """One unit-stride row: what the GEMV takes."""
    return x.dim() == 2 and x.shape[0] == 1 and x.stride(1) == 1


def _few_rows(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """2 to ``_gemm_rows_max()`` unit-stride rows of the weight's own 16-bit dtype, where
    ``gemm_rows`` beats cuBLAS: what it takes."""
    from pagedlm_cuda.kernels.gemm_rows import beats_cublas

    return (
        x.dim() == 2
        and 2 <= x.shape[0] <= _gemm_rows_max()
        and beats_cublas(x.shape[0], weight.shape[0])
        and x.stride(1) == 1
        and weight.stride(1) == 1
        and x.dtype == weight.dtype
        and x.dtype in (torch.float16, torch.bfloat16)
        and _gemm_rows_on()
    )


GEMM_ROWS_ENV = "PAGEDLM_GEMM_ROWS"
"""``0``: 2 to 32 rows go to ``F.linear`` again (to measure)."""


@functools.cache
def _gemm_rows_on() -> bool:
    """The few-row GEMM beats cuBLAS where it runs on the warpgroup MMA (Hopper and
    later, measured on the H100); older GPUs and ROCm keep ``F.linear``. Without a GPU
    (the Triton interpreter of the tests) it runs."""
    if os.environ.get(GEMM_ROWS_ENV, "1") == "0":
        return False
    if not torch.cuda.is_available():
        return True
    return torch.version.hip is None and torch.cuda.get_device_capability() >= (9, 0)


GEMM_ROWS_MAX_ENV = "PAGEDLM_GEMM_ROWS_MAX"
"""The most rows the few-row GEMM takes (default ``gemm_rows.DEFAULT_ROWS_MAX``, at most
``gemm_rows.MAX_ROWS``; to measure)."""


@functools.cache
def _gemm_rows_max() -> int:
    from pagedlm_cuda.kernels.gemm_rows import DEFAULT_ROWS_MAX, MAX_ROWS

    value = os.environ.get(GEMM_ROWS_MAX_ENV, str(DEFAULT_ROWS_MAX))
    if not value.isdigit() or not 2 <= int(value) <= MAX_ROWS:
        raise ValueError(
            f"{GEMM_ROWS_MAX_ENV} must be a row count from 2 to {MAX_ROWS}; got {value!r}."
        )
    return int(value)


GEMV_SILU_ENV = "PAGEDLM_GEMV_SILU"
"""``0``: MLPs of 1 to 32 rows run SiLU-and-mul as a kernel of its own again (to measure)."""


@functools.cache
def _gemv_silu_on() -> bool:
    return os.environ.get(GEMV_SILU_ENV, "1") != "0"


_GEMV_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


_16_BIT = (torch.float16, torch.bfloat16)

FUSED_MOE_ENV = "PAGEDLM_FUSED_MOE"
"""``0``: MoE layers group tokens by expert on the host (``expert_groups``) and their
models run eagerly. By default they run through ``FusedExperts`` and their models under
CUDA graphs (its GPU tests passed on an H100 in session 44: Mixtral and Qwen3-MoE through
``LLM`` give their eager tokens; DeepSeek-V2-Lite ran 9.5x the eager throughput)."""


class FusedExperts:
    """A ``FusedMoE``'s routed experts through the grouped GEMM (``kernels/fused_moe.py``):
    the routing aligned into expert blocks on the device and no host wait, so a model of
    such layers can be captured in CUDA graphs."""

    def __init__(self, layer: FusedMoE) -> None:
        from pagedlm_cuda.kernels.fused_moe import fused_experts

        self.layer = layer
        self.fused_experts = fused_experts  # imported once, not per call

    @staticmethod
    def takes(layer: FusedMoE) -> bool:
        """SiLU-and-mul experts with 16-bit weights of one dtype or E4M3 ones
        (``FusedMoE.quantize_fp8``), no kernel of their own, unless ``PAGEDLM_FUSED_MOE=0``;
        others keep ``expert_groups``."""
        w13, w2 = layer.w13, layer.w2
        return (
            os.environ.get(FUSED_MOE_ENV, "1") != "0"
            and layer.kernel is None
            and type(layer.act_fn) is SiluAndMul
            # float32: exact only through FMA dots (input_precision="ieee"), slower than cuBLAS
            and w13.dtype in (*_16_BIT, FP8_DTYPE)
            and w2.dtype == w13.dtype
            # E4M3 codes widen to the 16-bit activations (the router is in the model dtype)
            and (w13.dtype != FP8_DTYPE or layer.gate.weight.dtype in _16_BIT)
            and not w13.is_meta
            and w13.stride(2) == 1
            and w2.stride(2) == 1
        )

    def __call__(
        self, x: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor
    ) -> torch.Tensor:
        layer = self.layer
        scales = (layer.w13_scale, layer.w2_scale) if layer.is_fp8 else None
        return self.fused_experts(
            x,
            layer.w13,
            layer.w2,
            weights,
            expert_ids,
            layer.expert_start,
            layer.num_experts,
            scales=scales,
            batch_invariant=bool(layer.row_tile),
        )


_PLAIN_ROTARY = (RotaryEmbedding, MRotaryEmbedding)
"""Rotary classes whose kernel calls are plain RoPE over ``cos_sin_cache`` (M-RoPE hands
the kernel only its [T] positions, text tokens'; its [3, T] steps run the torch code)."""


def install_fused_kernels(model: nn.Module) -> int:
    """Point every RMSNorm, RotaryEmbedding and SiluAndMul of ``model`` at the Triton
    kernels, every plain linear layer (float weights, no kernel of its own such as a
    bitsandbytes one) at ``SingleRowLinear`` and every ``FusedMoE`` that
    ``FusedExperts.takes`` at the grouped GEMM (capturable from then on); returns how many
    layers were switched.
    Rotary layers whose head_dim is not a power of two keep the torch code (the kernel
    tiles whole halves)."""
    switched = 0
    for module in model.modules():
        if isinstance(module, LinearBase):
            if module.kernel is not None or module.weight.dtype not in _GEMV_DTYPES:
                continue
            module.set_kernel(SingleRowLinear(module))
        elif RMSNorm.takes_kernel(module):
            module.set_kernel(_rms_norm_kernel)
        elif isinstance(module, RotaryEmbedding) and type(module) in _PLAIN_ROTARY:
            if module.head_dim & (module.head_dim - 1):
                continue
            module.set_kernel(_rotary_kernel)
        elif isinstance(module, SiluAndMul):
            module.set_kernel(_silu_and_mul_kernel)
        elif isinstance(module, FusedMoE):
            if not FusedExperts.takes(module):
                continue
            module.set_kernel(FusedExperts(module), capturable=True)
        else:
            continue
        switched += 1
    return switched
