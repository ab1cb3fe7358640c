"""The one place a linear layer multiplies, so a platform can swap in its own GEMM.

Every layer that computes ``x W^T + b`` (the tensor-parallel linears and the LM head)
derives from ``LinearBase`` and calls ``self.apply_linear(x)``. After loading, a platform
may hand each such layer a kernel (``set_kernel``), e.g. a prepacked oneDNN matmul on CPU
or a quantized GEMM; the layer's weight stays the source of truth for loading and shapes.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

LinearKernel = Callable[[torch.Tensor], torch.Tensor]
"""x [num_tokens, in_features] -> [num_tokens, out_features], bias included."""


class LinearBase(nn.Module):
    kernel: LinearKernel | None = None

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
