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


_ACTIVATIONS = {"silu": SiluAndMul}


def get_act_and_mul(hidden_act: str) -> nn.Module:
    """The gated activation for config.json's ``hidden_act``."""
    try:
        return _ACTIVATIONS[hidden_act]()
    except KeyError:
        raise ValueError(
            f"hidden_act={hidden_act!r} is not supported; supported: {sorted(_ACTIVATIONS)}."
        ) from None
