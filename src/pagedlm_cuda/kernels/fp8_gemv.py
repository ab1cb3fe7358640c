"""FP8 (E4M3) weights on the GPU: the batch-1 GEMV, and per-token activation quantization
for ``torch._scaled_mm`` at larger batches.

``fp8_gemv``: ``y = (x . W[r]) * weight_scale[r] + b[r]`` for one row of ``x``: the bf16
GEMV (``gemv.py``) run over 1-byte weights: each program owns ``BLOCK_N`` whole rows of
``W``, streams them in ``BLOCK_K`` slices, converts the codes to float32 in registers and
accumulates in float32; the row's scale is applied once, at the end. ``x`` stays in its
own dtype (no activation rounding at batch 1: the weights' bytes are the whole cost, so
quantizing ``x`` would buy nothing). Batch 1 of llama-3-8b reads 8 GB of weights per
token instead of 16; the slices hold as many elements as the bf16 GEMV's (so the same
registers per thread) and half the bytes. Not yet measured on the H200:
``pagedlm.benchmarks.quantized_gpu --gemv-sweep`` prints the configurations' times.

``quantize_per_token``: x [M, K] -> (E4M3 codes [M, K], float32 scales [M, 1]), one
program per row, two passes over it (absmax, then scale and round): the activation side
of ``_scaled_mm``'s row-wise scaling, in one launch instead of five torch kernels.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedlm_cuda.kernels import pdl
from pagedlm_cuda.kernels.gemv import GemvConfig, gemv

FP8_MAX = 448.0
_MIN_SCALE = 1.0 / (FP8_MAX * 512.0)
"""Matches ``pagedlm.model_executor.quantization.fp8``: an all-zero row gets codes 0."""


def fp8_gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: GemvConfig | None = None,
) -> torch.Tensor:
    """x [1, K] (unit-stride row, any float dtype), weight [N, K] float8_e4m3fn (unit-stride
    rows), weight_scale float32 [N] or [N, 1], bias [N] or None -> [1, N] in x's dtype."""
    if weight.dtype != torch.float8_e4m3fn:
        raise ValueError(f"fp8_gemv takes a float8_e4m3fn weight; got {weight.dtype}.")
    return gemv(x, weight, bias, weight_scale, config)


@triton.jit
def _quantize_rows_kernel(
    x_ptr, codes_ptr, scales_ptr, K, stride_x, stride_codes,
    FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr, BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    # FP8_MAX and MIN_SCALE come in as constexpr arguments: a jit function may not read a
    # plain module global (Triton refuses it when compiling; the interpreter does not).
    pdl.allow_next(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_K)
    pdl.wait_for_previous(USE_PDL)
    amax = tl.zeros((BLOCK_K,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        x = tl.load(x_ptr + row * stride_x + k0 + cols, mask=k0 + cols < K, other=0.0)
        amax = tl.maximum(amax, tl.abs(x.to(tl.float32)))
    scale = tl.maximum(tl.max(amax, axis=0) / FP8_MAX, MIN_SCALE)
    for k0 in range(0, K, BLOCK_K):
        mask = k0 + cols < K
        x = tl.load(x_ptr + row * stride_x + k0 + cols, mask=mask, other=0.0)
        q = tl.clamp(x.to(tl.float32) / scale, -FP8_MAX, FP8_MAX)
        tl.store(
            codes_ptr + row * stride_codes + k0 + cols, q.to(codes_ptr.dtype.element_ty), mask=mask
        )
    tl.store(scales_ptr + row, scale)


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (unit-stride rows) -> (codes float8_e4m3fn [M, K], scales float32 [M, 1]),
    each row's absmax mapped to 448."""
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"quantize_per_token takes [M, K] with unit-stride rows; got {x.shape}.")
    m, k = x.shape
    codes = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if m:
        block_k = min(triton.next_power_of_2(k), 4096)
        _quantize_rows_kernel[(m,)](
            x, codes, scales, k, x.stride(0), codes.stride(0),
            FP8_MAX=FP8_MAX, MIN_SCALE=_MIN_SCALE, BLOCK_K=block_k,
            num_warps=4 if block_k <= 1024 else 8, **pdl.launch_options(),
        )  # fmt: skip
    return codes, scales
