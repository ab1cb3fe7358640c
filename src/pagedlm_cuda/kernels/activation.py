"""SiLU-and-mul: the gated activation of SwiGLU MLPs."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedlm_cuda.kernels import pdl


@triton.jit
def silu_times(gate, up):
    """``silu(gate) * up`` in float32, with silu rounded to the activation dtype before the
    product, like ``F.silu(gate) * up``: the activation kernel's arithmetic, which the
    GEMV's and the few-row GEMM's epilogues share so that they give its bits."""
    g32 = gate.to(tl.float32)
    silu = (g32 / (1.0 + tl.exp(-g32))).to(gate.dtype)
    return silu.to(tl.float32) * up.to(tl.float32)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, x_stride, d, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    pdl.start(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    gate = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * x_stride + d + cols, mask=mask, other=0.0)
    out = silu_times(gate, up)
    tl.store(out_ptr + row * d + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [num_tokens, 2 * d] (gate then up) -> silu(gate) * up [num_tokens, d]."""
    rows, two_d = x.shape
    d = two_d // 2
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty((rows, d), dtype=x.dtype, device=x.device)
    if rows == 0:
        return out
    block = min(1024, triton.next_power_of_2(d))
    _silu_and_mul_kernel[(rows, triton.cdiv(d, block))](
        x, out, x.stride(0), d, BLOCK=block, **pdl.launch_options()
    )
    return out
