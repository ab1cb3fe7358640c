"""Qwen3-MoE: Qwen3's attention (per-head q/k RMSNorm) with top-k expert MLPs.

Routing renormalizes the chosen experts' weights only when ``norm_topk_prob``. Layers in
``mlp_only_layers``, or off the ``decoder_sparse_step`` stride, keep a dense SwiGLU MLP of
``intermediate_size``; expert MLPs use ``moe_intermediate_size``.
"""

from __future__ import annotations

from pagedlm.config import ArchConfig
from pagedlm.model_executor.models.llama import BlockOptions
from pagedlm.model_executor.models.mixtral import MoEForCausalLM, num_experts


class Qwen3MoeForCausalLM(MoEForCausalLM):
    @classmethod
    def block_options(cls, arch: ArchConfig) -> BlockOptions:
        return BlockOptions(
            qkv_bias=arch.attention_bias, o_proj_bias=arch.attention_bias, qk_norm=True
        )

    def moe_intermediate_size(self, arch: ArchConfig) -> int:
        return int(arch.raw.get("moe_intermediate_size") or arch.intermediate_size)

    def routing_renormalizes(self, arch: ArchConfig) -> bool:
        return bool(arch.raw.get("norm_topk_prob", False))

    def is_moe_layer(self, arch: ArchConfig, layer_idx: int) -> bool:
        raw = arch.raw
        step = int(raw.get("decoder_sparse_step", 1) or 1)
        return (
            layer_idx not in (raw.get("mlp_only_layers") or [])
            and num_experts(arch) > 0
            and (layer_idx + 1) % step == 0
        )
