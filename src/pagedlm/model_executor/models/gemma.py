"""Gemma (1): Llama's pre-norm block with Gemma's norm, GeGLU MLP and scaled embeddings.

Against Llama: embeddings are scaled by ``sqrt(hidden_size)`` (rounded to the activation
dtype, as the reference does); norms are ``GemmaRMSNorm`` (weights stored as offsets from
1, applied before the cast back); the MLP is GeGLU with tanh-approximated GELU; the LM
head is tied to the embedding. Attention is Llama's (``head_dim ** -0.5``, no soft cap).

Gemma 2 and 3 (``gemma2.py``, ``gemma3.py``) add norms after each sublayer, soft caps and
sliding windows; this module reuses their attention, MLP and stack.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedlm.config import ArchConfig
from pagedlm.distributed.parallel_state import get_pipeline_state
from pagedlm.distributed.pipeline import this_stage_layers
from pagedlm.model_executor.forward_context import ForwardContext
from pagedlm.model_executor.layers.gelu import get_gated_act
from pagedlm.model_executor.layers.gemma_norm import GemmaRMSNorm
from pagedlm.model_executor.layers.rotary_scaled import get_rope_for_arch
from pagedlm.model_executor.layers.vocab_embedding import VocabParallelEmbedding
from pagedlm.model_executor.models.gemma2 import GemmaAttention, GemmaMLP, GemmaModel
from pagedlm.model_executor.models.llama import LlamaForCausalLM
from pagedlm.model_executor.models.stages import on_first_stage, on_last_stage, stage_layers


def gemma1_activation(arch: ArchConfig) -> str:
    """The MLP's GELU: ``hidden_activation`` if set, else ``hidden_act``. The first Gemma
    releases wrote ``"gelu"`` but were trained with the tanh approximation; transformers
    reads it as ``gelu_pytorch_tanh``, and so does this."""
    act = arch.raw.get("hidden_activation") or arch.raw.get("hidden_act") or "gelu_pytorch_tanh"
    return "gelu_pytorch_tanh" if act == "gelu" else act


class Gemma1MLP(GemmaMLP):
    """x [T, hidden] -> down(gelu_tanh(gate(x)) * up(x)) [T, hidden]."""

    def __init__(self, arch: ArchConfig) -> None:
        super().__init__(arch)
        self.act_fn = get_gated_act(gemma1_activation(arch))


class Gemma1DecoderLayer(nn.Module):
    """x [T, hidden] -> h + mlp(post_attn_norm(h)), h = x + attn(input_norm(x))."""

    def __init__(self, arch: ArchConfig, self_attn: GemmaAttention) -> None:
        super().__init__()
        hidden, eps = arch.hidden_size, arch.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(hidden, eps)
        self.self_attn = self_attn
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps)
        self.mlp = Gemma1MLP(arch)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        x = x + self.self_attn(positions, self.input_layernorm(x), ctx)
        return x + self.mlp(self.post_attention_layernorm(x))


class Gemma1Model(GemmaModel):
    """input_ids, positions [T] -> final-normed hidden states [T, hidden]; Gemma 2's
    ``forward`` (scaled embeddings, then the layers, then the final norm) over Gemma 1's
    layers."""

    def __init__(self, arch: ArchConfig, max_model_len: int | None = None) -> None:
        nn.Module.__init__(self)
        # Gemma ties its head to the embedding, so the last stage holds the table too.
        self.embed_tokens = on_first_stage(
            lambda: VocabParallelEmbedding(arch.vocab_size, arch.hidden_size), also_last=True
        )
        self.normalizer = arch.hidden_size**0.5
        rotary_emb = get_rope_for_arch(arch, max_model_len)
        num_layers = arch.num_hidden_layers
        self.layers = stage_layers(
            num_layers,
            lambda i: Gemma1DecoderLayer(
                arch, GemmaAttention(arch, i, rotary_emb, sliding_window=None, qk_norm=False)
            ),
        )
        self.start_layer, self.end_layer = this_stage_layers(num_layers)
        self.is_last_stage = get_pipeline_state().is_last
        self.norm = on_last_stage(lambda: GemmaRMSNorm(arch.hidden_size, arch.rms_norm_eps))


class GemmaForCausalLM(LlamaForCausalLM):
    """Gemma 1. Loads checkpoints as Llama does (same q/k/v and gate/up names)."""

    intermediate_names = ("hidden_states",)

    def __init__(self, arch: ArchConfig, max_model_len: int | None = None) -> None:
        nn.Module.__init__(self)
        self.arch = arch
        self.model = Gemma1Model(arch, max_model_len)
        # Gemma always ties the head; old config files leave the flag out.
        self.add_lm_head(self.model.embed_tokens, bool(arch.raw.get("tie_word_embeddings", True)))
