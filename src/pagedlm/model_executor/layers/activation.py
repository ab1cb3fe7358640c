"""Gated activations of the MLP."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    """forward: x [num_tokens, 2 * d] (gate then up) -> silu(gate) * up [num_tokens, d].

    A platform may hand it a fused kernel (``set_kernel``, from ``Platform.prepare_model``).
    """

    kernel: Callable[[torch.Tensor], torch.Tensor] | None = None

    def set_kernel(self, kernel: Callable[[torch.Tensor], torch.Tensor] | None) -> None:
        """Compute with ``kernel(x)`` from now on (None: back to the torch code)."""
        self.kernel = kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None:
            return self.kernel(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up

    def after(self, linear: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """``self(linear(x))`` for ``linear`` a merged gate/up projection: in one kernel
        where the platform's kernels for both layers fuse (the linear's kernel has a
        ``silu_and_mul(x)`` that returns the activation, or None where it does not apply,
        and this layer runs the platform's kernel too), else one after the other."""
        fused = getattr(getattr(linear, "kernel", None), "silu_and_mul", None)
        if (
            fused is not None
            and self.kernel is not None
            and not getattr(linear, "gather_output", False)
        ):
            out = fused(x)
            if out is not None:
                return out
        return self(linear(x))


_ACTIVATIONS = {"silu": SiluAndMul}


def get_act_and_mul(hidden_act: str) -> nn.Module:
    """The gated activation for config.json's ``hidden_act``."""
    try:
        return _ACTIVATIONS[hidden_act]()
    except KeyError:
        raise ValueError(
            f"hidden_act={hidden_act!r} is not supported; supported: {sorted(_ACTIVATIONS)}."
        ) from None
