"""GELU activations: gated (Gemma's GeGLU MLP) and plain (GPT-2's MLP), by config name."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedlm.model_executor.layers.activation import get_act_and_mul

# config.json's names -> F.gelu's ``approximate`` argument.
_GELU_APPROXIMATIONS = {
    "gelu": "none",
    "gelu_pytorch_tanh": "tanh",
    "gelu_new": "tanh",
    "gelu_fast": "tanh",
}


class GeluAndMul(nn.Module):
    """forward: x [num_tokens, 2 * d] (gate then up) -> gelu(gate) * up [num_tokens, d]."""

    def __init__(self, approximate: str = "tanh") -> None:
        super().__init__()
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate=self.approximate) * up

    def extra_repr(self) -> str:
        return f"approximate={self.approximate!r}"


class Gelu(nn.Module):
    """forward: x [num_tokens, d] -> gelu(x) [num_tokens, d]."""

    def __init__(self, approximate: str = "tanh") -> None:
        super().__init__()
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(x, approximate=self.approximate)

    def extra_repr(self) -> str:
        return f"approximate={self.approximate!r}"


def _approximation(hidden_act: str) -> str:
    try:
        return _GELU_APPROXIMATIONS[hidden_act]
    except KeyError:
        raise ValueError(
            f"hidden_act={hidden_act!r} is not supported; supported GELU variants: "
            f"{sorted(_GELU_APPROXIMATIONS)} (and 'silu' for gated MLPs)."
        ) from None


def get_gated_act(hidden_act: str) -> nn.Module:
    """The gated activation for a config's ``hidden_act``: GELU variants here, SiLU in
    ``activation.get_act_and_mul``."""
    if hidden_act in _GELU_APPROXIMATIONS:
        return GeluAndMul(_approximation(hidden_act))
    return get_act_and_mul(hidden_act)


def get_gelu(hidden_act: str) -> nn.Module:
    """The plain (ungated) GELU for a config's ``activation_function``."""
    return Gelu(_approximation(hidden_act))
