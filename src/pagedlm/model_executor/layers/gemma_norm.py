"""Gemma's RMSNorm: the weight is stored as an offset from 1 and applied in float32."""

from __future__ import annotations

import torch
from torch import nn


class GemmaRMSNorm(nn.Module):
    """``x / sqrt(mean(x^2) + eps) * (1 + weight)`` over the last dim, cast back at the end.

    Differs from ``RMSNorm`` in two ways that matter for parity: the checkpoint stores
    ``weight - 1`` (zeros mean identity), and the scale is applied before the cast back to
    the activation dtype rather than after. Shapes: [num_tokens, dim] (or any [..., dim]).
    """

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + self.weight.float())).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
