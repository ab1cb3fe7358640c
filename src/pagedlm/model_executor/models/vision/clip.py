"""CLIP's vision transformer, as LLaVA uses it: patch embedding, a class token, learned
positions, pre-norm blocks; the output is one hidden layer's states (LLaVA picks
``vision_feature_layer``, not the last), not the pooled projection.

Shapes: pixel_values [N, C, H, W] -> hidden states [N, 1 + num_patches, hidden].
Parameter names follow transformers' ``CLIPVisionModel`` (``embeddings``,
``pre_layrnorm``, ``encoder.layers.i``), so checkpoints load by name.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


def _quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


VISION_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "quick_gelu": _quick_gelu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "silu": F.silu,  # Qwen2.5-VL's tower
}


def vision_activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    try:
        return VISION_ACTIVATIONS[name]
    except KeyError:
        raise ValueError(
            f"vision activation {name!r} is not supported; supported: {sorted(VISION_ACTIVATIONS)}"
        ) from None


class VisionAttention(nn.Module):
    """Bidirectional multi-head attention over each image's tokens: [N, L, D] -> [N, L, D]."""

    def __init__(self, hidden_size: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.q_proj = nn.Linear(hidden_size, hidden_size)
        self.k_proj = nn.Linear(hidden_size, hidden_size)
        self.v_proj = nn.Linear(hidden_size, hidden_size)
        self.out_proj = nn.Linear(hidden_size, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, length, dim = x.shape
        shape = (n, length, self.num_heads, dim // self.num_heads)
        q, k, v = (
            proj(x).view(shape).transpose(1, 2) for proj in (self.q_proj, self.k_proj, self.v_proj)
        )
        out = F.scaled_dot_product_attention(q, k, v)
        return self.out_proj(out.transpose(1, 2).reshape(n, length, dim))


class CLIPEncoderLayer(nn.Module):
    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        hidden, eps = cfg["hidden_size"], cfg.get("layer_norm_eps", 1e-5)
        self.self_attn = VisionAttention(hidden, cfg["num_attention_heads"])
        self.layer_norm1 = nn.LayerNorm(hidden, eps=eps)
        self.mlp = nn.Module()
        self.mlp.fc1 = nn.Linear(hidden, cfg["intermediate_size"])
        self.mlp.fc2 = nn.Linear(cfg["intermediate_size"], hidden)
        self.act = vision_activation(cfg.get("hidden_act", "quick_gelu"))
        self.layer_norm2 = nn.LayerNorm(hidden, eps=eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp.fc2(self.act(self.mlp.fc1(self.layer_norm2(x))))


class CLIPVisionEmbeddings(nn.Module):
    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        hidden, patch = cfg["hidden_size"], cfg["patch_size"]
        self.class_embedding = nn.Parameter(torch.empty(hidden))
        self.patch_embedding = nn.Conv2d(
            cfg.get("num_channels", 3), hidden, kernel_size=patch, stride=patch, bias=False
        )
        num_positions = (cfg["image_size"] // patch) ** 2 + 1
        self.position_embedding = nn.Embedding(num_positions, hidden)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        weight = self.patch_embedding.weight
        patches = self.patch_embedding(pixel_values.to(weight.dtype)).flatten(2).transpose(1, 2)
        cls = self.class_embedding.expand(patches.shape[0], 1, -1)
        return torch.cat([cls, patches], dim=1) + self.position_embedding.weight


class CLIPVisionTransformer(nn.Module):
    """pixel_values [N, C, H, W] -> the hidden states after ``num_layers`` blocks
    [N, 1 + patches, hidden] (0: the embeddings after ``pre_layrnorm``)."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        eps = cfg.get("layer_norm_eps", 1e-5)
        self.embeddings = CLIPVisionEmbeddings(cfg)
        self.pre_layrnorm = nn.LayerNorm(cfg["hidden_size"], eps=eps)
        self.encoder = nn.Module()
        self.encoder.layers = nn.ModuleList(
            CLIPEncoderLayer(cfg) for _ in range(cfg["num_hidden_layers"])
        )

    @property
    def num_layers(self) -> int:
        return len(self.encoder.layers)

    def hidden_states(self, pixel_values: torch.Tensor, layers: list[int]) -> list[torch.Tensor]:
        """The states after each block count in ``layers`` (transformers' ``hidden_states``
        indices: 0 is the embeddings; negative counts from the end, -1 the last block)."""
        wanted = sorted({i % (self.num_layers + 1) for i in layers})
        states: dict[int, torch.Tensor] = {}
        x = self.pre_layrnorm(self.embeddings(pixel_values))
        if 0 in wanted:
            states[0] = x
        for index, layer in enumerate(self.encoder.layers[: wanted[-1]], start=1):
            x = layer(x)
            states[index] = x
        return [states[i % (self.num_layers + 1)] for i in layers]
