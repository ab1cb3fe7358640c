"""Llama-family decoders: Llama (1-3), Mistral, Qwen2 and Qwen3.

They share one pre-norm block — RMSNorm, attention with rotary q/k and grouped kv heads,
RMSNorm, SwiGLU MLP — and differ only in which projections carry a bias and whether q and
k are RMS-normalized per head before the rotation (Qwen3). Each architecture is a subclass
that states those differences in ``block_options``.

Layout: one flattened batch, ``input_ids``/``positions`` [num_tokens]; activations
[num_tokens, hidden_size]. Parameter names follow HF's except the merged projections
(``qkv_proj``, ``gate_up_proj``), which ``load_weights`` fills from the separate HF tensors.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from pagedlm.config import ArchConfig
from pagedlm.distributed.parallel_state import get_pipeline_state
from pagedlm.distributed.pipeline import IntermediateTensors, this_stage_layers
from pagedlm.model_executor.forward_context import ForwardContext
from pagedlm.model_executor.layers.activation import get_act_and_mul
from pagedlm.model_executor.layers.attention import Attention
from pagedlm.model_executor.layers.layernorm import RMSNorm
from pagedlm.model_executor.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from pagedlm.model_executor.layers.rotary_embedding import PendingRotation, RotaryEmbedding
from pagedlm.model_executor.layers.rotary_scaled import get_rope_for_arch
from pagedlm.model_executor.layers.vocab_embedding import VocabParallelEmbedding
from pagedlm.model_executor.loader.weight_utils import get_weight_loader
from pagedlm.model_executor.models.causal_lm import CausalLM
from pagedlm.model_executor.models.sliding_window import layer_sliding_windows
from pagedlm.model_executor.models.stages import on_first_stage, on_last_stage, stage_layers

MlpFactory = Callable[[int], nn.Module | None]
"""layer index -> that layer's MLP (None: the dense SwiGLU ``LlamaMLP``)."""


@dataclass(frozen=True)
class BlockOptions:
    """What distinguishes one Llama-family architecture's decoder block from another's."""

    qkv_bias: bool = False
    o_proj_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    """RMSNorm over each head's q and k (weights [head_dim]) before the rotation."""


class LlamaMLP(nn.Module):
    """x [T, hidden] -> down(silu(gate(x)) * up(x)) [T, hidden]; ``reduce_results=False``
    leaves each tensor-parallel rank's partial sum to the caller (one all-reduce for it and
    a sibling, as a MoE layer's shared expert and routed experts)."""

    def __init__(self, arch: ArchConfig, bias: bool, reduce_results: bool = True) -> None:
        super().__init__()
        size = arch.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(arch.hidden_size, [size, size], bias=bias)
        self.act_fn = get_act_and_mul(arch.hidden_act)
        self.down_proj = RowParallelLinear(
            size, arch.hidden_size, bias=bias, reduce_results=reduce_results
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn.after(self.gate_up_proj, x))


class LlamaAttention(nn.Module):
    """x [T, hidden] -> o_proj(attention(rope(q), rope(k), v)) [T, hidden]; q and k are
    normalized per head first when ``options.qk_norm``.

    Defaults are Llama's: ``head_dim ** -0.5`` scale, no score cap, ``RMSNorm`` on q/k.
    Gemma passes its own scale, cap and ``head_norm`` class (``GemmaAttention``).
    """

    def __init__(
        self,
        arch: ArchConfig,
        layer_idx: int,
        rotary_emb: RotaryEmbedding,
        options: BlockOptions,
        sliding_window: int | None = None,
        *,
        scale: float | None = None,
        logits_soft_cap: float | None = None,
        head_norm: Callable[[int, float], nn.Module] = RMSNorm,
    ) -> None:
        super().__init__()
        head_dim = arch.head_dim
        self.qkv_proj = QKVParallelLinear(
            arch.hidden_size,
            head_dim,
            arch.num_attention_heads,
            arch.num_key_value_heads,
            bias=options.qkv_bias,
        )
        self.o_proj = RowParallelLinear(
            arch.num_attention_heads * head_dim, arch.hidden_size, bias=options.o_proj_bias
        )
        self.q_norm = head_norm(head_dim, arch.rms_norm_eps) if options.qk_norm else None
        self.k_norm = head_norm(head_dim, arch.rms_norm_eps) if options.qk_norm else None
        self.rotary_emb = rotary_emb
        self.attn = Attention(
            layer_idx,
            num_heads=self.qkv_proj.num_heads,
            num_kv_heads=self.qkv_proj.num_kv_heads,
            head_dim=head_dim,
            scale=head_dim**-0.5 if scale is None else scale,
            sliding_window=sliding_window,
            logits_soft_cap=logits_soft_cap,
        )

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        q, k, v = self.qkv_proj.split(self.qkv_proj(x))
        qk_norm = None
        if self.q_norm is not None and self.k_norm is not None:
            qk_norm = (self.q_norm, self.k_norm)  # per head, before the rotation
        rotation = PendingRotation(self.rotary_emb, positions, qk_norm)
        return self.o_proj(self.attn(q, k, v, ctx, rotation))


DecoderLayerKernel = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor | None, ForwardContext],
    tuple[torch.Tensor, torch.Tensor] | None,
]
"""(positions, x, residual | None, ctx) -> what ``LlamaDecoderLayer.forward`` returns for
them, or None where the kernel does not apply to this step (the modules then run)."""


class LlamaDecoderLayer(nn.Module):
    """One pre-norm block around ``self_attn`` and ``mlp`` (the dense SwiGLU MLP, or a
    mixture of experts); the residual stream travels separately so the add fuses into the
    next RMSNorm. forward(positions, x, residual | None, ctx) -> (x, residual).

    A platform may hand it a kernel for the whole block (``set_kernel``, from
    ``Platform.prepare_model``) that computes what the modules compute for the steps it
    accepts, with fewer Python calls; it declines the others by returning None.
    """

    kernel: DecoderLayerKernel | None = None

    def __init__(self, arch: ArchConfig, self_attn: LlamaAttention, mlp: nn.Module) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.self_attn = self_attn
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.mlp = mlp

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        ctx: ForwardContext,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.kernel is not None:
            out = self.kernel(positions, x, residual, ctx)
            if out is not None:
                return out
        if residual is None:
            residual = x
            x = self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x, ctx)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual

    def set_kernel(self, kernel: DecoderLayerKernel | None) -> None:
        """Try ``kernel`` first on every forward from now on (None: the modules only)."""
        self.kernel = kernel


class LlamaModel(nn.Module):
    """input_ids, positions [T] -> final-normed hidden states [T, hidden]; a pipeline
    stage holds only its layers (``stages.py``)."""

    embedding_multiplier = 1.0
    """Scales the token embeddings, ``inputs_embeds`` too (Granite's; 1.0: unscaled)."""

    def __init__(
        self,
        arch: ArchConfig,
        options: BlockOptions,
        make_mlp: MlpFactory | None = None,
        max_model_len: int | None = None,
    ) -> None:
        super().__init__()
        # One cos/sin table for all layers: it can be tens of MB for long contexts.
        rotary_emb = get_rope_for_arch(arch, max_model_len)
        windows = layer_sliding_windows(arch)
        self._build_stack(
            arch,
            lambda i: LlamaDecoderLayer(
                arch,
                LlamaAttention(arch, i, rotary_emb, options, windows[i]),
                self._layer_mlp(arch, options, make_mlp, i),
            ),
        )

    def _build_stack(self, arch: ArchConfig, build_layer: Callable[[int], nn.Module]) -> None:
        """The token embedding, this pipeline stage's layers (``build_layer(i)`` makes layer
        ``i``) and the final RMSNorm."""
        self.embed_tokens = on_first_stage(
            lambda: VocabParallelEmbedding(arch.vocab_size, arch.hidden_size),
            also_last=arch.tie_word_embeddings,  # the LM head shares its table
        )
        self.layers = stage_layers(arch.num_hidden_layers, build_layer)
        self.start_layer, self.end_layer = this_stage_layers(arch.num_hidden_layers)
        self.is_last_stage = get_pipeline_state().is_last
        self.norm = on_last_stage(lambda: RMSNorm(arch.hidden_size, arch.rms_norm_eps))

    @staticmethod
    def _layer_mlp(
        arch: ArchConfig, options: BlockOptions, make_mlp: MlpFactory | None, layer_idx: int
    ) -> nn.Module:
        mlp = make_mlp(layer_idx) if make_mlp is not None else None
        return mlp if mlp is not None else LlamaMLP(arch, bias=options.mlp_bias)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        ctx: ForwardContext,
        intermediate: IntermediateTensors | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor | IntermediateTensors:
        residual: torch.Tensor | None
        if intermediate is None:
            x = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
            residual = None
            if self.embedding_multiplier != 1.0:
                x = x * self.embedding_multiplier
        else:
            x, residual = intermediate["hidden_states"], intermediate["residual"]
        for layer in itertools.islice(self.layers, self.start_layer, self.end_layer):
            x, residual = layer(positions, x, residual, ctx)
        if not self.is_last_stage:
            return {"hidden_states": x, "residual": residual}
        x, _ = self.norm(x, residual)
        return x


class LlamaForCausalLM(CausalLM):
    """The model runner's entry point for every Llama-family architecture."""

    intermediate_names = ("hidden_states", "residual")
    supports_prompt_embeds = True

    # (our merged parameter, the HF projection it contains, that projection's shard id)
    stacked_params: ClassVar[tuple[tuple[str, str, str | int], ...]] = (
        ("qkv_proj", "q_proj", "q"),
        ("qkv_proj", "k_proj", "k"),
        ("qkv_proj", "v_proj", "v"),
        ("gate_up_proj", "gate_proj", 0),
        ("gate_up_proj", "up_proj", 1),
    )

    @classmethod
    def block_options(cls, arch: ArchConfig) -> BlockOptions:
        return BlockOptions(
            qkv_bias=arch.attention_bias,
            o_proj_bias=arch.attention_bias,
            mlp_bias=bool(arch.raw.get("mlp_bias", False)),
        )

    def mlp_factory(self, arch: ArchConfig) -> MlpFactory | None:
        """Builds each layer's MLP when it is not the dense SwiGLU one (MoE subclasses)."""
        return None

    def __init__(self, arch: ArchConfig, max_model_len: int | None = None) -> None:
        """``max_model_len``: the longest sequence served (None: the config's limit);
        only context-dependent rope variants (LongRoPE) read it."""
        super().__init__()
        self.arch = arch
        self.model = LlamaModel(
            arch, self.block_options(arch), self.mlp_factory(arch), max_model_len
        )
        self.add_lm_head(self.model.embed_tokens, arch.tie_word_embeddings)

    @property
    def decoder(self) -> nn.Module:
        return self.model

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy HF-named tensors into the parameters; returns the parameter names filled."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name or self.is_other_stage(name):
                continue  # derived from the config (some old checkpoints saved it)
            if name == "lm_head.weight" and self.tied:
                continue  # the head shares the embedding table
            for merged, part, shard_id in self.stacked_params:
                if f".{part}." in name:
                    param_name = name.replace(f".{part}.", f".{merged}.")
                    self._param(params, param_name, name).weight_loader(
                        params[param_name], tensor, shard_id
                    )
                    break
            else:
                param_name = name
                param = self._param(params, name, name)
                get_weight_loader(param)(param, tensor)
            loaded.add(param_name)
        return loaded

    def _param(
        self, params: dict[str, nn.Parameter], param_name: str, hf_name: str
    ) -> nn.Parameter:
        if param_name not in params:
            raise ValueError(
                f"checkpoint tensor {hf_name!r} has no parameter in {type(self).__name__}; "
                f"the file does not match architecture {self.arch.architecture!r} "
                "(check config.json's 'architectures' and its bias/qk-norm settings)."
            )
        return params[param_name]


class MistralForCausalLM(LlamaForCausalLM):
    @classmethod
    def block_options(cls, arch: ArchConfig) -> BlockOptions:
        return BlockOptions()


class Qwen2ForCausalLM(LlamaForCausalLM):
    @classmethod
    def block_options(cls, arch: ArchConfig) -> BlockOptions:
        return BlockOptions(qkv_bias=True)


class Qwen3ForCausalLM(LlamaForCausalLM):
    @classmethod
    def block_options(cls, arch: ArchConfig) -> BlockOptions:
        return BlockOptions(
            qkv_bias=arch.attention_bias, o_proj_bias=arch.attention_bias, qk_norm=True
        )
