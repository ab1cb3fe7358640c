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

    def set_kernel(self, kernel: RMSNormKernel | None) -> None:
        """Compute this norm with ``kernel`` from now on (None: back to the torch code)."""
        self.kernel = kernel

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


class PendingNorm:
    """``norm(x, residual)`` of a pre-norm block, left for the layer that consumes it: its
    first linear projection (``project``) may take the add and the norm into its own
    kernel where the platform's kernels fuse them (the one-row GEMV does: one launch fewer
    per norm at batch 1), else the norm runs first. After ``project``, ``residual`` holds
    ``x + residual``, the block's next residual; a consumer projects it exactly once.

    Only the consumers that say so take one (``takes_pending_norm``); the decoder layer
    hands every other module the normalized rows."""

    def __init__(self, norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor) -> None:
        self.norm = norm
        self.x = x
        self.residual_in = residual
        self.residual: torch.Tensor | None = None

    def project(self, linear: nn.Module, act: nn.Module | None = None) -> torch.Tensor:
        """``linear(normed)``, or ``act.after(linear, normed)`` with a gated activation
        (``SiluAndMul``), where ``normed`` is the norm's output. Fused when the linear's
        kernel has ``add_rms_norm(x, residual, weight, eps, silu_and_mul=...)`` that
        returns (output, next residual), or None where it does not apply, and the norm
        (and the activation) run the platform's kernels too."""
        if self.residual is not None:
            raise RuntimeError("a PendingNorm is projected once; its residual is taken.")
        norm = self.norm
        fused = getattr(getattr(linear, "kernel", None), "add_rms_norm", None)
        if (
            fused is not None
            and type(norm) is RMSNorm
            and norm.kernel is not None
            and (act is None or getattr(act, "kernel", None) is not None)
            and not getattr(linear, "gather_output", False)
        ):
            got = fused(
                self.x, self.residual_in, norm.weight, norm.eps, silu_and_mul=act is not None
            )
            if got is not None:
                out, self.residual = got
                return out
        normed, self.residual = norm(self.x, self.residual_in)
        return linear(normed) if act is None else act.after(linear, normed)


def project(
    linear: nn.Module, x: torch.Tensor | PendingNorm, act: nn.Module | None = None
) -> torch.Tensor:
    """The first projection of a block's input: ``linear(x)`` (``act.after(linear, x)``
    with a gated activation) for rows, ``x.project(linear, act)`` for a pending norm."""
    if isinstance(x, PendingNorm):
        return x.project(linear, act)
    return linear(x) if act is None else act.after(linear, x)
