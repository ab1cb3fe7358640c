"""RMSNorm, optionally fused with the residual add before it, one row per program."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedlm_cuda.kernels import pdl


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    residual_out_ptr,
    x_stride,
    residual_stride,
    hidden_size,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl.allow_next(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden_size
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0)  # a weight: read before the wait
    pdl.wait_for_previous(USE_PDL)
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * residual_stride + cols, mask=mask, other=0.0)
        # Round the sum to the activation dtype, as the unfused layer does.
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(residual_out_ptr + row * hidden_size + cols, x, mask=mask)
    x32 = x.to(tl.float32)
    variance = tl.sum(x32 * x32, axis=0) / hidden_size
    normed = (x32 * tl.rsqrt(variance + eps)).to(x.dtype)
    out = normed.to(tl.float32) * w.to(tl.float32)
    tl.store(out_ptr + row * hidden_size + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def _launch(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    hidden = x.shape[-1]
    x2 = x.reshape(-1, hidden)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    rows = x2.shape[0]
    out_dtype = torch.promote_types(x.dtype, weight.dtype)
    out = torch.empty((rows, hidden), dtype=out_dtype, device=x.device)
    res2 = residual_out = None
    if residual is not None:
        res2 = residual.reshape(-1, hidden)
        if res2.stride(-1) != 1:
            res2 = res2.contiguous()
        residual_out = torch.empty((rows, hidden), dtype=x.dtype, device=x.device)
    if rows > 0:
        _rms_norm_kernel[(rows,)](
            x2,
            res2 if res2 is not None else x2,
            weight,
            out,
            residual_out if residual_out is not None else out,
            x2.stride(0),
            res2.stride(0) if res2 is not None else 0,
            hidden,
            eps,
            HAS_RESIDUAL=residual is not None,
            BLOCK=triton.next_power_of_2(hidden),
            **pdl.launch_options(),
        )
    out = out.view(x.shape)
    return out, None if residual_out is None else residual_out.view(x.shape)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., hidden] -> ``weight * (x / sqrt(mean(x^2) + eps))`` with float32 statistics."""
    return _launch(x, None, weight, eps)[0]


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, residual) [..., hidden] -> (rms_norm(x + residual), x + residual), one pass."""
    out, residual_out = _launch(x, residual, weight, eps)
    assert residual_out is not None
    return out, residual_out
