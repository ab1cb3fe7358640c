"""Linear kernels over quantized weights on the GPU, installed through ``set_kernel``:
FP8 E4M3 layers (``quantization="fp8"``) and the layers of a ``.gguf`` model or a GPTQ or
AWQ checkpoint, which keep the checkpoint's integer blocks on the device instead of a bf16
copy (``GgufCudaLinear``: a GPTQ/AWQ layer's blocks are GGUF Q4_1- or Q8-like).

Both route by row count only (never by anything else in the step), so a step gives the
same result from a CUDA graph or eagerly:

- FP8: one row through the Triton GEMV (``fp8_gemv``; x unrounded, weights dequantized
  in registers); more rows quantized per token (or by the layer's static input scale) and
  multiplied by ``torch._scaled_mm`` with row-wise scales (compute capability 9.0;
  on 8.9, where torch's row-wise scaling is not assumed, the unscaled product in float32
  scaled afterwards). Shapes ``_scaled_mm`` cannot take (dimensions not multiples of 16)
  use the dequantizing reference.
- GGUF (Q4_0/Q4_1/Q5_*/Q8_0 and Q2_K-Q6_K layers; a scale per 32 columns, per 16 for
  layers with Q2_K, Q3_K or Q6_K rows): one row through ``gguf_gemv_half`` (float16
  products for 16-bit x on 4-bit codes with a scale per 32 columns, ``gguf_gemv``'s
  exact float32 ones otherwise or with ``PAGEDLM_GGUF_EXACT_GEMV=1``; with
  ``PAGEDLM_GGUF_INT8_GEMV=1``, ``gguf_gemv_int8``, x rounded to int8 per 32 columns as
  llama.cpp's and vLLM's GGUF kernels round it; not the default: slower in W2 on an H100,
  session 18); up to ``max_tiled_rows`` through ``gguf_gemm``; more through a bf16 copy
  dequantized into a scratch buffer shared by the model's layers, then ``F.linear``.
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from pagedlm.config import ModelConfig

from pagedlm.model_executor.layers.linear_base import LinearBase
from pagedlm.model_executor.loader.gguf_blocks import AffineBlocks
from pagedlm.model_executor.quantization.fp8 import (
    FP8_DTYPE,
    FP8_MAX,
    Fp8ReferenceLinear,
    is_fp8_layer,
)

logger = logging.getLogger(__name__)

DEQUANTIZE_GGUF_ENV = "PAGEDLM_CUDA_DEQUANTIZE_GGUF"
"""Set to 1 to compute GGUF (and GPTQ, AWQ) models on dequantized weights (the parity
reference)."""
FP8_MIN_CAPABILITY = (8, 9)
DEFAULT_MAX_TILED_ROWS = 64
"""Rows up to which GGUF layers use the tiled dequantizing GEMM (a first guess until the
H200 sweep in ``pagedlm.benchmarks.quantized_gpu`` places the crossover)."""


def check_fp8_device(device: torch.device) -> None:
    """Raise ``ValueError`` unless ``device`` computes E4M3 (CUDA compute capability 8.9+)."""
    if torch.version.hip is not None:
        raise ValueError(
            "quantization='fp8' is not supported on ROCm yet (its FP8 format differs); "
            "drop --quantization fp8."
        )
    capability = torch.cuda.get_device_capability(device)
    if capability < FP8_MIN_CAPABILITY:
        name = torch.cuda.get_device_name(device)
        raise ValueError(
            f"quantization='fp8' needs a GPU with FP8 tensor cores (compute capability 8.9 or "
            f"newer: Ada, Hopper, Blackwell); {name} is {capability[0]}.{capability[1]}. "
            "Drop --quantization fp8 (or use a bf16 or GGUF checkpoint)."
        )


class Fp8CudaLinear:
    """``x W^T + b`` for an E4M3 layer. x [tokens, in] -> [tokens, out] in x's dtype."""

    def __init__(self, layer: LinearBase) -> None:
        self.layer = layer
        weight = layer.weight
        self.scale_column = layer.weight_scale.detach().reshape(-1).contiguous()
        self.scale_row = self.scale_column.view(1, -1)
        bias = layer.linear_bias
        self.bias = None if bias is None else bias.detach()
        n, k = weight.shape
        self.fits_scaled_mm = n % 16 == 0 and k % 16 == 0
        self.row_wise = torch.cuda.get_device_capability(weight.device) >= (9, 0)
        self.unit_scale = torch.ones((), device=weight.device)
        self.reference = Fp8ReferenceLinear(layer)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        from pagedlm_cuda.kernels.fp8_gemv import fp8_gemv

        weight = self.layer.weight
        if x.dim() == 2 and x.shape[0] == 1 and x.stride(1) == 1:
            return fp8_gemv(x, weight, self.scale_column, self.bias)
        if not self.fits_scaled_mm:
            return self.reference(x)
        codes, x_scales = self._quantize(x.contiguous())
        if self.row_wise:
            # The bias is added afterwards: which bias dtypes row-wise scaling takes has
            # changed between torch releases, and llama-family layers have none.
            out = torch._scaled_mm(
                codes, weight.t(), scale_a=x_scales, scale_b=self.scale_row,
                out_dtype=torch.bfloat16,
            )  # fmt: skip
        else:
            out = torch._scaled_mm(
                codes, weight.t(), scale_a=self.unit_scale, scale_b=self.unit_scale,
                out_dtype=torch.float32,
            )  # fmt: skip
            out = out * x_scales * self.scale_row
        out = out.to(x.dtype)
        return out if self.bias is None else out + self.bias

    def _quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        from pagedlm_cuda.kernels.fp8_gemv import quantize_per_token

        input_scale = getattr(self.layer, "input_scale", None)
        if input_scale is None:
            return quantize_per_token(x)
        codes = (x.float() / input_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
        return codes, input_scale.float().reshape(1, 1).expand(x.shape[0], 1).contiguous()


@dataclass
class DenseScratch:
    """The bf16 (model dtype) buffer large batches dequantize into, shared by all layers."""

    buffer: torch.Tensor | None = field(default=None)

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        if self.buffer is None or self.buffer.numel() < numel or self.buffer.dtype != dtype:
            self.buffer = torch.empty(numel, dtype=dtype, device=device)
        return self.buffer


class GgufCudaLinear:
    """``x W^T + b`` on a layer's GGUF blocks. x [tokens, in] -> [tokens, out]."""

    def __init__(
        self,
        blocks: AffineBlocks,
        bias: torch.Tensor | None,
        device: torch.device,
        scratch: DenseScratch,
        max_tiled_rows: int = DEFAULT_MAX_TILED_ROWS,
    ) -> None:
        from pagedlm_cuda.kernels.gguf_gemv import gguf_gemv, pack_blocks
        from pagedlm_cuda.kernels.gguf_gemv_half import gguf_gemv_half, half_gemv_enabled
        from pagedlm_cuda.kernels.gguf_gemv_int8 import gguf_gemv_int8, int8_gemv_enabled

        self.packed = pack_blocks(blocks.codes, blocks.scales, blocks.mins, device)
        self.bias = None if bias is None else bias.detach()
        self.scratch = scratch
        self.max_tiled_rows = max_tiled_rows
        if int8_gemv_enabled():
            self.gemv = gguf_gemv_int8
        else:
            self.gemv = gguf_gemv_half if half_gemv_enabled() else gguf_gemv

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        from pagedlm_cuda.kernels.gguf_gemm import dequantize_into, gguf_gemm

        x = x if x.stride(-1) == 1 else x.contiguous()
        rows = x.shape[0]
        if rows == 1:
            return self.gemv(x, self.packed, self.bias)
        if rows <= self.max_tiled_rows:
            return gguf_gemm(x, self.packed, self.bias)
        numel = self.packed.out_features * self.packed.in_features
        weight = dequantize_into(self.packed, self.scratch.take(numel, x.dtype, x.device))
        return F.linear(x, weight, self.bias)


def _release_weight(module: LinearBase, uses: Counter[int]) -> None:
    """Free a layer's dense weight once its kernel holds the blocks, unless another module
    (a tied embedding) still reads it."""
    if uses[id(module.weight)] == 1:
        module.weight.data = module.weight.data.new_empty(0)


def install_fp8_kernels(model: nn.Module) -> int:
    """Give every E4M3 layer of ``model`` the GPU kernels; returns how many (checks that the
    device computes FP8 first)."""
    layers = [m for m in model.modules() if is_fp8_layer(m)]
    if layers:
        check_fp8_device(layers[0].weight.device)
    for layer in layers:
        layer.set_kernel(Fp8CudaLinear(layer))
    return len(layers)


def install_gguf_kernels(
    model: nn.Module,
    blocks_by_name: dict[str, AffineBlocks],
    max_tiled_rows: int = DEFAULT_MAX_TILED_ROWS,
) -> int:
    """Give each named ``LinearBase`` a ``GgufCudaLinear`` over its blocks and free its dense
    weight; returns how many."""
    uses = Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    scratch = DenseScratch()
    count = 0
    for name, module in model.named_modules():
        blocks = blocks_by_name.get(name)
        if blocks is None or not isinstance(module, LinearBase):
            continue
        device = module.weight.device
        module.set_kernel(
            GgufCudaLinear(blocks, module.linear_bias, device, scratch, max_tiled_rows)
        )
        _release_weight(module, uses)
        count += 1
    return count


def computes_on_weight_blocks(model_config: ModelConfig) -> bool:
    """Whether a model of ``model_config`` runs its quantized layers on their blocks (the
    platform's ``computes_on_weight_blocks``): a ``.gguf`` file's, a GPTQ or AWQ
    checkpoint's, unless ``PAGEDLM_CUDA_DEQUANTIZE_GGUF=1``."""
    return model_config.has_weight_blocks and os.environ.get(DEQUANTIZE_GGUF_ENV, "0") in ("", "0")


def install_quantized_kernels(model: nn.Module, model_config: ModelConfig | None) -> None:
    """The GPU kernels of ``model``'s quantized layers: its E4M3 ones, and, when it is the
    model of a GGUF file or a GPTQ or AWQ checkpoint (not a draft model sharing the
    config), its blocks: those the loader kept (the model runner loads such a model keeping
    them, the float weights of their layers never made), those with groups of 16 included."""
    fp8_layers = install_fp8_kernels(model)
    gguf_layers = 0
    if (
        model_config is not None
        and computes_on_weight_blocks(model_config)
        and getattr(model, "arch", None) == model_config.arch
    ):
        from pagedlm.model_executor.loader import quantized_linear_blocks

        blocks = quantized_linear_blocks(model, model_config, groups_of_16=True)
        gguf_layers = install_gguf_kernels(model, blocks)
        torch.cuda.empty_cache()  # the dense weights just freed
    if fp8_layers or gguf_layers:
        logger.info(
            "CUDA quantized linear layers: %d in FP8, %d on the checkpoint's integer blocks "
            "(%s=1 computes GGUF, GPTQ and AWQ models on dequantized weights).",
            fp8_layers,
            gguf_layers,
            DEQUANTIZE_GGUF_ENV,
        )
