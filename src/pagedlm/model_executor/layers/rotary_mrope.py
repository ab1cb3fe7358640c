"""Multimodal rotary embedding (M-RoPE, Qwen2-VL / Qwen2.5-VL).

Each token has three positions (temporal, height, width). The head's rotation pairs are cut
into ``mrope_section`` groups (e.g. [16, 24, 24] of 64 pairs) and group ``i`` turns by
position ``i``. A text token's three positions are equal, so it turns exactly as plain
RoPE at that position: steps that feed no image placeholder pass positions [T] (the shared
component; graphs, kernels and the persistent position buffer unchanged), and only steps
that feed image tokens pass [3, T].
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pagedlm.model_executor.layers.layernorm import RMSNorm
from pagedlm.model_executor.layers.rotary_embedding import RotaryEmbedding


class MRotaryEmbedding(RotaryEmbedding):
    """forward(positions [T] or [3, T], query [T, heads * head_dim], key [T, kv_heads *
    head_dim]) -> (query, key) of the same shapes. The table is plain RoPE's
    (``cos_sin_cache`` [max_position, head_dim]); [T] positions go through
    ``RotaryEmbedding`` (and its kernel, if a platform set one)."""

    def __init__(
        self, head_dim: int, max_position: int, base: float, mrope_section: Sequence[int]
    ) -> None:
        super().__init__(head_dim, max_position, base)
        self.mrope_section = [int(s) for s in mrope_section]
        if len(self.mrope_section) != 3 or sum(self.mrope_section) != head_dim // 2:
            raise ValueError(
                f"mrope_section={list(mrope_section)} must be three sizes summing to "
                f"head_dim / 2 = {head_dim // 2}; check rope_parameters in config.json."
            )

    def forward(
        self,
        positions: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor,
        qk_norm: tuple[RMSNorm, RMSNorm] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if positions.dim() == 1:
            return super().forward(positions, query, key, qk_norm)
        if qk_norm is not None:
            raise ValueError("M-RoPE with per-head q/k norms is not implemented")
        # [3, T, head_dim / 2] each; pair group i reads position row i.
        cos3, sin3 = self.cos_sin_cache[positions].to(query.dtype).chunk(2, dim=-1)
        cos = torch.cat([c[i] for i, c in enumerate(cos3.split(self.mrope_section, -1))], -1)
        sin = torch.cat([s[i] for i, s in enumerate(sin3.split(self.mrope_section, -1))], -1)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [T, 1, head_dim / 2]
        return self._rotate(query, cos, sin), self._rotate(key, cos, sin)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, mrope_section={self.mrope_section}"
