"""Rotary variants beyond ``RotaryEmbedding``'s: partial rotation and Phi-3's LongRoPE.

``get_rope`` picks the right module for a config (M-RoPE's is ``rotary_mrope.py``), so
model code never branches on ``rope_type``. Every variant keeps ``RotaryEmbedding``'s
table layout (``cos_sin_cache`` [max_position, rotary_dim]: cos of each pair's angle, then
sin), so anything that reads that table (a fused kernel) sees the same shape with
``rotary_dim`` in place of ``head_dim``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from pagedlm.config import ArchConfig
from pagedlm.model_executor.layers.rope_frequencies import (
    rope_attention_factor,
    rope_context_length,
    rope_inv_freq,
)
from pagedlm.model_executor.layers.rotary_embedding import RotaryEmbedding
from pagedlm.model_executor.layers.rotary_mrope import MRotaryEmbedding


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
    rotary_dim: int, max_position: int, base: float, scaling: dict[str, Any], use_long: bool
) -> torch.Tensor:
    """Phi-3's LongRoPE: per-frequency rescaling by ``long_factor`` (``use_long``) or
    ``short_factor``, with cos/sin scaled by the attention factor.

    One factor set for every position, chosen once for the served context length (see
    ``get_rope_for_arch``). Transformers switches per sequence instead — short while the
    sequence fits in the pretraining length, long (recomputing the whole cache) once it
    does not — which a paged cache shared between requests cannot do: a cached block's
    keys must not depend on how long the request that wrote them grew.
    """
    original = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or max_position / original
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = (
            1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
        )
    kind = "long" if use_long else "short"
    factors = torch.tensor(scaling[f"{kind}_factor"], dtype=torch.float32)
    if factors.shape[0] != rotary_dim // 2:
        raise ValueError(
            f"rope {kind}_factor has {factors.shape[0]} entries but the rotary dimension "
            f"{rotary_dim} needs {rotary_dim // 2}; the config.json is inconsistent."
        )
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    inv_freq = 1.0 / (factors * base**exponents)
    return _table(inv_freq.expand(max_position, -1), attention_factor)


def get_rope(
    head_dim: int,
    max_position: int,
    base: float,
    scaling: dict[str, Any] | None = None,
    rotary_dim: int | None = None,
    max_model_len: int | None = None,
    *,
    is_neox_style: bool = True,
) -> RotaryEmbedding:
    """The rotary module for a config: ``scaling`` is its rope dict (None: plain RoPE),
    ``rotary_dim`` the rotated features per head (None: all of them), ``max_model_len``
    the longest sequence served (None: ``max_position``); LongRoPE uses its long factors
    exactly when that exceeds the pretraining length. ``is_neox_style=False`` rotates
    adjacent pairs (Cohere), for whole heads and the table-free rope types only."""
    rotary_dim = head_dim if rotary_dim is None else rotary_dim
    rope_type = "default" if scaling is None else scaling.get("rope_type", "default")
    if not is_neox_style:
        if rotary_dim != head_dim or rope_type in ("mrope", "longrope"):
            raise ValueError(
                f"interleaved (is_neox_style=False) rotary supports whole heads and rope types "
                f"'default', 'linear', 'llama3', 'yarn'; got rope_type={rope_type!r}, "
                f"rotary_dim={rotary_dim} of head_dim={head_dim}."
            )
        return RotaryEmbedding(head_dim, max_position, base, scaling, is_neox_style=False)
    if rope_type == "mrope":
        assert scaling is not None
        if rotary_dim != head_dim:
            raise ValueError("M-RoPE with a partial rotary dimension is not supported.")
        return MRotaryEmbedding(head_dim, max_position, base, scaling["mrope_section"])
    if rope_type == "longrope":
        assert scaling is not None
        served = max_position if max_model_len is None else max_model_len
        use_long = served > scaling["original_max_position_embeddings"]
        table = longrope_table(rotary_dim, max_position, base, scaling, use_long)
        return TableRotaryEmbedding(head_dim, rotary_dim, table)
    if rotary_dim == head_dim:
        return RotaryEmbedding(head_dim, max_position, base, scaling)
    inv_freq = rope_inv_freq(rotary_dim, base, scaling)
    table = _table(inv_freq.expand(max_position, -1), rope_attention_factor(scaling))
    return TableRotaryEmbedding(head_dim, rotary_dim, table)


def get_rope_for_arch(arch: ArchConfig, max_model_len: int | None = None) -> RotaryEmbedding:
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
        rope_context_length(arch.max_position_embeddings, scaling),
        arch.rope_theta,
        scaling,
        rotary_dim=int(arch.head_dim * partial),
        max_model_len=max_model_len,
    )


__all__ = ["TableRotaryEmbedding", "get_rope", "get_rope_for_arch", "longrope_table"]
