"""StableLM (StableLM 2, StableLM-Zephyr): LayerNorm blocks with a SwiGLU MLP.

Against the other LayerNorm families (``layernorm_decoder.py``): the first
``partial_rotary_factor`` (default 0.25) of each head rotates; q/k/v may carry a bias
(``use_qkv_bias``); with ``qk_layernorm`` each head of q and k has a LayerNorm of its own
(no bias), stored one tensor per head (``q_layernorm.norms.{h}.weight``); with
``use_parallel_residual`` one norm feeds attention and MLP, ``x + attn(n(x)) + mlp(n(x))``,
and the block has no post-attention norm.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import torch
from torch import nn

from pagedlm.config import ArchConfig
from pagedlm.model_executor.layers.head_layernorm import HeadLayerNorm
from pagedlm.model_executor.layers.rotary_embedding import RotaryEmbedding
from pagedlm.model_executor.models.layernorm_decoder import (
    HeadNormFactory,
    LayerNormAttention,
    LayerNormCausalLM,
    LayerNormDecoderLayer,
    ParamShard,
    layer_norm_eps,
    partial_rotary_factor,
    rope_for,
)
from pagedlm.model_executor.models.llama import LlamaMLP

_HEAD_NORM = re.compile(r"\.self_attn\.([qk])_layernorm\.norms\.(\d+)\.")


def _head_norm(arch: ArchConfig) -> HeadNormFactory | None:
    """A LayerNorm of each head's own (no bias) for q and k, with ``qk_layernorm``."""
    if not arch.raw.get("qk_layernorm", False):
        return None

    def build(num_heads: int, first_head: int) -> nn.Module:
        return HeadLayerNorm(
            arch.head_dim, layer_norm_eps(arch), num_heads=num_heads, first_head=first_head
        )

    return build


class StableLmForCausalLM(LayerNormCausalLM):
    def make_rotary(self, arch: ArchConfig, max_model_len: int | None) -> RotaryEmbedding:
        return rope_for(arch, partial_rotary_factor(arch, 0.25), max_model_len)

    def make_layer(
        self,
        arch: ArchConfig,
        layer_idx: int,
        rotary: RotaryEmbedding,
        sliding_window: int | None,
    ) -> LayerNormDecoderLayer:
        parallel = bool(arch.raw.get("use_parallel_residual", False))
        return LayerNormDecoderLayer(
            input_layernorm=self.make_norm(arch),
            self_attn=LayerNormAttention(
                arch,
                layer_idx,
                rotary,
                qkv_bias=bool(arch.raw.get("use_qkv_bias", False)),
                o_proj_bias=False,
                head_norm=_head_norm(arch),
            ),
            mlp=LlamaMLP(arch, bias=False),
            post_attention_layernorm=None if parallel else self.make_norm(arch),
            parallel=parallel,
        )

    def make_norm(self, arch: ArchConfig) -> nn.Module:
        return nn.LayerNorm(arch.hidden_size, eps=layer_norm_eps(arch))

    def param_shards(self, name: str, tensor: torch.Tensor) -> Iterator[ParamShard]:
        match = _HEAD_NORM.search(name)
        if match is None:
            yield from super().param_shards(name, tensor)
            return
        which, head = match.groups()
        yield name.replace(match.group(0), f".self_attn.{which}_norm."), tensor, int(head)
