"""SigLIP's vision transformer, as Gemma 3 uses it: patch embedding (with bias) plus learned
positions, CLIP's pre-norm blocks, a final LayerNorm; no class token, no pooling head.

Shapes: pixel_values [N, C, H, W] at the config's ``image_size`` -> [N, num_patches,
hidden]. Parameter names follow transformers' ``SiglipVisionModel`` (``embeddings``,
``encoder.layers.i``, ``post_layernorm``), so checkpoints load by name.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedlm.model_executor.models.vision.clip import CLIPEncoderLayer


class SiglipVisionEmbeddings(nn.Module):
    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        hidden, patch = cfg["hidden_size"], cfg["patch_size"]
        self.patch_embedding = nn.Conv2d(
            cfg.get("num_channels", 3), hidden, kernel_size=patch, stride=patch
        )
        self.position_embedding = nn.Embedding((cfg["image_size"] // patch) ** 2, hidden)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        weight = self.patch_embedding.weight
        patches = self.patch_embedding(pixel_values.to(weight.dtype)).flatten(2).transpose(1, 2)
        if patches.shape[1] != self.position_embedding.num_embeddings:
            raise ValueError(
                f"the image gives {patches.shape[1]} patches but the vision tower has "
                f"{self.position_embedding.num_embeddings} positions; the processor must "
                "resize images to vision_config.image_size"
            )
        return patches + self.position_embedding.weight


class SiglipVisionTransformer(nn.Module):
    """pixel_values [N, C, H, W] -> the last block's states after ``post_layernorm``."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        cfg = {"hidden_act": "gelu_pytorch_tanh", "layer_norm_eps": 1e-6, **cfg}
        self.embeddings = SiglipVisionEmbeddings(cfg)
        self.encoder = nn.Module()
        self.encoder.layers = nn.ModuleList(
            CLIPEncoderLayer(cfg) for _ in range(cfg["num_hidden_layers"])
        )
        self.post_layernorm = nn.LayerNorm(cfg["hidden_size"], eps=cfg["layer_norm_eps"])

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        x = self.embeddings(pixel_values)
        for layer in self.encoder.layers:
            x = layer(x)
        return self.post_layernorm(x)
