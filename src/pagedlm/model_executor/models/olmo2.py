"""OLMo 2 and OLMo 3 (AllenAI): norms after each sublayer, q/k normed over whole projections.

Against Llama: a block is ``h = x + post_attention_norm(attn(x))`` then
``h + post_feedforward_norm(mlp(h))`` — no norm before a sublayer, so the block carries no
separate residual stream. q and k are RMS-normalized each over its whole projection
(weights [num_heads * head_dim] and [num_kv_heads * head_dim]) before the rotation, where
Qwen3 normalizes each head on its own; under tensor parallelism a rank holds some heads,
so the mean of squares is summed over the ranks (``ProjectionRMSNorm``).

OLMo 3 adds sliding-window layers (``layer_types``, ``sliding_window``); transformers 5
keeps a rope dict per layer type in ``rope_parameters`` (the context-extension scaling
goes to the full-attention layers only); older files write one ``rope_theta`` and an
optional ``rope_scaling``, which transformers hands to the full-attention layers too.
"""

from __future__ import annotations

import itertools
from typing import Any, NamedTuple

import torch
from torch import nn

from pagedlm.config import ArchConfig
from pagedlm.distributed import tensor_model_parallel_all_reduce
from pagedlm.distributed.parallel_state import get_pipeline_state
from pagedlm.distributed.pipeline import IntermediateTensors, this_stage_layers
from pagedlm.model_executor.forward_context import ForwardContext
from pagedlm.model_executor.layers.layernorm import RMSNorm
from pagedlm.model_executor.layers.rotary_embedding import PendingRotation, RotaryEmbedding
from pagedlm.model_executor.layers.rotary_scaled import get_rope, get_rope_for_arch
from pagedlm.model_executor.layers.vocab_embedding import VocabParallelEmbedding
from pagedlm.model_executor.loader.weight_utils import copy_checked, set_weight_loader, shard_of
from pagedlm.model_executor.models.llama import (
    BlockOptions,
    LlamaAttention,
    LlamaForCausalLM,
    LlamaMLP,
)
from pagedlm.model_executor.models.stages import on_first_stage, on_last_stage, stage_layers

SLIDING, FULL = "sliding_attention", "full_attention"


class LayerPlan(NamedTuple):
    """How one layer attends: its rotary module and its window (None: full attention)."""

    rotary_emb: RotaryEmbedding
    sliding_window: int | None


class ProjectionRMSNorm(nn.Module):
    """RMSNorm over a whole q or k projection, of which this rank holds some heads.

    forward(x [T, local_size]) -> [T, local_size]: ``x / sqrt(mean(x^2) + eps) * weight``,
    the mean taken over all ``total_size`` features of the projection. Each of this rank's
    features is held by ``replicas`` ranks (kv heads replicated when fewer than the ranks),
    so the sum of squares over the ranks counts every feature that many times. The weight
    multiplies in float32, before the cast back (OLMo's order). ``weight`` [local_size] is
    slice ``shard_index`` of the checkpoint's.
    """

    def __init__(
        self, total_size: int, local_size: int, shard_index: int, replicas: int, eps: float
    ) -> None:
        super().__init__()
        self.total_size, self.local_size = total_size, local_size
        self.shard_index, self.replicas = shard_index, replicas
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(local_size), requires_grad=False)
        set_weight_loader(self.weight, self.weight_loader)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        shard = shard_of(loaded_weight, 0, self.shard_index, self.local_size)
        copy_checked(param.data, shard, "q/k norm")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        if self.local_size == self.total_size:
            mean_square = x32.pow(2).mean(-1, keepdim=True)
        else:
            sum_square = tensor_model_parallel_all_reduce(x32.pow(2).sum(-1, keepdim=True))
            mean_square = sum_square / (self.replicas * self.total_size)
        x32 = x32 * torch.rsqrt(mean_square + self.eps)
        return (self.weight * x32).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.local_size} of {self.total_size}, eps={self.eps}"


class Olmo2Attention(LlamaAttention):
    """Llama's attention with q and k each RMS-normalized over its whole projection before
    the rotation. x [T, hidden] -> [T, hidden]."""

    def __init__(
        self,
        arch: ArchConfig,
        layer_idx: int,
        rotary_emb: RotaryEmbedding,
        sliding_window: int | None,
    ) -> None:
        bias = arch.attention_bias
        options = BlockOptions(qkv_bias=bias, o_proj_bias=bias)
        super().__init__(arch, layer_idx, rotary_emb, options, sliding_window)
        qkv, eps, head_dim = self.qkv_proj, arch.rms_norm_eps, arch.head_dim
        self.q_norm = ProjectionRMSNorm(
            arch.num_attention_heads * head_dim, qkv.q_size, qkv.tp_rank, 1, eps
        )
        self.k_norm = ProjectionRMSNorm(
            arch.num_key_value_heads * head_dim,
            qkv.kv_size,
            qkv.tp_rank // qkv.kv_replicas,
            qkv.kv_replicas,
            eps,
        )

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        q, k, v = self.qkv_proj.split(self.qkv_proj(x))
        q, k = self.q_norm(q), self.k_norm(k)
        rotation = PendingRotation(self.rotary_emb, positions)
        return self.o_proj(self.attn(q, k, v, ctx, rotation))


class Olmo2DecoderLayer(nn.Module):
    """x [T, hidden] -> h + post_ff_norm(mlp(h)), h = x + post_attn_norm(attn(x))."""

    def __init__(self, arch: ArchConfig, self_attn: Olmo2Attention) -> None:
        super().__init__()
        hidden, eps = arch.hidden_size, arch.rms_norm_eps
        self.self_attn = self_attn
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.mlp = LlamaMLP(arch, bias=False)
        self.post_feedforward_layernorm = RMSNorm(hidden, eps)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(positions, x, ctx))
        return x + self.post_feedforward_layernorm(self.mlp(x))


class Olmo2Model(nn.Module):
    """input_ids, positions [T] -> final-normed hidden states [T, hidden]; layer ``i``
    rotates with ``plan[i].rotary_emb`` and attends over ``plan[i].sliding_window``."""

    def __init__(self, arch: ArchConfig, plan: list[LayerPlan]) -> None:
        super().__init__()
        self.embed_tokens = on_first_stage(
            lambda: VocabParallelEmbedding(arch.vocab_size, arch.hidden_size),
            also_last=arch.tie_word_embeddings,
        )
        num_layers = arch.num_hidden_layers
        self.layers = stage_layers(
            num_layers,
            lambda i: Olmo2DecoderLayer(arch, Olmo2Attention(arch, i, *plan[i])),
        )
        self.start_layer, self.end_layer = this_stage_layers(num_layers)
        self.is_last_stage = get_pipeline_state().is_last
        self.norm = on_last_stage(lambda: RMSNorm(arch.hidden_size, arch.rms_norm_eps))

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        ctx: ForwardContext,
        intermediate: IntermediateTensors | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor | IntermediateTensors:
        if intermediate is not None:
            x = intermediate["hidden_states"]
        else:
            x = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        for layer in itertools.islice(self.layers, self.start_layer, self.end_layer):
            x = layer(positions, x, ctx)
        if not self.is_last_stage:
            return {"hidden_states": x}
        return self.norm(x)


class Olmo2ForCausalLM(LlamaForCausalLM):
    """OLMo 2. Loads checkpoints as Llama does (same q/k/v and gate/up names)."""

    intermediate_names = ("hidden_states",)

    def layer_plan(self, arch: ArchConfig, max_model_len: int | None) -> list[LayerPlan]:
        """[num_hidden_layers] each layer's rotary module and window: OLMo 2 has one rope
        table for all layers, and no windows."""
        rotary_emb = get_rope_for_arch(arch, max_model_len)
        return [LayerPlan(rotary_emb, None)] * arch.num_hidden_layers

    def __init__(self, arch: ArchConfig, max_model_len: int | None = None) -> None:
        nn.Module.__init__(self)
        self.arch = arch
        self.model = Olmo2Model(arch, self.layer_plan(arch, max_model_len))
        self.add_lm_head(self.model.embed_tokens, arch.tie_word_embeddings)


def olmo3_layer_types(arch: ArchConfig) -> list[str]:
    """Each layer's attention kind: ``layer_types``, else transformers' default (every
    fourth layer full, the others sliding)."""
    layer_types = arch.raw.get("layer_types")
    if not layer_types:
        return [FULL if (i + 1) % 4 == 0 else SLIDING for i in range(arch.num_hidden_layers)]
    if len(layer_types) != arch.num_hidden_layers:
        raise ValueError(
            f"config.json lists {len(layer_types)} layer_types for {arch.num_hidden_layers} "
            "layers; fix layer_types or num_hidden_layers."
        )
    return list(layer_types)


def olmo3_rope_settings(arch: ArchConfig) -> dict[str, tuple[float, dict[str, Any] | None]]:
    """layer type -> (rope base, scaling dict or None), from either spelling of the config."""
    raw = arch.raw
    per_type = raw.get("rope_parameters") or {}
    if SLIDING not in per_type and FULL not in per_type:
        # One rope for the file: the scaling (if any) extends the full-attention layers.
        return {SLIDING: (arch.rope_theta, None), FULL: (arch.rope_theta, arch.rope_scaling)}
    settings: dict[str, tuple[float, dict[str, Any] | None]] = {}
    for kind in (SLIDING, FULL):
        params = dict(per_type.get(kind) or {})
        base = float(params.pop("rope_theta", None) or raw.get("rope_theta") or 10000.0)
        params.setdefault("rope_type", params.get("type", "default"))
        settings[kind] = (base, None if params["rope_type"] == "default" else params)
    return settings


class Olmo3ForCausalLM(Olmo2ForCausalLM):
    """OLMo 3: OLMo 2's blocks, sliding-window layers and a rope per layer type."""

    def layer_plan(self, arch: ArchConfig, max_model_len: int | None) -> list[LayerPlan]:
        settings = olmo3_rope_settings(arch)
        tables: dict[str, RotaryEmbedding] = {}
        for kind, (base, scaling) in settings.items():
            if settings[SLIDING] == settings[FULL] and tables:
                tables[kind] = next(iter(tables.values()))  # one table serves both kinds
                continue
            tables[kind] = get_rope(
                arch.head_dim, arch.max_position_embeddings, base, scaling, None, max_model_len
            )
        window = arch.sliding_window
        return [
            LayerPlan(tables[kind], window if kind == SLIDING else None)
            for kind in olmo3_layer_types(arch)
        ]
