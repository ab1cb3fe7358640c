"""Hands the model's norm, rotary and activation layers their fused Triton kernels.

Called from ``CudaPlatform.prepare_model`` (and ROCm's): the layers keep their weights and
torch code; only their ``kernel`` hook changes, so core model code never asks which device
it runs on.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedlm.model_executor.layers.activation import SiluAndMul
from pagedlm.model_executor.layers.layernorm import RMSNorm
from pagedlm.model_executor.layers.rotary_embedding import RotaryEmbedding


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
) -> tuple[torch.Tensor, torch.Tensor]:
    from pagedlm_cuda.kernels import rotary_embedding

    return rotary_embedding(positions, query, key, cos_sin_cache, head_dim, is_neox_style)


def _silu_and_mul_kernel(x: torch.Tensor) -> torch.Tensor:
    from pagedlm_cuda.kernels import silu_and_mul

    return silu_and_mul(x)


def install_fused_kernels(model: nn.Module) -> int:
    """Point every RMSNorm, RotaryEmbedding and SiluAndMul of ``model`` at the Triton
    kernels; returns how many layers were switched. Rotary layers whose head_dim is not a
    power of two keep the torch code (the kernel tiles whole halves)."""
    switched = 0
    for module in model.modules():
        if isinstance(module, RMSNorm) and type(module) is RMSNorm:
            module.set_kernel(_rms_norm_kernel)
        elif isinstance(module, RotaryEmbedding) and type(module) is RotaryEmbedding:
            if module.head_dim & (module.head_dim - 1):
                continue
            module.set_kernel(_rotary_kernel)
        elif isinstance(module, SiluAndMul):
            module.set_kernel(_silu_and_mul_kernel)
        else:
            continue
        switched += 1
    return switched
