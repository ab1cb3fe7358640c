"""Cohere (Command-R) and Cohere 2 (Command R7B, Command A).

Against the other LayerNorm families (``layernorm_decoder.py``): the LayerNorms have a
weight and no bias; one norm feeds attention and the SwiGLU MLP in parallel,
``x + attn(n(x)) + mlp(n(x))``; the rotation pairs adjacent features (GPT-J's interleaved
layout, ``is_neox_style=False``); logits are multiplied by ``logit_scale``; the LM head is
tied by default. Cohere may normalize each head of q and k (``use_qk_norm``, a weight per
head). Cohere 2 alternates sliding-window and global layers (``layer_types``, or every
``sliding_window_pattern``-th layer global in older configs), and only the sliding layers
rotate: the global ones attend without positions.
"""

from __future__ import annotations

from torch import nn

from pagedlm.config import ArchConfig
from pagedlm.model_executor.layers.head_layernorm import HeadLayerNorm
from pagedlm.model_executor.layers.rotary_embedding import RotaryEmbedding
from pagedlm.model_executor.models.layernorm_decoder import (
    HeadNormFactory,
    LayerNormAttention,
    LayerNormCausalLM,
    LayerNormDecoderLayer,
    layer_norm_eps,
    rope_for,
)
from pagedlm.model_executor.models.llama import LlamaMLP


def _head_norm(arch: ArchConfig) -> HeadNormFactory | None:
    """With ``use_qk_norm``: a LayerNorm weight per head (no bias) for q and k."""
    if not arch.raw.get("use_qk_norm", False):
        return None

    def build(num_heads: int, first_head: int) -> nn.Module:
        return HeadLayerNorm(
            arch.head_dim, layer_norm_eps(arch), num_heads=num_heads, first_head=first_head
        )

    return build


class CohereForCausalLM(LayerNormCausalLM):
    tied_by_default = True

    def __init__(self, arch: ArchConfig, max_model_len: int | None = None) -> None:
        super().__init__(arch, max_model_len)
        scale = arch.raw.get("logit_scale")
        self.logit_scale = 1.0 if scale is None else float(scale)

    def make_rotary(self, arch: ArchConfig, max_model_len: int | None) -> RotaryEmbedding:
        return rope_for(arch, max_model_len=max_model_len, is_neox_style=False)

    def make_layer(
        self,
        arch: ArchConfig,
        layer_idx: int,
        rotary: RotaryEmbedding,
        sliding_window: int | None,
    ) -> LayerNormDecoderLayer:
        return self._layer(arch, layer_idx, rotary, sliding_window, _head_norm(arch))

    def _layer(
        self,
        arch: ArchConfig,
        layer_idx: int,
        rotary: RotaryEmbedding | None,
        sliding_window: int | None,
        head_norm: HeadNormFactory | None,
    ) -> LayerNormDecoderLayer:
        bias = arch.attention_bias
        return LayerNormDecoderLayer(
            input_layernorm=self.make_norm(arch),
            self_attn=LayerNormAttention(
                arch,
                layer_idx,
                rotary,
                qkv_bias=bias,
                o_proj_bias=bias,
                sliding_window=sliding_window,
                head_norm=head_norm,
            ),
            mlp=LlamaMLP(arch, bias=False),
            post_attention_layernorm=None,
            parallel=True,
        )

    def make_norm(self, arch: ArchConfig) -> nn.Module:
        return nn.LayerNorm(arch.hidden_size, eps=layer_norm_eps(arch), bias=False)


class Cohere2ForCausalLM(CohereForCausalLM):
    def sliding_windows(self, arch: ArchConfig) -> list[int | None]:
        layer_types = arch.raw.get("layer_types")
        if not layer_types:
            pattern = int(arch.raw.get("sliding_window_pattern", 4))
            layer_types = [
                "full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                for i in range(arch.num_hidden_layers)
            ]
        if len(layer_types) != arch.num_hidden_layers:
            raise ValueError(
                f"config.json lists {len(layer_types)} layer_types for "
                f"{arch.num_hidden_layers} layers; fix layer_types or num_hidden_layers."
            )
        if arch.sliding_window is None and "sliding_attention" in layer_types:
            raise ValueError(
                "config.json has sliding_attention layers but no sliding_window; set it."
            )
        return [arch.sliding_window if t == "sliding_attention" else None for t in layer_types]

    def make_layer(
        self,
        arch: ArchConfig,
        layer_idx: int,
        rotary: RotaryEmbedding,
        sliding_window: int | None,
    ) -> LayerNormDecoderLayer:
        # Only the sliding layers rotate q and k; Cohere 2 has no q/k norms.
        layer_rotary = rotary if sliding_window is not None else None
        return self._layer(arch, layer_idx, layer_rotary, sliding_window, None)
