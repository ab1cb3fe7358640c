"""Rotary variants beyond ``RotaryEmbedding``'s: partial rotation and Phi-3's LongRoPE.

``get_rope`` picks the right module for a config, so model code never branches on
``rope_type``. Every variant keeps ``RotaryEmbedding``'s table layout (``cos_sin_cache``
[max_position, rotary_dim]: cos of each pair's angle, then sin), so anything that reads
that table (a fused kernel) sees the same shape with ``rotary_dim`` in place of ``head_dim``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from pagedlm.config import ArchConfig
from pagedlm.model_executor.layers.rotary_embedding import (
    RotaryEmbedding,
    rope_inv_freq,
)


class TableRotaryEmbedding(RotaryEmbedding):
    """Rotates the first ``rotary_dim`` features of every head by a precomputed table.

    forward(positions [T], query [T, num_heads * head_dim], key [T, num_kv_heads * head_dim])
    -> same shapes; features ``rotary_dim ..`` of each head pass through unchanged.
    """

    def __init__(self, head_dim: int, rotary_dim: int, cos_sin_cache: torch.Tensor) -> None:
        nn.Module.__init__(self)
        if rotary_dim % 2 or rotary_dim > head_dim:
            raise ValueError(
                f"rotary dimension {rotary_dim} must be even and at most head_dim={head_dim}; "
                "check partial_rotary_factor in config.json."
            )
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim
        self.max_position = cos_sin_cache.shape[0]
        self.register_buffer("cos_sin_cache", cos_sin_cache, persistent=False)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.rotary_dim == self.head_dim:
            return super()._rotate(x, cos, sin)
        shape = x.shape
        x = x.view(shape[0], -1, self.head_dim)
        rotary, rest = x.split([self.rotary_dim, self.head_dim - self.rotary_dim], dim=-1)
        first, second = rotary.chunk(2, dim=-1)
        rotated = torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1)
        return torch.cat([rotated, rest], dim=-1).view(shape)

    def set_kernel(self, kernel: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None) -> None:
        # A fused kernel rotates whole heads; with a partial rotation keep the torch code.
        if self.rotary_dim == self.head_dim:
            super().set_kernel(kernel)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rotary_dim={self.rotary_dim}"


def _table(inv_freq_per_position: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """[max_position, rotary_dim / 2] frequencies -> [max_position, rotary_dim] cos|sin."""
    positions = torch.arange(inv_freq_per_position.shape[0], dtype=torch.float32)[:, None]
    angles = positions * inv_freq_per_position
    return torch.cat([angles.cos() * scale, angles.sin() * scale], dim=-1)


def longrope_table(
    rotary_dim: int, max_position: int, base: float, scaling: dict[str, Any]
) -> torch.Tensor:
    """Phi-3's LongRoPE: per-frequency rescaling, ``short_factor`` below the pretraining
    length and ``long_factor`` from it on, with cos/sin scaled by the attention factor.

    The choice is made per token position. Transformers decides per forward call (the
    long factors for every token once the sequence exceeds the pretraining length), which
    makes a token's keys depend on the request around it; per position they do not, so
    prefix-cached blocks stay valid for every request. Both agree on any sequence whose
    prompt fits in ``original_max_position_embeddings``, including decodes past it.
    """
    original = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or max_position / original
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = (
            1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
        )
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    inv_freq = {
        kind: 1.0 / (torch.tensor(scaling[f"{kind}_factor"], dtype=torch.float32) * base**exponents)
        for kind in ("short", "long")
    }
    for kind, freqs in inv_freq.items():
        if freqs.shape[0] != rotary_dim // 2:
            raise ValueError(
                f"rope {kind}_factor has {freqs.shape[0]} entries but the rotary dimension "
                f"{rotary_dim} needs {rotary_dim // 2}; the config.json is inconsistent."
            )
    is_long = torch.arange(max_position)[:, None] >= original
    per_position = torch.where(is_long, inv_freq["long"], inv_freq["short"])
    return _table(per_position, attention_factor)


def get_rope(
    head_dim: int,
    max_position: int,
    base: float,
    scaling: dict[str, Any] | None = None,
    rotary_dim: int | None = None,
) -> RotaryEmbedding:
    """The rotary module for a config: ``scaling`` is its rope dict (None: plain RoPE),
    ``rotary_dim`` the rotated features per head (None: all of them)."""
    rotary_dim = head_dim if rotary_dim is None else rotary_dim
    rope_type = "default" if scaling is None else scaling.get("rope_type", "default")
    if rope_type == "longrope":
        assert scaling is not None
        table = longrope_table(rotary_dim, max_position, base, scaling)
        return TableRotaryEmbedding(head_dim, rotary_dim, table)
    if rotary_dim == head_dim:
        return RotaryEmbedding(head_dim, max_position, base, scaling)
    inv_freq = rope_inv_freq(rotary_dim, base, scaling)
    return TableRotaryEmbedding(head_dim, rotary_dim, _table(inv_freq.expand(max_position, -1)))


def get_rope_for_arch(arch: ArchConfig) -> RotaryEmbedding:
    """``get_rope`` with a config's rope settings, including the ones some configs keep
    outside the rope dict (``partial_rotary_factor``, ``original_max_position_embeddings``)."""
    raw = arch.raw
    rope_parameters = raw.get("rope_parameters") or {}
    partial = rope_parameters.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    scaling = arch.rope_scaling
    if scaling is not None and scaling.get("rope_type") == "longrope":
        scaling = dict(scaling)
        scaling.setdefault(
            "original_max_position_embeddings", raw.get("original_max_position_embeddings")
        )
        if scaling["original_max_position_embeddings"] is None:
            raise ValueError(
                "longrope scaling needs original_max_position_embeddings (in rope_scaling or "
                "at the top of config.json); the config has neither."
            )
    return get_rope(
        arch.head_dim,
        arch.max_position_embeddings,
        arch.rope_theta,
        scaling,
        rotary_dim=int(arch.head_dim * partial),
    )


__all__ = ["TableRotaryEmbedding", "get_rope", "get_rope_for_arch", "longrope_table"]
