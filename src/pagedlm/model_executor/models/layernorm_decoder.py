"""Decoders of LayerNorm blocks: GPT-NeoX, StableLM, Phi, Starcoder2 and Cohere.

Their blocks differ from Llama's (``llama.py``) in ways that change the math, so they are
built from these classes rather than ``LlamaDecoderLayer``, whose platform kernels assume
RMSNorm and a sequential residual:

- LayerNorm (mean-subtracted; with a bias, or Cohere's without) instead of RMSNorm;
- a parallel residual in some: ``x + attn(norm(x)) + mlp(norm(x))`` (Phi, Cohere, StableLM
  with ``use_parallel_residual``), or with a second norm for the MLP (GPT-NeoX);
- a GELU MLP of two linears beside SwiGLU; biases on some projections; partial or
  interleaved rotary; q/k LayerNorms per head; an LM head with a bias; scaled logits.

Parameter names are the same for every family: ``model.embed_tokens``,
``model.layers.{i}.{input_layernorm, post_attention_layernorm, self_attn.{qkv_proj, o_proj,
q_norm, k_norm}, mlp.{fc_in, fc_out | gate_up_proj, down_proj}}``, ``model.norm``,
``lm_head``. Each family's ``hf_renames`` maps its checkpoint's names onto them, and
``load_weights`` hands q/k/v and gate/up to the merged layers as the shards their
tensor-parallel loaders take.
"""

from __future__ import annotations

import itertools
from abc import abstractmethod
from collections.abc import Callable, Iterable, Iterator
from typing import ClassVar

import torch
from torch import nn

from pagedlm.config import ArchConfig
from pagedlm.distributed.parallel_state import get_pipeline_state
from pagedlm.distributed.pipeline import IntermediateTensors, this_stage_layers
from pagedlm.model_executor.forward_context import ForwardContext
from pagedlm.model_executor.layers.attention import Attention
from pagedlm.model_executor.layers.gelu import get_gelu
from pagedlm.model_executor.layers.linear import (
    ColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from pagedlm.model_executor.layers.rotary_embedding import PendingRotation, RotaryEmbedding
from pagedlm.model_executor.layers.rotary_scaled import get_rope
from pagedlm.model_executor.layers.vocab_embedding import VocabParallelEmbedding
from pagedlm.model_executor.loader.weight_utils import get_weight_loader
from pagedlm.model_executor.models.causal_lm import CausalLM
from pagedlm.model_executor.models.sliding_window import layer_sliding_windows
from pagedlm.model_executor.models.stages import on_first_stage, on_last_stage, stage_layers

HeadNormFactory = Callable[[int, int], nn.Module]
"""(heads of q or k on this rank, global index of the first) -> the norm over each head."""

ParamShard = tuple[str, torch.Tensor, str | int | None]
"""(our parameter name, the tensor or the part of it it takes, shard id | None)."""


def partial_rotary_factor(arch: ArchConfig, default: float) -> float:
    """The share of each head's features that rotate: ``rope_parameters`` (transformers 5),
    else the top-level ``partial_rotary_factor`` or GPT-NeoX's ``rotary_pct``, else the
    family's ``default`` (transformers' default for a config without the key)."""
    rope_parameters = arch.raw.get("rope_parameters") or {}
    for value in (
        rope_parameters.get("partial_rotary_factor"),
        arch.raw.get("partial_rotary_factor"),
        arch.raw.get("rotary_pct"),
    ):
        if value is not None:
            return float(value)
    return default


def rope_for(
    arch: ArchConfig,
    partial: float = 1.0,
    max_model_len: int | None = None,
    *,
    base: float | None = None,
    is_neox_style: bool = True,
) -> RotaryEmbedding:
    """The rotary module for ``arch``: the first ``int(head_dim * partial)`` features of
    each head rotate (transformers' rounding), by ``base`` (None: the config's)."""
    return get_rope(
        arch.head_dim,
        arch.max_position_embeddings,
        arch.rope_theta if base is None else base,
        arch.rope_scaling,
        rotary_dim=int(arch.head_dim * partial),
        max_model_len=max_model_len,
        is_neox_style=is_neox_style,
    )


class LayerNormAttention(nn.Module):
    """x [T, hidden] -> o_proj(attention(rope(q), rope(k), v)) [T, hidden]; q and k are
    first normalized per head by ``head_norm``'s modules when given; ``rotary`` None: no
    rotation (Cohere 2's global layers)."""

    def __init__(
        self,
        arch: ArchConfig,
        layer_idx: int,
        rotary: RotaryEmbedding | None,
        *,
        qkv_bias: bool,
        o_proj_bias: bool,
        sliding_window: int | None = None,
        head_norm: HeadNormFactory | None = None,
    ) -> None:
        super().__init__()
        head_dim = arch.head_dim
        self.qkv_proj = qkv = QKVParallelLinear(
            arch.hidden_size,
            head_dim,
            arch.num_attention_heads,
            arch.num_key_value_heads,
            bias=qkv_bias,
        )
        self.o_proj = RowParallelLinear(
            arch.num_attention_heads * head_dim, arch.hidden_size, bias=o_proj_bias
        )
        self.q_norm: nn.Module | None = None
        self.k_norm: nn.Module | None = None
        if head_norm is not None:
            self.q_norm = head_norm(qkv.num_heads, qkv.tp_rank * qkv.num_heads)
            kv_group = qkv.tp_rank // qkv.kv_replicas
            self.k_norm = head_norm(qkv.num_kv_heads, kv_group * qkv.num_kv_heads)
        self.rotary_emb = rotary
        self.attn = Attention(
            layer_idx,
            num_heads=qkv.num_heads,
            num_kv_heads=qkv.num_kv_heads,
            head_dim=head_dim,
            scale=head_dim**-0.5,
            sliding_window=sliding_window,
        )

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        q, k, v = self.qkv_proj.split(self.qkv_proj(x))
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        rotation = None
        if self.rotary_emb is not None:
            rotation = PendingRotation(self.rotary_emb, positions)
        return self.o_proj(self.attn(q, k, v, ctx, rotation))


class GeluMLP(nn.Module):
    """x [T, hidden] -> fc_out(gelu(fc_in(x))) [T, hidden]; ``default_act``: the family's
    GELU variant when config.json names none."""

    def __init__(self, arch: ArchConfig, bias: bool, default_act: str) -> None:
        super().__init__()
        self.fc_in = ColumnParallelLinear(arch.hidden_size, arch.intermediate_size, bias=bias)
        self.act = get_gelu(arch.raw.get("hidden_act") or default_act)
        self.fc_out = RowParallelLinear(arch.intermediate_size, arch.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc_out(self.act(self.fc_in(x)))


class LayerNormDecoderLayer(nn.Module):
    """One block; forward(positions, x [T, hidden], ctx) -> [T, hidden].

    Sequential (``parallel=False``): ``h = x + attn(n1(x))``, then ``h + mlp(n2(h))``.
    Parallel: ``x + attn(n1(x)) + mlp(n2(x))``, where ``n2`` is ``n1`` itself when there is
    no ``post_attention_layernorm`` (one norm feeds both).
    """

    def __init__(
        self,
        input_layernorm: nn.Module,
        self_attn: LayerNormAttention,
        mlp: nn.Module,
        post_attention_layernorm: nn.Module | None,
        parallel: bool,
    ) -> None:
        super().__init__()
        if not parallel and post_attention_layernorm is None:
            raise ValueError("a sequential block needs its post-attention norm")
        self.input_layernorm = input_layernorm
        self.self_attn = self_attn
        self.post_attention_layernorm = post_attention_layernorm
        self.mlp = mlp
        self.parallel = parallel

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        normed = self.input_layernorm(x)
        attn_out = self.self_attn(positions, normed, ctx)
        post_norm = self.post_attention_layernorm
        if not self.parallel:
            assert post_norm is not None
            x = x + attn_out
            return x + self.mlp(post_norm(x))
        return x + attn_out + self.mlp(normed if post_norm is None else post_norm(x))


class LayerNormModel(nn.Module):
    """input_ids, positions [T] -> norm(layers(embed_tokens(ids))) [T, hidden]; a pipeline
    stage holds only its layers (``stages.py``)."""

    def __init__(
        self,
        arch: ArchConfig,
        make_layer: Callable[[int], nn.Module],
        make_norm: Callable[[], nn.Module],
        tied: bool,
    ) -> None:
        super().__init__()
        self.embed_tokens = on_first_stage(
            lambda: VocabParallelEmbedding(arch.vocab_size, arch.hidden_size), also_last=tied
        )
        self.layers = stage_layers(arch.num_hidden_layers, make_layer)
        self.start_layer, self.end_layer = this_stage_layers(arch.num_hidden_layers)
        self.is_last_stage = get_pipeline_state().is_last
        self.norm = on_last_stage(make_norm)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        ctx: ForwardContext,
        intermediate: IntermediateTensors | None = None,
    ) -> torch.Tensor | IntermediateTensors:
        first = intermediate is None
        x = self.embed_tokens(input_ids) if first else intermediate["hidden_states"]
        for layer in itertools.islice(self.layers, self.start_layer, self.end_layer):
            x = layer(positions, x, ctx)
        if not self.is_last_stage:
            return {"hidden_states": x}
        return self.norm(x)


def layer_norm_eps(arch: ArchConfig) -> float:
    """config.json's ``layer_norm_eps`` (transformers' default 1e-5)."""
    return float(arch.raw.get("layer_norm_eps", 1e-5))


class LayerNormCausalLM(CausalLM):
    """Base of the LayerNorm families' model classes: a subclass builds its rotary, its
    blocks and its norms (``make_*``) and names its checkpoint's tensors (``hf_renames``)."""

    hf_renames: ClassVar[tuple[tuple[str, str], ...]] = ()
    """(part of a checkpoint name, ours), replaced in order in every tensor name."""
    tied_by_default: ClassVar[bool] = False
    """``tie_word_embeddings`` when config.json does not say (transformers' default)."""
    lm_head_bias: ClassVar[bool] = False
    ignored_suffixes: ClassVar[tuple[str, ...]] = ("rotary_emb.inv_freq",)
    """Checkpoint tensors that are no parameters (buffers some old checkpoints saved)."""
    stacked_params: ClassVar[tuple[tuple[str, str, str | int], ...]] = (
        (".self_attn.qkv_proj.", ".self_attn.q_proj.", "q"),
        (".self_attn.qkv_proj.", ".self_attn.k_proj.", "k"),
        (".self_attn.qkv_proj.", ".self_attn.v_proj.", "v"),
        (".mlp.gate_up_proj.", ".mlp.gate_proj.", 0),
        (".mlp.gate_up_proj.", ".mlp.up_proj.", 1),
    )
    """(our merged layer, the checkpoint projection it contains, that one's shard id)."""

    logit_scale: float = 1.0
    """Logits are the head's output times this (Cohere's ``logit_scale``)."""

    def __init__(self, arch: ArchConfig, max_model_len: int | None = None) -> None:
        super().__init__()
        self.arch = arch
        tied = bool(arch.raw.get("tie_word_embeddings", self.tied_by_default))
        # One cos/sin table for all layers.
        rotary = self.make_rotary(arch, max_model_len)
        windows = self.sliding_windows(arch)
        self.model = LayerNormModel(
            arch,
            lambda i: self.make_layer(arch, i, rotary, windows[i]),
            lambda: self.make_norm(arch),
            tied,
        )
        self.add_lm_head(self.model.embed_tokens, tied, bias=self.lm_head_bias)

    @abstractmethod
    def make_rotary(self, arch: ArchConfig, max_model_len: int | None) -> RotaryEmbedding:
        """The rotary module the layers share."""

    @abstractmethod
    def make_layer(
        self,
        arch: ArchConfig,
        layer_idx: int,
        rotary: RotaryEmbedding,
        sliding_window: int | None,
    ) -> LayerNormDecoderLayer:
        """Block ``layer_idx``."""

    @abstractmethod
    def make_norm(self, arch: ArchConfig) -> nn.Module:
        """A norm over the hidden size (the blocks' and the final one)."""

    def sliding_windows(self, arch: ArchConfig) -> list[int | None]:
        """[num_hidden_layers] each layer's window (None: full attention)."""
        return layer_sliding_windows(arch)

    @property
    def decoder(self) -> nn.Module:
        return self.model

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden_states)
        return logits if self.logit_scale == 1.0 else logits * self.logit_scale

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy HF-named tensors into the parameters; returns the parameter names filled."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for hf_name, tensor in weights:
            if hf_name.endswith(self.ignored_suffixes):
                continue
            name = hf_name
            for theirs, ours in self.hf_renames:
                name = name.replace(theirs, ours)
            if name == "lm_head.weight" and self.tied:
                continue  # the head shares the embedding table
            for param_name, part, shard_id in self.param_shards(name, tensor):
                if self.is_other_stage(param_name):
                    continue
                if param_name not in params:
                    raise ValueError(
                        f"checkpoint tensor {hf_name!r} has no parameter in "
                        f"{type(self).__name__}; the file does not match architecture "
                        f"{self.arch.architecture!r} (check config.json's bias, norm and "
                        "residual settings)."
                    )
                param = params[param_name]
                loader = get_weight_loader(param)
                if shard_id is None:
                    loader(param, part)
                else:
                    loader(param, part, shard_id)
                loaded.add(param_name)
        return loaded

    def param_shards(self, name: str, tensor: torch.Tensor) -> Iterator[ParamShard]:
        """The parameters a (renamed) checkpoint tensor fills; families with fused or
        per-head tensors of their own extend this."""
        for merged, part, shard_id in self.stacked_params:
            if part in name:
                yield name.replace(part, merged), tensor, shard_id
                return
        yield name, tensor, None
