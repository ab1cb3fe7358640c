"""RMSNorm, optionally fused with the residual add that precedes it."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

RMSNormKernel = Callable[..., "torch.Tensor | tuple[torch.Tensor, torch.Tensor]"]
"""(x, residual | None, weight, eps) -> what ``RMSNorm.forward`` returns for those inputs."""


class RMSNorm(nn.Module):
    """``x / sqrt(mean(x^2) + eps) * weight`` over the last dim, computed in float32.

    ``forward(x)`` returns the normalized ``x``; ``forward(x, residual)`` first forms
    ``x + residual`` (the block's skip connection) and returns ``(normalized, x + residual)``,
    the sum being the next residual. Shapes: [num_tokens, hidden_size] (or any [..., hidden]).
    A platform may hand it a fused kernel (``set_kernel``, from ``Platform.prepare_model``).
    """

    kernel: RMSNormKernel | None = None

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if self.kernel is not None:
            return self.kernel(x, residual, self.weight, self.eps)
        if residual is not None:
            # Summed in the activation dtype, like the reference models do.
            x = x + residual
            residual = x
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * x32.to(dtype)
        return out if residual is None else (out, residual)

    same_math: bool = False
    """A subclass that only reshapes around ``RMSNorm.forward`` (the Transformers
    backend's) sets True, so platforms give it their kernel (``takes_kernel``); any other
    subclass computes something else and keeps its own code."""

    @classmethod
    def takes_kernel(cls, module: nn.Module) -> bool:
        """Whether a platform's RMSNorm kernel computes ``module``."""
        return type(module) is RMSNorm or (isinstance(module, RMSNorm) and type(module).same_math)

    def set_kernel(self, kernel: RMSNormKernel | None) -> None:
        """Compute this norm with ``kernel`` from now on (None: back to the torch code)."""
        self.kernel = kernel

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
