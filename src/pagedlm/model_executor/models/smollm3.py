"""SmolLM3: Llama where some layers attend without rotary position embedding (NoPE).

config.json lists per layer whether it rotates: ``no_rope_layers[i]`` is 1 for a layer
with rotary, 0 for a NoPE layer (the name reads backwards; transformers uses it as
"use rope"). Files without the list get transformers' default: every
``no_rope_layer_interval``-th layer (4th, 8th, ...) is NoPE. Sliding windows, when
``use_sliding_window`` is on, follow ``layer_types`` as for Qwen2.

Rotary layers are plain Llama blocks (and keep the platforms' whole-block kernels); NoPE
layers get ``NoRopeAttention``, a class of its own, so no kernel rotates their q and k.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedlm.config import ArchConfig
from pagedlm.model_executor.forward_context import ForwardContext
from pagedlm.model_executor.layers.rotary_scaled import get_rope_for_arch
from pagedlm.model_executor.models.llama import (
    BlockOptions,
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaMLP,
)
from pagedlm.model_executor.models.llama_stack import LlamaStack
from pagedlm.model_executor.models.sliding_window import layer_sliding_windows


def rope_layers(arch: ArchConfig) -> list[bool]:
    """[num_hidden_layers] whether each layer rotates q and k."""
    raw = arch.raw
    flags = raw.get("no_rope_layers")
    if flags is None:
        interval = int(raw.get("no_rope_layer_interval") or 4)
        return [(i + 1) % interval != 0 for i in range(arch.num_hidden_layers)]
    if len(flags) != arch.num_hidden_layers:
        raise ValueError(
            f"config.json lists {len(flags)} no_rope_layers for {arch.num_hidden_layers} "
            "layers; fix no_rope_layers or num_hidden_layers."
        )
    return [bool(flag) for flag in flags]


class NoRopeAttention(LlamaAttention):
    """Llama's attention without the rotation (a SmolLM3 NoPE layer): q and k attend as
    projected. x [T, hidden] -> [T, hidden]."""

    def __init__(
        self,
        arch: ArchConfig,
        layer_idx: int,
        options: BlockOptions,
        sliding_window: int | None,
    ) -> None:
        # No rotary module: nothing can rotate this layer's q and k, kernel or not.
        super().__init__(arch, layer_idx, None, options, sliding_window)  # type: ignore[arg-type]

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        q, k, v = self.qkv_proj.split(self.qkv_proj(x))
        return self.o_proj(self.attn(q, k, v, ctx))


class SmolLM3ForCausalLM(LlamaForCausalLM):
    """SmolLM3. Loads checkpoints as Llama does (same tensor names)."""

    def __init__(self, arch: ArchConfig, max_model_len: int | None = None) -> None:
        nn.Module.__init__(self)
        self.arch = arch
        options = self.block_options(arch)
        rotary_emb = get_rope_for_arch(arch, max_model_len)
        windows = layer_sliding_windows(arch)
        rotates = rope_layers(arch)

        def build_layer(i: int) -> LlamaDecoderLayer:
            if rotates[i]:
                attention = LlamaAttention(arch, i, rotary_emb, options, windows[i])
            else:
                attention = NoRopeAttention(arch, i, options, windows[i])
            return LlamaDecoderLayer(arch, attention, LlamaMLP(arch, bias=options.mlp_bias))

        self.model = LlamaStack(arch, build_layer)
        self.add_lm_head(self.model.embed_tokens, arch.tie_word_embeddings)
