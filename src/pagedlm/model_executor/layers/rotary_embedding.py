"""Rotary position embedding (neox style: the head's two halves form the rotated pairs;
``is_neox_style=False``: adjacent features do, GPT-J's interleaved layout).

HF Llama-family checkpoints store q/k weights in the layout this style expects
(``rotate_half``), so no permutation is needed. The cos/sin table is computed once per
model for every position up to ``max_position`` and indexed by each token's position.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import nn

from pagedlm.attention.backend import FusedRotary
from pagedlm.model_executor.layers.layernorm import RMSNorm
from pagedlm.model_executor.layers.rope_frequencies import rope_attention_factor, rope_inv_freq

RotaryKernel = Callable[..., tuple[torch.Tensor, torch.Tensor]]
"""(positions, query, key, cos_sin_cache, head_dim, is_neox_style, qk_norm=None) ->
(query, key); may rotate in place. ``qk_norm`` = (q_weight, k_weight, eps): RMS-normalize
each head first (only passed for plain ``RMSNorm`` q/k norms)."""


def _fusable_norms(qk_norm: tuple[RMSNorm, RMSNorm]) -> bool:
    q_norm, k_norm = qk_norm
    return type(q_norm) is RMSNorm and type(k_norm) is RMSNorm and q_norm.eps == k_norm.eps


def _norm_heads(norm: RMSNorm, x: torch.Tensor, head_dim: int) -> torch.Tensor:
    """x [T, heads * head_dim] (may be a column slice) -> each head normalized."""
    return norm(x.view(x.shape[0], -1, head_dim)).view(x.shape[0], -1)


class RotaryEmbedding(nn.Module):
    """Rotates q and k by their tokens' positions.

    forward(positions [T], query [T, num_heads * head_dim], key [T, num_kv_heads * head_dim])
    -> (query, key) of the same shapes. Positions must be < ``max_position``. A platform
    may hand it a fused kernel (``set_kernel``, from ``Platform.prepare_model``); the
    kernel may rotate ``query`` and ``key`` in place.
    """

    kernel: RotaryKernel | None = None
    is_neox_style: bool = True
    """Pairs are the head's two halves (True; HF Llama layout) or adjacent elements
    (False; GPT-J's interleaved layout, e.g. Cohere); a kernel is told which."""

    def __init__(
        self,
        head_dim: int,
        max_position: int,
        base: float,
        scaling: dict[str, Any] | None = None,
        *,
        is_neox_style: bool = True,
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.max_position = max_position
        self.is_neox_style = is_neox_style
        inv_freq = rope_inv_freq(head_dim, base, scaling)
        angles = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
        # [max_position, head_dim]: cos of each pair's angle, then sin (times YaRN's
        # attention factor, 1 otherwise). Kept in float32 (like the reference) and cast per
        # step; not saved, it is derived from the config.
        table = torch.cat([angles.cos(), angles.sin()], dim=-1) * rope_attention_factor(scaling)
        self.register_buffer("cos_sin_cache", table, persistent=False)

    def forward(
        self,
        positions: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor,
        qk_norm: tuple[RMSNorm, RMSNorm] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``qk_norm``: (q_norm, k_norm) over each head of q and k before the rotation
        (Qwen3); a kernel does both in one pass where the norms are plain RMSNorms."""
        if qk_norm is not None and (self.kernel is None or not _fusable_norms(qk_norm)):
            query = _norm_heads(qk_norm[0], query, self.head_dim)
            key = _norm_heads(qk_norm[1], key, self.head_dim)
            qk_norm = None
        if self.kernel is not None:
            args = (positions, query, key, self.cos_sin_cache, self.head_dim, self.is_neox_style)
            if qk_norm is None:
                return self.kernel(*args)
            q_norm, k_norm = qk_norm
            return self.kernel(*args, qk_norm=(q_norm.weight, k_norm.weight, q_norm.eps))
        cos, sin = self.cos_sin_cache.index_select(0, positions).to(query.dtype).chunk(2, dim=-1)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [T, 1, head_dim / 2]
        return self._rotate(query, cos, sin), self._rotate(key, cos, sin)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.view(shape[0], -1, self.head_dim)
        if self.is_neox_style:
            first, second = x.chunk(2, dim=-1)
            rotated = torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1)
        else:
            first, second = x[..., 0::2], x[..., 1::2]
            pairs = [first * cos - second * sin, second * cos + first * sin]
            rotated = torch.stack(pairs, dim=-1).flatten(-2)
        return rotated.reshape(shape)

    def set_kernel(self, kernel: RotaryKernel | None) -> None:
        """Rotate with ``kernel`` from now on (None: back to the torch code)."""
        self.kernel = kernel

    def extra_repr(self) -> str:
        style = "" if self.is_neox_style else ", is_neox_style=False"
        return f"head_dim={self.head_dim}, max_position={self.max_position}{style}"


class PendingRotation(NamedTuple):
    """A rotation of a layer's q and k that the attention layer either does (``apply``)
    or hands to an attention backend that does it inside its kernel (``fused``), which
    saves a kernel launch per layer."""

    rotary: RotaryEmbedding
    positions: torch.Tensor
    qk_norm: tuple[RMSNorm, RMSNorm] | None = None

    def apply(self, query: torch.Tensor, key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rotary(self.positions, query, key, self.qk_norm)

    def fused(self) -> FusedRotary | None:
        """The rotation as a backend kernel's arguments, or None where only ``apply``
        computes it as the model asks: a subclass (M-RoPE, tables, partial rotation),
        per-section positions, norms that are not plain RMSNorms, or no platform kernel
        (the torch code rounds cos and sin to the query's dtype; kernels keep float32)."""
        rotary = self.rotary
        if type(rotary) is not RotaryEmbedding or rotary.kernel is None:
            return None
        if self.positions.dim() != 1:
            return None
        norms = None
        if self.qk_norm is not None:
            if not _fusable_norms(self.qk_norm):
                return None
            q_norm, k_norm = self.qk_norm
            norms = (q_norm.weight, k_norm.weight, q_norm.eps)
        return FusedRotary(self.positions, rotary.cos_sin_cache, rotary.is_neox_style, norms)
