"""The attention layer: reshapes q/k/v to heads and hands them to the platform's backend."""

from __future__ import annotations

import torch
from torch import nn

from pagedlm.model_executor.forward_context import ForwardContext


class Attention(nn.Module):
    """Causal attention of one decoder layer over the paged KV cache.

    forward(q [T, num_heads * head_dim], k, v [T, num_kv_heads * head_dim], ctx)
    -> [T, num_heads * head_dim]. Holds no weights; ``layer_idx`` picks this layer's cache.
    """

    def __init__(
        self, layer_idx: int, num_heads: int, num_kv_heads: int, head_dim: int, scale: float
    ) -> None:
        super().__init__()
        if num_heads % num_kv_heads != 0:
            raise ValueError(
                f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}; "
                "check num_attention_heads and num_key_value_heads in config.json."
            )
        self.layer_idx = layer_idx
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        num_tokens = q.shape[0]
        key_cache, value_cache = ctx.kv_cache.layer(self.layer_idx)
        out = ctx.attn_backend.forward(
            q.view(num_tokens, self.num_heads, self.head_dim),
            k.view(num_tokens, self.num_kv_heads, self.head_dim),
            v.view(num_tokens, self.num_kv_heads, self.head_dim),
            key_cache,
            value_cache,
            ctx.attn_metadata,
            self.scale,
        )
        return out.reshape(num_tokens, self.num_heads * self.head_dim)

    def extra_repr(self) -> str:
        return (
            f"layer_idx={self.layer_idx}, num_heads={self.num_heads}, "
            f"num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, scale={self.scale}"
        )
