"""GPT-NeoX (Pythia, GPT-NeoX-20B): LayerNorm blocks with a GELU MLP and partial rotary.

Against the other LayerNorm families (``layernorm_decoder.py``): the residual is parallel
with a norm for each branch, ``x + attn(ln1(x)) + mlp(ln2(x))`` (``use_parallel_residual``,
the default), or sequential; the first ``rotary_pct`` of each head rotates (base
``rotary_emb_base`` in older configs); the LM head ``embed_out`` is not tied.

The checkpoint fuses q, k and v in ``attention.query_key_value`` *per head*: its rows are
``[heads, 3, head_dim]`` (each head's q, then its k, then its v), not q's rows then k's
then v's. ``param_shards`` takes the three apart, so tensor parallelism still gives each
rank its own heads.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from pagedlm.config import ArchConfig
from pagedlm.model_executor.layers.rotary_embedding import RotaryEmbedding
from pagedlm.model_executor.models.layernorm_decoder import (
    GeluMLP,
    LayerNormAttention,
    LayerNormCausalLM,
    LayerNormDecoderLayer,
    ParamShard,
    layer_norm_eps,
    partial_rotary_factor,
    rope_for,
)


def _layer_norm(arch: ArchConfig) -> nn.LayerNorm:
    return nn.LayerNorm(arch.hidden_size, eps=layer_norm_eps(arch))


def _rope_base(arch: ArchConfig) -> float:
    """transformers 5 writes ``rope_parameters.rope_theta``; older files ``rotary_emb_base``."""
    raw = arch.raw
    if "rope_theta" in (raw.get("rope_parameters") or {}) or "rope_theta" in raw:
        return arch.rope_theta
    return float(raw.get("rotary_emb_base", 10000.0))


class GPTNeoXForCausalLM(LayerNormCausalLM):
    hf_renames = (
        ("gpt_neox.embed_in.", "model.embed_tokens."),
        ("gpt_neox.final_layer_norm.", "model.norm."),
        ("gpt_neox.", "model."),
        ("embed_out.", "lm_head."),  # transformers 5 loads it as lm_head: accept both
        (".attention.dense.", ".self_attn.o_proj."),
        (".attention.", ".self_attn."),
        (".mlp.dense_h_to_4h.", ".mlp.fc_in."),
        (".mlp.dense_4h_to_h.", ".mlp.fc_out."),
    )
    # Causal-mask buffers old checkpoints saved beside the weights.
    ignored_suffixes = ("rotary_emb.inv_freq", ".attention.bias", ".attention.masked_bias")

    def __init__(self, arch: ArchConfig, max_model_len: int | None = None) -> None:
        if arch.num_key_value_heads != arch.num_attention_heads:
            raise ValueError(
                f"GPT-NeoX has no grouped-query attention, but config.json sets "
                f"num_key_value_heads={arch.num_key_value_heads} for "
                f"{arch.num_attention_heads} attention heads; remove num_key_value_heads."
            )
        super().__init__(arch, max_model_len)

    def make_rotary(self, arch: ArchConfig, max_model_len: int | None) -> RotaryEmbedding:
        partial = partial_rotary_factor(arch, 0.25)
        return rope_for(arch, partial, max_model_len, base=_rope_base(arch))

    def make_layer(
        self,
        arch: ArchConfig,
        layer_idx: int,
        rotary: RotaryEmbedding,
        sliding_window: int | None,
    ) -> LayerNormDecoderLayer:
        bias = bool(arch.raw.get("attention_bias", True))
        return LayerNormDecoderLayer(
            input_layernorm=_layer_norm(arch),
            self_attn=LayerNormAttention(arch, layer_idx, rotary, qkv_bias=bias, o_proj_bias=bias),
            mlp=GeluMLP(arch, bias=True, default_act="gelu"),
            post_attention_layernorm=_layer_norm(arch),
            parallel=bool(arch.raw.get("use_parallel_residual", True)),
        )

    def make_norm(self, arch: ArchConfig) -> nn.Module:
        return _layer_norm(arch)

    def param_shards(self, name: str, tensor: torch.Tensor) -> Iterator[ParamShard]:
        if ".self_attn.query_key_value." not in name:
            yield from super().param_shards(name, tensor)
            return
        arch = self.arch
        heads, head_dim = arch.num_attention_heads, arch.head_dim
        if tensor.shape[0] != 3 * heads * head_dim:
            raise ValueError(
                f"checkpoint tensor {name!r} has {tensor.shape[0]} rows but config.json "
                f"implies {3 * heads * head_dim} (3 x {heads} heads x {head_dim}); the "
                "checkpoint does not match its config."
            )
        per_head = tensor.view(heads, 3, head_dim, *tensor.shape[1:])
        merged = name.replace(".query_key_value.", ".qkv_proj.")
        for index, shard_id in enumerate("qkv"):
            part = per_head[:, index].reshape(heads * head_dim, *tensor.shape[1:])
            yield merged, part, shard_id
