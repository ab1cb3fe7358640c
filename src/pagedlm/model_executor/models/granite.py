"""IBM Granite 3.x: Llama with four scalar multipliers from config.json.

- ``embedding_multiplier``: the token embeddings are scaled by it;
- ``residual_multiplier``: each sublayer's output is scaled by it before the residual add;
- ``attention_multiplier``: the attention scale (in place of ``head_dim ** -0.5``);
- ``logits_scaling``: the logits are divided by it.

The blocks are therefore their own classes (``GraniteAttention``, ``GraniteDecoderLayer``):
a platform's whole-block kernel for ``LlamaDecoderLayer`` would leave the multipliers out.
The norms, rotary, MLP and linear layers are Llama's and keep their kernels.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedlm.config import ArchConfig
from pagedlm.model_executor.forward_context import ForwardContext
from pagedlm.model_executor.layers.rotary_embedding import RotaryEmbedding
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


def _multiplier(arch: ArchConfig, key: str) -> float:
    value = arch.raw.get(key)
    return 1.0 if value is None else float(value)


class GraniteAttention(LlamaAttention):
    """Llama's attention scaled by ``attention_multiplier``. x [T, hidden] -> [T, hidden]."""

    def __init__(
        self,
        arch: ArchConfig,
        layer_idx: int,
        rotary_emb: RotaryEmbedding,
        options: BlockOptions,
        sliding_window: int | None,
    ) -> None:
        super().__init__(
            arch,
            layer_idx,
            rotary_emb,
            options,
            sliding_window,
            scale=_multiplier(arch, "attention_multiplier"),
        )


class GraniteDecoderLayer(LlamaDecoderLayer):
    """Llama's pre-norm block with both sublayer outputs scaled by ``residual_multiplier``
    before they join the residual stream: h + m * attn(norm(h)), then the same for the MLP.
    forward(positions, x, residual | None, ctx) -> (x, residual), as Llama's."""

    def __init__(self, arch: ArchConfig, self_attn: GraniteAttention, mlp: nn.Module) -> None:
        super().__init__(arch, self_attn, mlp)
        self.residual_multiplier = _multiplier(arch, "residual_multiplier")

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        ctx: ForwardContext,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = x
            x = self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x, ctx) * self.residual_multiplier
        x, residual = self.post_attention_layernorm(x, residual)
        # The next norm (the next layer's, or the final one) adds it to the residual.
        return self.mlp(x) * self.residual_multiplier, residual


class GraniteForCausalLM(LlamaForCausalLM):
    """Granite 3.x dense models. Loads checkpoints as Llama does (same tensor names)."""

    def __init__(self, arch: ArchConfig, max_model_len: int | None = None) -> None:
        nn.Module.__init__(self)
        self.arch = arch
        options = self.block_options(arch)
        rotary_emb = get_rope_for_arch(arch, max_model_len)
        windows = layer_sliding_windows(arch)
        self.model = LlamaStack(
            arch,
            lambda i: GraniteDecoderLayer(
                arch,
                GraniteAttention(arch, i, rotary_emb, options, windows[i]),
                LlamaMLP(arch, bias=options.mlp_bias),
            ),
            embedding_multiplier=_multiplier(arch, "embedding_multiplier"),
        )
        self.add_lm_head(self.model.embed_tokens, arch.tie_word_embeddings)
        self.logits_scaling = _multiplier(arch, "logits_scaling")

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """hidden_states [N, hidden_size] -> [N, vocab], divided by ``logits_scaling``."""
        logits = super().compute_logits(hidden_states)
        return logits if self.logits_scaling == 1.0 else logits / self.logits_scaling
