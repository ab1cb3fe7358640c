"""DeepSeek-V2 and -V3 (V2-Lite, R1, Kimi-K2): multi-head latent attention (MLA) and
DeepSeek's mixture of experts (``deepseek_moe.py``).

MLA compresses keys and values through a ``kv_lora_rank`` latent: ``kv_a_proj_with_mqa``
gives the latent plus one rotary key of ``qk_rope_head_dim`` shared by all heads;
``kv_a_layernorm`` then ``kv_b_proj`` expand the latent to each head's non-rotary key
(``qk_nope_head_dim``) and value (``v_head_dim``). Queries come from ``q_proj``, or from
``q_a_proj`` -> ``q_a_layernorm`` -> ``q_b_proj`` when ``q_lora_rank`` is set. Only the
last ``qk_rope_head_dim`` features of each query and key rotate, as adjacent pairs
(V2 always; V3 when ``rope_interleave``, its default) or as halves.

Two forms of the same attention (``pagedlm.worker.latent_kv`` picks, the latent one by
default):

- **Latent** (``enable_latent_kv``, vLLM's MLA backends): the cache holds, per token and
  layer, one vector of ``kv_lora_rank + qk_rope_head_dim`` features, the normalized
  latent and the rotated shared key, which is every head's key and, in its first
  ``kv_lora_rank`` features, every head's value (``Attention``'s ``value_dim``).
  ``kv_b_proj``'s per-head maps are folded in once after loading: each head's query
  becomes ``q_nope @ W_UK`` (its ``kv_lora_rank`` features) next to its rotated
  ``q_rope``, and each head's output over the latent ``o @ W_UV^T``. Scores are the same
  sums, ``q_nope . (W_UK latent) + q_rope . k_rope``, in another order. For V3 that is 576
  elements per token and layer against 49,152 expanded: 85 times less.
- **Expanded** (as vLLM's first MLA support did): ordinary multi-head attention over each
  head's keys of ``qk_nope_head_dim + qk_rope_head_dim`` and values zero-padded to that
  size (backends take one head size for both), each head's output cut back to
  ``v_head_dim``. The KV cache's head size is then ``ArchConfig.head_dim``, which
  ``ArchConfig.from_hf_dict`` makes ``qk_nope + qk_rope`` for such configs.

Softmax scale: ``(qk_nope + qk_rope) ** -0.5``, times ``mscale(factor, mscale_all_dim)^2``
when the rope scaling names ``mscale_all_dim`` (any type but "default", as transformers
has it); YaRN's cos/sin factor (``mscale / mscale_all_dim``) scales the rotary features
only. Tensor parallel: heads split across ranks (``q_proj``/``q_b_proj`` and
``kv_b_proj`` column-parallel, ``o_proj`` row-parallel); the ``*_a_proj`` layers and their
norms are replicated.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Iterable, Iterator
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from pagedlm.config import ArchConfig
from pagedlm.distributed import (
    divide,
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
)
from pagedlm.model_executor.forward_context import ForwardContext
from pagedlm.model_executor.layers.attention import Attention
from pagedlm.model_executor.layers.layernorm import RMSNorm
from pagedlm.model_executor.layers.linear import ColumnParallelLinear, RowParallelLinear
from pagedlm.model_executor.layers.linear_base import LinearBase, linear_weight
from pagedlm.model_executor.layers.rope_frequencies import rope_context_length
from pagedlm.model_executor.layers.rotary_embedding import RotaryEmbedding
from pagedlm.model_executor.layers.rotary_scaled import get_rope
from pagedlm.model_executor.models.deepseek_moe import (
    V2_ARCHITECTURE,
    DeepseekMoE,
    is_moe_layer,
    split_stacked_experts,
)
from pagedlm.model_executor.models.llama import LlamaDecoderLayer, LlamaMLP
from pagedlm.model_executor.models.llama_stack import LlamaStack
from pagedlm.model_executor.models.mixtral import MoEForCausalLM
from pagedlm.model_executor.quantization import fp8
from pagedlm.model_executor.quantization.fp8 import is_fp8_layer

logger = logging.getLogger(__name__)

LATENT_NORM_EPS = 1e-6
"""``q_a_layernorm``/``kv_a_layernorm`` use RMSNorm's default eps in the reference and in
transformers, not ``rms_norm_eps``."""


def key_head_dim(arch: ArchConfig) -> int:
    return int(arch.raw["qk_nope_head_dim"]) + int(arch.raw["qk_rope_head_dim"])


def softmax_scale(arch: ArchConfig) -> float:
    """``key_head_dim ** -0.5``, times YaRN's ``mscale`` for ``mscale_all_dim`` squared."""
    scale = key_head_dim(arch) ** -0.5
    scaling = arch.rope_scaling or {}
    mscale_all_dim = scaling.get("mscale_all_dim")
    factor = scaling.get("factor") or 1.0
    if mscale_all_dim and factor > 1:
        mscale = 0.1 * mscale_all_dim * math.log(factor) + 1.0
        scale *= mscale * mscale
    return scale


def latent_rotary(arch: ArchConfig) -> RotaryEmbedding:
    """The rotation of the ``qk_rope_head_dim`` features (one module for all layers)."""
    raw = arch.raw
    interleaved = arch.architecture == V2_ARCHITECTURE or raw.get("rope_interleave", True)
    scaling = arch.rope_scaling
    return get_rope(
        int(raw["qk_rope_head_dim"]),
        rope_context_length(arch.max_position_embeddings, scaling),
        arch.rope_theta,
        scaling,
        is_neox_style=not interleaved,
    )


class ReplicatedLinear(LinearBase):
    """``y = x W^T (+ b)`` with the whole weight on every rank: x [T, in] -> [T, out]."""

    def __init__(self, input_size: int, output_size: int, bias: bool) -> None:
        super().__init__()
        self.weight = linear_weight(output_size, input_size)
        self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.apply_linear(x)


class MultiHeadLatentAttention(nn.Module):
    """x [T, hidden] -> o_proj(attention over keys and values expanded from the latent)
    [T, hidden]; see the module docstring."""

    def __init__(self, arch: ArchConfig, layer_idx: int, rotary_emb: RotaryEmbedding) -> None:
        super().__init__()
        raw = arch.raw
        num_heads = arch.num_attention_heads
        self.nope_dim = int(raw["qk_nope_head_dim"])
        self.rope_dim = int(raw["qk_rope_head_dim"])
        self.v_head_dim = int(raw["v_head_dim"])
        self.kv_lora_rank = int(raw["kv_lora_rank"])
        self.head_dim = self.nope_dim + self.rope_dim
        if self.v_head_dim > self.head_dim:
            raise ValueError(
                f"v_head_dim={self.v_head_dim} exceeds qk_nope_head_dim + qk_rope_head_dim="
                f"{self.head_dim}; MLA as multi-head attention pads values to the key size."
            )
        self.num_local_heads = divide(num_heads, get_tensor_model_parallel_world_size())
        bias = arch.attention_bias
        q_size = num_heads * self.head_dim
        q_lora_rank = raw.get("q_lora_rank")
        self.q_through_latent = q_lora_rank is not None
        if q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(arch.hidden_size, q_size)
        else:
            self.q_a_proj = ReplicatedLinear(arch.hidden_size, int(q_lora_rank), bias)
            self.q_a_layernorm = RMSNorm(int(q_lora_rank), LATENT_NORM_EPS)
            self.q_b_proj = ColumnParallelLinear(int(q_lora_rank), q_size)
        self.kv_a_proj_with_mqa = ReplicatedLinear(
            arch.hidden_size, self.kv_lora_rank + self.rope_dim, bias
        )
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = ColumnParallelLinear(
            self.kv_lora_rank, num_heads * (self.nope_dim + self.v_head_dim)
        )
        self.o_proj = RowParallelLinear(num_heads * self.v_head_dim, arch.hidden_size, bias=bias)
        self.rotary_emb = rotary_emb
        self.attn = Attention(
            layer_idx,
            num_heads=self.num_local_heads,
            num_kv_heads=self.num_local_heads,
            head_dim=self.head_dim,
            scale=softmax_scale(arch),
        )
        self.latent = False
        """Whether ``enable_latent`` switched this layer to the latent cache."""

    def enable_latent(self) -> None:
        """Attend over the latent cache from now on: ``kv_b_proj``'s key and value maps of
        this rank's heads folded into ``w_uk`` [heads, qk_nope, rank] and ``w_uv`` [heads,
        rank, v_head_dim], read from the loaded layer whatever its format (an FP8 layer's
        codes times their scales, any other's product with the identity), and the layer
        itself dropped."""
        if self.latent:
            return
        if self.kv_b_proj.bias is not None:
            raise ValueError("kv_b_proj with a bias cannot be folded into latent attention.")
        rank, heads = self.kv_lora_rank, self.num_local_heads
        norm_weight = self.kv_a_layernorm.weight
        with torch.no_grad():
            if is_fp8_layer(self.kv_b_proj):
                # Its codes times their row scales: the product with the identity would
                # quantize the identity too, inexactly under a static input scale.
                layer = self.kv_b_proj
                dense = fp8.dequantize(layer.weight, layer.weight_scale).to(norm_weight.dtype)
            else:
                eye = torch.eye(rank, dtype=norm_weight.dtype, device=norm_weight.device)
                dense = self.kv_b_proj(eye).t()
            maps = dense.reshape(heads, self.nope_dim + self.v_head_dim, rank)
        self.register_buffer("w_uk", maps[:, : self.nope_dim].contiguous(), persistent=False)
        self.register_buffer(
            "w_uv", maps[:, self.nope_dim :].transpose(1, 2).contiguous(), persistent=False
        )
        del self.kv_b_proj
        old = self.attn
        scales = torch.cat([old.k_scale, old.v_scale])
        if not scales.is_meta and bool((scales != 1).any()):
            logger.warning(
                "Layer %d: the checkpoint's KV cache scales were calibrated for expanded "
                "keys and values; the latent cache keeps 1.0 (PAGEDLM_MLA_DISABLE=1 uses them).",
                old.layer_idx,
            )
        with torch.device(norm_weight.device):  # its scale buffers beside the weights
            self.attn = Attention(
                self.attn.layer_idx,
                num_heads=heads,
                num_kv_heads=1,
                head_dim=rank + self.rope_dim,
                scale=self.attn.scale,
                value_dim=rank,
            )
        self.latent = True

    def fold_kv_b_proj(self, weight: torch.Tensor) -> None:
        """Load a checkpoint's whole ``kv_b_proj.weight`` [heads * (qk_nope + v), rank] into
        ``w_uk``/``w_uv`` after the switch (in-place weight updates: vLLM's
        ``load_weights`` through ``collective_rpc``), this rank's heads only."""
        heads, rank = self.num_local_heads, self.kv_lora_rank
        per_head = self.nope_dim + self.v_head_dim
        if not weight.is_floating_point() or weight.dtype == fp8.FP8_DTYPE:
            raise ValueError(
                f"kv_b_proj.weight arrives as {weight.dtype}: in-place loads into the latent "
                "form take float weights (load quantized checkpoints anew, reload_weights)."
            )
        if weight.dim() != 2 or weight.shape[1] != rank or weight.shape[0] % per_head:
            raise ValueError(
                f"kv_b_proj.weight of shape {tuple(weight.shape)} does not fit heads of "
                f"{per_head} rows over kv_lora_rank={rank}."
            )
        first = get_tensor_model_parallel_rank() * heads
        maps = weight.reshape(-1, per_head, rank)[first : first + heads]
        self.w_uk.copy_(maps[:, : self.nope_dim])
        self.w_uv.copy_(maps[:, self.nope_dim :].transpose(1, 2))

    def _query(self, x: torch.Tensor) -> torch.Tensor:
        if self.q_through_latent:
            return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        return self.q_proj(x)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        num_tokens, heads = x.shape[0], self.num_local_heads
        q = self._query(x).view(num_tokens, heads, self.head_dim)
        latent, k_rope = self.kv_a_proj_with_mqa(x).split(
            [self.kv_lora_rank, self.rope_dim], dim=-1
        )
        if self.latent:
            return self._latent_forward(positions, q, latent, k_rope, ctx)
        kv = self.kv_b_proj(self.kv_a_layernorm(latent.contiguous()))
        k_nope, v = kv.view(num_tokens, heads, -1).split([self.nope_dim, self.v_head_dim], -1)
        # [T, heads * rope] and [T, rope] (one key head shared by all): rotated as such.
        q_rope = q[..., self.nope_dim :].reshape(num_tokens, heads * self.rope_dim)
        q_rope, k_rope = self.rotary_emb(positions, q_rope, k_rope.contiguous())
        q = torch.cat([q[..., : self.nope_dim], q_rope.view(num_tokens, heads, -1)], dim=-1)
        k_rope = k_rope.view(num_tokens, 1, self.rope_dim).expand(-1, heads, -1)
        k = torch.cat([k_nope, k_rope], dim=-1)
        v = F.pad(v, (0, self.head_dim - self.v_head_dim))  # zeros: one head size for k and v
        out = self.attn(
            q.reshape(num_tokens, -1), k.reshape(num_tokens, -1), v.reshape(num_tokens, -1), ctx
        )
        out = out.view(num_tokens, heads, self.head_dim)[..., : self.v_head_dim]
        return self.o_proj(out.reshape(num_tokens, heads * self.v_head_dim))

    def _latent_forward(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        latent: torch.Tensor,
        k_rope: torch.Tensor,
        ctx: ForwardContext,
    ) -> torch.Tensor:
        """q [T, heads, qk_nope + qk_rope], latent [T, rank], k_rope [T, qk_rope] ->
        [T, hidden] through the latent cache (see the module docstring)."""
        num_tokens, heads, rank = q.shape[0], self.num_local_heads, self.kv_lora_rank
        q_nope, q_rope = q.split([self.nope_dim, self.rope_dim], dim=-1)
        q_rope, k_rope = self.rotary_emb(
            positions, q_rope.reshape(num_tokens, heads * self.rope_dim), k_rope.contiguous()
        )
        q_latent = torch.bmm(q_nope.transpose(0, 1), self.w_uk)  # [heads, T, rank]
        query = torch.cat(
            [q_latent.transpose(0, 1), q_rope.view(num_tokens, heads, self.rope_dim)], dim=-1
        )
        kv = torch.cat([self.kv_a_layernorm(latent.contiguous()), k_rope], dim=-1)
        out = self.attn(query.reshape(num_tokens, -1), kv, kv, ctx)  # [T, heads * rank]
        out = torch.bmm(out.view(num_tokens, heads, rank).transpose(0, 1), self.w_uv)
        return self.o_proj(out.transpose(0, 1).reshape(num_tokens, heads * self.v_head_dim))


class DeepseekDecoderLayer(LlamaDecoderLayer):
    """Llama's pre-norm block around MLA and a dense or DeepSeek MoE MLP: a class of its
    own so no platform's whole-block Llama kernel takes it."""


_LAYER_INDEX = re.compile(r"^model\.layers\.(\d+)\.")


class DeepseekV2ForCausalLM(MoEForCausalLM):
    """DeepSeek-V2 / V2-Lite (and, through ``DeepseekV3ForCausalLM``, V3, R1, Kimi-K2).

    Checkpoint names are transformers': ``self_attn.{q_proj | q_a_proj, q_a_layernorm,
    q_b_proj}``, ``kv_a_proj_with_mqa``, ``kv_a_layernorm``, ``kv_b_proj``, ``o_proj``;
    ``mlp.{gate, experts.{e}.*_proj, shared_experts.*}``, V3's router bias
    ``mlp.gate.e_score_correction_bias``. Stacked expert tensors and the reference's
    multi-token-prediction layers (``model.layers.{num_hidden_layers}..``, unused) are
    accepted.
    """

    stacked_params: ClassVar[tuple[tuple[str, str, str | int], ...]] = (
        ("gate_up_proj", "gate_proj", 0),
        ("gate_up_proj", "up_proj", 1),
    )

    def __init__(self, arch: ArchConfig, max_model_len: int | None = None) -> None:
        nn.Module.__init__(self)
        self.arch = arch
        check_cache_head_size(arch)
        rotary_emb = latent_rotary(arch)
        mlp_bias = bool(arch.raw.get("mlp_bias", False))

        def build_layer(i: int) -> DeepseekDecoderLayer:
            mlp = DeepseekMoE(arch) if is_moe_layer(arch, i) else LlamaMLP(arch, bias=mlp_bias)
            return DeepseekDecoderLayer(arch, MultiHeadLatentAttention(arch, i, rotary_emb), mlp)

        self.model = LlamaStack(arch, build_layer)
        self.add_lm_head(self.model.embed_tokens, arch.tie_word_embeddings)

    def enable_latent_kv(self) -> None:
        """Every layer of this stage attends over the latent cache (``pagedlm.worker.
        latent_kv`` decides; after loading, before the KV cache is sized)."""
        for module in self.modules():
            if isinstance(module, MultiHeadLatentAttention):
                module.enable_latent()

    def skips_layer(self, index: int) -> bool:
        """Whether checkpoint layer ``index`` is not this model's: the multi-token-prediction
        layers after the decoder's (``deepseek_mtp.DeepSeekMTP`` loads those)."""
        return index >= self.arch.num_hidden_layers

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.named_parameters())
        loaded: set[str] = set()

        def remaining(
            weights: Iterable[tuple[str, torch.Tensor]],
        ) -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                layer = _LAYER_INDEX.match(name)
                if layer is not None and self.skips_layer(int(layer.group(1))):
                    continue
                if self.is_other_stage(name):
                    continue
                if name.endswith(".self_attn.kv_b_proj.weight") and name not in params:
                    attention = self.get_submodule(name.removesuffix(".kv_b_proj.weight"))
                    if getattr(attention, "latent", False):  # folded at the switch
                        attention.fold_kv_b_proj(tensor)
                        loaded.add(name)
                        continue
                # The router's bias is the MoE layer's (the router is a plain linear).
                name = name.replace(".gate.e_score_correction_bias", ".e_score_correction_bias")
                experts = split_stacked_experts(name, tensor)
                if experts is None:
                    yield name, tensor
                    continue
                moe = name.rpartition(".experts.")[0]
                param_name = f"{moe}.{'w2' if name.endswith('down_proj') else 'w13'}"
                param = self._param(params, param_name, name)
                for expert_id, shard, expert_tensor in experts:
                    param.weight_loader(param, expert_tensor, expert_id, shard)
                loaded.add(param_name)

        return loaded | super().load_weights(remaining(weights))


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    """DeepSeek-V3 / R1 and Kimi-K2: V2's model with sigmoid, bias-corrected routing."""


def check_cache_head_size(arch: ArchConfig) -> None:
    """The KV cache is sized by ``arch.head_dim``; MLA as multi-head attention needs keys
    (and padded values) of ``qk_nope_head_dim + qk_rope_head_dim`` there."""
    needed = key_head_dim(arch)
    if arch.head_dim != needed:
        raise ValueError(
            f"{arch.architecture} attends with heads of qk_nope_head_dim + qk_rope_head_dim = "
            f"{needed}, but the KV cache would be sized for head_dim={arch.head_dim} (an "
            "hf_overrides value?); drop the head_dim override."
        )
