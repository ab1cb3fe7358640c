"""The int8-activation numerics benchmark's emulation of the GPU kernel's rounding."""

from __future__ import annotations

import torch

from pagedlm.benchmarks.int8_activations import int8_inputs, round_to_int8_groups
from pagedlm.model_executor.layers.linear_base import LinearBase


def test_rounding_is_int8_steps_of_each_groups_max() -> None:
    x = torch.randn(3, 96) * torch.tensor([0.01, 1.0, 50.0]).repeat_interleave(32)
    x[1, 32:64] = 0.0
    out = round_to_int8_groups(x)
    steps = x.view(3, 3, 32).abs().amax(-1, keepdim=True) / 127
    q = out.view(3, 3, 32) / steps.clamp_min(1e-30)
    assert torch.allclose(q, q.round(), atol=1e-3) and q.abs().max() <= 127.001
    assert ((out - x).view(3, 3, 32).abs() <= steps / 2 * 1.0001).all()
    assert torch.equal(out[1, 32:64], torch.zeros(32))


def test_int8_inputs_patches_linear_layers_only_inside() -> None:
    original = LinearBase.apply_linear
    with int8_inputs():
        assert LinearBase.apply_linear is not original
    assert LinearBase.apply_linear is original
