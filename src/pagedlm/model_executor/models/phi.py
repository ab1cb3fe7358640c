"""Phi (Phi-1, Phi-1.5, Phi-2): one LayerNorm feeds attention and MLP in parallel.

Against the other LayerNorm families (``layernorm_decoder.py``): each block is
``x + attn(n(x)) + mlp(n(x))``; every projection has a bias, the LM head too; the MLP is
``fc2(gelu_new(fc1(x)))``; the first ``partial_rotary_factor`` (default 0.5) of each head
rotates; with ``qk_layernorm`` q and k pass one LayerNorm (with bias) shared by all heads.
Phi-3 is Llama-shaped and lives in ``phi3.py``.
"""

from __future__ import annotations

from torch import nn

from pagedlm.config import ArchConfig
from pagedlm.model_executor.layers.head_layernorm import HeadLayerNorm
from pagedlm.model_executor.layers.rotary_embedding import RotaryEmbedding
from pagedlm.model_executor.models.layernorm_decoder import (
    GeluMLP,
    HeadNormFactory,
    LayerNormAttention,
    LayerNormCausalLM,
    LayerNormDecoderLayer,
    layer_norm_eps,
    partial_rotary_factor,
    rope_for,
)


def _head_norm(arch: ArchConfig) -> HeadNormFactory | None:
    """With ``qk_layernorm``: one LayerNorm over ``head_dim`` (with bias) for all heads."""
    if not arch.raw.get("qk_layernorm", False):
        return None

    def build(num_heads: int, first_head: int) -> nn.Module:
        return HeadLayerNorm(arch.head_dim, layer_norm_eps(arch), per_head=False, bias=True)

    return build


class PhiForCausalLM(LayerNormCausalLM):
    hf_renames = (
        ("model.final_layernorm.", "model.norm."),
        (".self_attn.dense.", ".self_attn.o_proj."),
        (".self_attn.q_layernorm.", ".self_attn.q_norm."),
        (".self_attn.k_layernorm.", ".self_attn.k_norm."),
        (".mlp.fc1.", ".mlp.fc_in."),
        (".mlp.fc2.", ".mlp.fc_out."),
    )
    lm_head_bias = True

    def make_rotary(self, arch: ArchConfig, max_model_len: int | None) -> RotaryEmbedding:
        return rope_for(arch, partial_rotary_factor(arch, 0.5), max_model_len)

    def make_layer(
        self,
        arch: ArchConfig,
        layer_idx: int,
        rotary: RotaryEmbedding,
        sliding_window: int | None,
    ) -> LayerNormDecoderLayer:
        return LayerNormDecoderLayer(
            input_layernorm=self.make_norm(arch),
            self_attn=LayerNormAttention(
                arch,
                layer_idx,
                rotary,
                qkv_bias=True,
                o_proj_bias=True,
                head_norm=_head_norm(arch),
            ),
            mlp=GeluMLP(arch, bias=True, default_act="gelu_new"),
            post_attention_layernorm=None,
            parallel=True,
        )

    def make_norm(self, arch: ArchConfig) -> nn.Module:
        return nn.LayerNorm(arch.hidden_size, eps=layer_norm_eps(arch))
