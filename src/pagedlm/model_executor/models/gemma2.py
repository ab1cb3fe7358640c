"""Gemma 2: a pre/post-norm decoder with GeGLU MLPs, local/global attention and soft caps.

Against Llama: embeddings are scaled by ``sqrt(hidden_size)``; every sublayer has a norm
before *and* after it (``GemmaRMSNorm``, weights stored as offsets from 1); attention is
scaled by ``query_pre_attn_scalar ** -0.5`` rather than ``head_dim ** -0.5``; attention
scores are soft-capped (``attn_logit_softcapping``) and so are the final logits
(``final_logit_softcapping``); layers alternate between a sliding window and full
attention (``layer_types``); the LM head is tied to the embedding.

Gemma 3 (``gemma3.py``) adds q/k RMSNorm and a rope base per layer type to the same block.
"""

from __future__ import annotations

import itertools

import torch
from torch import nn

from pagedlm.config import ArchConfig
from pagedlm.distributed.parallel_state import get_pipeline_state
from pagedlm.distributed.pipeline import IntermediateTensors, this_stage_layers
from pagedlm.model_executor.forward_context import ForwardContext
from pagedlm.model_executor.layers.gelu import get_gated_act
from pagedlm.model_executor.layers.gemma_norm import GemmaRMSNorm
from pagedlm.model_executor.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from pagedlm.model_executor.layers.rotary_embedding import RotaryEmbedding
from pagedlm.model_executor.layers.vocab_embedding import VocabParallelEmbedding
from pagedlm.model_executor.models.llama import BlockOptions, LlamaAttention, LlamaForCausalLM
from pagedlm.model_executor.models.stages import on_first_stage, on_last_stage, stage_layers

SLIDING, FULL = "sliding_attention", "full_attention"


def gemma_layer_types(arch: ArchConfig, default_pattern: int) -> list[str]:
    """Each layer's attention kind: ``layer_types`` if the config lists them, else the
    older spelling (every ``sliding_window_pattern``-th layer is global; Gemma 2: every
    second)."""
    raw = arch.raw
    layer_types = raw.get("layer_types")
    if layer_types:
        if len(layer_types) != arch.num_hidden_layers:
            raise ValueError(
                f"config.json lists {len(layer_types)} layer_types for "
                f"{arch.num_hidden_layers} layers; fix one of them."
            )
        return list(layer_types)
    pattern = int(
        raw.get("sliding_window_pattern") or raw.get("_sliding_window_pattern") or default_pattern
    )
    return [FULL if (i + 1) % pattern == 0 else SLIDING for i in range(arch.num_hidden_layers)]


def soft_cap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    """``cap * tanh(x / cap)``: squashes x into (-cap, cap), ~identity near 0."""
    return x if cap is None else torch.tanh(x / cap) * cap


class GemmaMLP(nn.Module):
    """x [T, hidden] -> down(gelu_tanh(gate(x)) * up(x)) [T, hidden]."""

    def __init__(self, arch: ArchConfig) -> None:
        super().__init__()
        size = arch.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(arch.hidden_size, [size, size])
        act = arch.raw.get("hidden_activation") or arch.raw.get("hidden_act") or "gelu_pytorch_tanh"
        self.act_fn = get_gated_act(act)
        self.down_proj = RowParallelLinear(size, arch.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class GemmaAttention(LlamaAttention):
    """Llama's attention with Gemma's scale (``query_pre_attn_scalar ** -0.5``), soft-capped
    scores and, when ``qk_norm`` (Gemma 3), per-head q/k norms with offset weights.
    x [T, hidden] -> [T, hidden]."""

    def __init__(
        self,
        arch: ArchConfig,
        layer_idx: int,
        rotary_emb: RotaryEmbedding,
        sliding_window: int | None,
        qk_norm: bool,
    ) -> None:
        bias = arch.attention_bias
        scalar = arch.raw.get("query_pre_attn_scalar") or arch.head_dim
        super().__init__(
            arch,
            layer_idx,
            rotary_emb,
            BlockOptions(qkv_bias=bias, o_proj_bias=bias, qk_norm=qk_norm),
            sliding_window,
            scale=float(scalar) ** -0.5,
            logits_soft_cap=arch.raw.get("attn_logit_softcapping"),
            head_norm=GemmaRMSNorm,
        )


class GemmaDecoderLayer(nn.Module):
    """x [T, hidden] -> x + post_ff(mlp(pre_ff(h))), h = x + post_attn(attn(input_norm(x)))."""

    def __init__(self, arch: ArchConfig, self_attn: GemmaAttention) -> None:
        super().__init__()
        hidden, eps = arch.hidden_size, arch.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(hidden, eps)
        self.self_attn = self_attn
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps)
        self.mlp = GemmaMLP(arch)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        attn_out = self.self_attn(positions, self.input_layernorm(x), ctx)
        x = x + self.post_attention_layernorm(attn_out)
        mlp_out = self.mlp(self.pre_feedforward_layernorm(x))
        return x + self.post_feedforward_layernorm(mlp_out)


class GemmaModel(nn.Module):
    """input_ids, positions [T] -> final-normed hidden states [T, hidden].

    ``rotary_embs`` maps each layer type to its rotary module (one table per type).
    """

    scaled_embedding = False
    """Transformers' embedding layer applies ``normalizer`` itself (Gemma 3), so
    ``inputs_embeds`` come scaled (set per instance)."""

    def __init__(
        self,
        arch: ArchConfig,
        layer_types: list[str],
        rotary_embs: dict[str, RotaryEmbedding],
        qk_norm: bool,
    ) -> None:
        super().__init__()
        # Gemma ties its head to the embedding, so the last stage holds the table too.
        self.embed_tokens = on_first_stage(
            lambda: VocabParallelEmbedding(arch.vocab_size, arch.hidden_size), also_last=True
        )
        # Kept as a Python float: the reference multiplies by it cast to the weight dtype.
        self.normalizer = arch.hidden_size**0.5
        self.layers = stage_layers(
            len(layer_types),
            lambda i: GemmaDecoderLayer(
                arch,
                GemmaAttention(
                    arch,
                    i,
                    rotary_embs[layer_types[i]],
                    arch.sliding_window if layer_types[i] == SLIDING else None,
                    qk_norm,
                ),
            ),
        )
        self.start_layer, self.end_layer = this_stage_layers(len(layer_types))
        self.is_last_stage = get_pipeline_state().is_last
        self.norm = on_last_stage(lambda: GemmaRMSNorm(arch.hidden_size, arch.rms_norm_eps))

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        ctx: ForwardContext,
        intermediate: IntermediateTensors | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor | IntermediateTensors:
        if intermediate is None and inputs_embeds is not None and self.scaled_embedding:
            x = inputs_embeds  # the embedding layer scaled them already (Gemma 3)
        elif intermediate is None:
            x = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
            x = x * torch.tensor(self.normalizer, dtype=x.dtype)
        else:
            x = intermediate["hidden_states"]
        for layer in itertools.islice(self.layers, self.start_layer, self.end_layer):
            x = layer(positions, x, ctx)
        if not self.is_last_stage:
            return {"hidden_states": x}
        return self.norm(x)


class Gemma2ForCausalLM(LlamaForCausalLM):
    """Gemma 2. Takes the checkpoint loading (same q/k/v and gate/up names) and ``forward``
    from ``LlamaForCausalLM``; builds its own modules and soft-caps the logits."""

    qk_norm = False
    default_sliding_window_pattern = 2
    intermediate_names = ("hidden_states",)

    def rotary_embs(self, arch: ArchConfig) -> dict[str, RotaryEmbedding]:
        rope = RotaryEmbedding(
            arch.head_dim, arch.max_position_embeddings, arch.rope_theta, arch.rope_scaling
        )
        return {SLIDING: rope, FULL: rope}

    def __init__(self, arch: ArchConfig, max_model_len: int | None = None) -> None:
        nn.Module.__init__(self)
        self.arch = arch
        layer_types = gemma_layer_types(arch, self.default_sliding_window_pattern)
        self.model = GemmaModel(arch, layer_types, self.rotary_embs(arch), self.qk_norm)
        # Gemma always ties the head; old config files leave the flag out.
        self.add_lm_head(self.model.embed_tokens, bool(arch.raw.get("tie_word_embeddings", True)))
        self.final_logit_softcapping = arch.raw.get("final_logit_softcapping")

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """hidden_states [N, hidden_size] -> float32 [N, vocab], soft-capped."""
        return soft_cap(super().compute_logits(hidden_states), self.final_logit_softcapping)
