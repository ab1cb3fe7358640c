"""FP8 (E4M3) weights: per-output-channel weight scales, per-token activation scales.

A quantized linear layer keeps three tensors, as parameters so that loaders, memory
accounting and ``.to(device)`` treat them like any weight:

- ``weight``: ``float8_e4m3fn [out, in]``, the codes (1 byte per weight);
- ``weight_scale``: ``float32 [out, 1]``, so that ``weight[r] * weight_scale[r]`` is row
  ``r`` of the float weight (a checkpoint's per-tensor scale is repeated over its rows);
- ``input_scale``: ``float32 [1]``, only for checkpoints with static activation scales.

Activations are quantized per token (each row's absmax maps to E4M3's largest value, 448)
unless the layer has a static ``input_scale``. The product of the codes accumulates in
float32 and is scaled once per output: ``y[t, r] = (xq[t] . wq[r]) * x_scale[t] *
weight_scale[r] + b[r]``.

``Fp8ReferenceLinear`` computes exactly that by dequantizing to float32: it is the kernel
every quantized layer starts with (so the model runs on any platform, the CPU included,
where E4M3 storage is emulated) and the reference the GPU kernels are tested against.
Platforms replace it through ``set_kernel``; they recognize quantized layers by the
weight's dtype (``is_fp8_layer``).
"""

from __future__ import annotations

import torch
from torch import nn

from pagedlm.model_executor.layers.linear import RowParallelLinear
from pagedlm.model_executor.layers.linear_base import LinearBase
from pagedlm.model_executor.layers.vocab_embedding import ParallelLMHead
from pagedlm.model_executor.loader.weight_utils import (
    copy_checked,
    get_weight_loader,
    set_weight_loader,
)

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)
"""448: the largest finite E4M3 value."""
_MIN_SCALE = 1.0 / (FP8_MAX * 512.0)
"""Floor of a dynamic scale, so that an all-zero row quantizes to zeros instead of NaN."""


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [rows, cols] -> (codes ``float8_e4m3fn [rows, cols]``, scales ``float32 [rows, 1]``)
    with ``x ~ codes * scales``; each row's largest magnitude becomes 448."""
    amax = x.abs().amax(dim=-1, keepdim=True).float()
    scales = (amax / FP8_MAX).clamp_min(_MIN_SCALE)
    return quantize_with_scale(x, scales), scales


def quantize_with_scale(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x / scale`` saturated to E4M3's range (``scale`` broadcasts: [rows, 1] or [1])."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def dequantize(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float32 ``codes * scales`` (scales broadcast over rows: [rows, 1])."""
    return codes.float() * scales


def quantize_activations(
    x: torch.Tensor, input_scale: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes [tokens, in], float32 scales [tokens, 1]): per token, or the static scale."""
    if input_scale is None:
        return quantize_rows(x)
    scale = input_scale.float().reshape(1, 1)
    return quantize_with_scale(x, scale), scale.expand(x.shape[0], 1)


def is_fp8_layer(module: nn.Module) -> bool:
    return isinstance(module, LinearBase) and module.weight.dtype == FP8_DTYPE


class Fp8ReferenceLinear:
    """``x W^T + b`` for a quantized layer, dequantizing in float32. x [tokens, in] (any
    float dtype) -> [tokens, out] in x's dtype. Reads the layer's tensors at each call, so
    it follows the layer when it moves."""

    def __init__(self, layer: LinearBase) -> None:
        self.layer = layer

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        layer = self.layer
        codes, x_scales = quantize_activations(x, getattr(layer, "input_scale", None))
        out = codes.float() @ layer.weight.float().T
        out = out * x_scales * layer.weight_scale.view(1, -1)
        bias = layer.linear_bias
        if bias is not None:
            out = out + bias.float()
        return out.to(x.dtype)


def _scale_loader(layer: LinearBase):
    """A weight loader for ``weight_scale [out, 1]`` taking the checkpoint's per-row scales
    of one tensor (``[rows]`` or ``[rows, 1]``; per-tensor scales already repeated over
    rows). Row-parallel layers split their inputs, not their rows, and replicated layers
    (no ``weight_loader`` of their own: DeepSeek's ``q_a_proj``) split nothing: every rank
    holds all of them."""

    def load(param: nn.Parameter, loaded: torch.Tensor, *shard_id: object) -> None:
        loaded = loaded.reshape(-1, 1)
        if isinstance(layer, RowParallelLinear) or not hasattr(layer, "weight_loader"):
            copy_checked(param.data, loaded, "weight_scale")
        else:
            layer.weight_loader(param, loaded, *shard_id)

    return load


def _max_loader(param: nn.Parameter, loaded: torch.Tensor, *shard_id: object) -> None:
    """Merged projections (q/k/v, gate/up) share one static input scale: the largest of
    their checkpoint tensors' (so that no shard's activations saturate)."""
    param.data.copy_(torch.maximum(param.data, loaded.reshape(1).to(param.dtype)))


def add_fp8_parameters(layer: LinearBase, static_input_scale: bool) -> None:
    """Turn ``layer`` into a quantized layer awaiting a checkpoint's codes and scales: an
    E4M3 ``weight`` of the same shape (loaded by the same loader), ``weight_scale`` and,
    with ``static_input_scale``, ``input_scale``; its kernel is the reference one."""
    old = layer.weight
    weight = nn.Parameter(torch.empty(old.shape, dtype=FP8_DTYPE, device=old.device), False)
    set_weight_loader(weight, get_weight_loader(old))
    layer.weight = weight
    scale = nn.Parameter(torch.empty(old.shape[0], 1, device=old.device), requires_grad=False)
    set_weight_loader(scale, _scale_loader(layer))
    layer.weight_scale = scale
    if static_input_scale:
        input_scale = nn.Parameter(torch.zeros(1, device=old.device), requires_grad=False)
        set_weight_loader(input_scale, _max_loader)
        layer.input_scale = input_scale
    layer.set_kernel(Fp8ReferenceLinear(layer))


def quantize_layer(layer: LinearBase) -> None:
    """Quantize a loaded float layer in place (``quantization="fp8"`` on a float checkpoint):
    the float weight is dropped as soon as its codes exist."""
    codes, scales = quantize_rows(layer.weight.data)
    layer.weight = nn.Parameter(codes, requires_grad=False)
    layer.weight_scale = nn.Parameter(scales, requires_grad=False)
    layer.set_kernel(Fp8ReferenceLinear(layer))


def quantize_model(model: nn.Module) -> int:
    """Quantize every linear layer of a loaded float model except the LM head (its error
    would land directly on the logits, and a tied head shares the embedding table) and MoE
    routers (``LinearBase.quantized_at_load``), and the experts of every ``FusedMoE`` that
    computes them itself (``FusedMoE.quantize_fp8``: weight-only); returns how many layers.
    Layers that are already E4M3 (a pre-quantized checkpoint) are left."""
    count = 0
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "quantize_fp8"):  # a FusedMoE (which imports this module)
                if module.kernel is None and not module.is_fp8 and not module.w13.is_meta:
                    module.quantize_fp8()
                    count += 1
                continue
            if (
                isinstance(module, LinearBase)
                and not isinstance(module, ParallelLMHead)
                and module.quantized_at_load
                and not is_fp8_layer(module)
                and module.weight.dim() == 2
            ):
                quantize_layer(module)
                count += 1
    return count


__all__ = [
    "FP8_DTYPE",
    "FP8_MAX",
    "Fp8ReferenceLinear",
    "add_fp8_parameters",
    "dequantize",
    "is_fp8_layer",
    "quantize_activations",
    "quantize_model",
    "quantize_rows",
]
