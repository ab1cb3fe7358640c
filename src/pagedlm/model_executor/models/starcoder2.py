"""Starcoder2: sequential LayerNorm blocks with a GELU MLP, GQA and a sliding window.

Against the other LayerNorm families (``layernorm_decoder.py``): every projection and the
MLP (``c_fc``, ``c_proj``) carry a bias when ``use_bias`` (the default); the whole head
rotates; ``sliding_window`` applies to every layer; the LM head is tied by default; norms
read ``norm_epsilon``.
"""

from __future__ import annotations

from torch import nn

from pagedlm.config import ArchConfig
from pagedlm.model_executor.layers.rotary_embedding import RotaryEmbedding
from pagedlm.model_executor.models.layernorm_decoder import (
    GeluMLP,
    LayerNormAttention,
    LayerNormCausalLM,
    LayerNormDecoderLayer,
    rope_for,
)


class Starcoder2ForCausalLM(LayerNormCausalLM):
    hf_renames = ((".mlp.c_fc.", ".mlp.fc_in."), (".mlp.c_proj.", ".mlp.fc_out."))
    tied_by_default = True

    def make_rotary(self, arch: ArchConfig, max_model_len: int | None) -> RotaryEmbedding:
        return rope_for(arch, max_model_len=max_model_len)

    def make_layer(
        self,
        arch: ArchConfig,
        layer_idx: int,
        rotary: RotaryEmbedding,
        sliding_window: int | None,
    ) -> LayerNormDecoderLayer:
        bias = bool(arch.raw.get("use_bias", True))
        return LayerNormDecoderLayer(
            input_layernorm=self.make_norm(arch),
            self_attn=LayerNormAttention(
                arch,
                layer_idx,
                rotary,
                qkv_bias=bias,
                o_proj_bias=bias,
                sliding_window=sliding_window,
            ),
            mlp=GeluMLP(arch, bias=bias, default_act="gelu_pytorch_tanh"),
            post_attention_layernorm=self.make_norm(arch),
            parallel=False,
        )

    def make_norm(self, arch: ArchConfig) -> nn.Module:
        return nn.LayerNorm(arch.hidden_size, eps=float(arch.raw.get("norm_epsilon", 1e-5)))
