"""The one place a linear layer multiplies, so a platform can swap in its own GEMM.

Every layer that computes ``x W^T + b`` (the tensor-parallel linears and the LM head)
derives from ``LinearBase`` and calls ``self.apply_linear(x)``. After loading, a platform
may hand each such layer a kernel (``set_kernel``), e.g. a prepacked oneDNN matmul on CPU
or a quantized GEMM; the layer's weight stays the source of truth for loading and shapes.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

LinearKernel = Callable[[torch.Tensor], torch.Tensor]
"""x [num_tokens, in_features] -> [num_tokens, out_features], bias included."""

_DEFERRED = contextvars.ContextVar("pagedlm_deferred_linear_weights", default=False)


@contextmanager
def deferred_weights() -> Iterator[None]:
    """Linear layers built inside get their weight on the meta device, taking no memory: a
    loader that will replace some layers by kernels over quantized blocks (GGUF) allocates
    only the weights it fills (``gguf_quantized.load_gguf_keeping_blocks``)."""
    token = _DEFERRED.set(True)
    try:
        yield
    finally:
        _DEFERRED.reset(token)


def linear_weight(rows: int, cols: int) -> nn.Parameter:
    """A linear layer's weight [rows, cols], uninitialized, in the default dtype on the
    current device (on the meta device inside ``deferred_weights``)."""
    device = torch.device("meta") if _DEFERRED.get() else None
    return nn.Parameter(torch.empty(rows, cols, device=device), requires_grad=False)


class LinearBase(nn.Module):
    kernel: LinearKernel | None = None
    quantized_at_load: ClassVar[bool] = True
    """Whether ``quantization="fp8"`` / ``"bitsandbytes"`` quantize this layer at load.
    MoE routers say no, as vLLM builds its gates without a quantization config: a router's
    rounding changes which experts a token gets."""

    @property
    def linear_bias(self) -> torch.Tensor | None:
        """The bias this rank adds (None if there is none)."""
        return getattr(self, "bias", None)

    def set_kernel(self, kernel: LinearKernel | None) -> None:
        """Compute this layer with ``kernel`` from now on (None: back to ``F.linear``)."""
        self.kernel = kernel

    def apply_linear(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None:
            return self.kernel(x)
        return F.linear(x, self.weight, self.linear_bias)
