"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2's attention with top-k experts plus a
shared expert.

Each MoE layer adds, to its routed experts' sum, a dense SwiGLU "shared expert" of
``shared_expert_intermediate_size`` that every token goes through, weighted per token by
``sigmoid(shared_expert_gate(x))``. Where the layers are MoE (``decoder_sparse_step``,
``mlp_only_layers``) and how routing renormalizes (``norm_topk_prob``, off by default) are
Qwen3-MoE's rules; q/k/v carry a bias (``qkv_bias``, on by default), o_proj none, and
there is no q/k norm. Checkpoints name the parts ``mlp.gate`` (router),
``mlp.experts.{e}.{gate,up,down}_proj``, ``mlp.shared_expert.*`` and
``mlp.shared_expert_gate``.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from pagedlm.config import ArchConfig
from pagedlm.model_executor.layers.moe import FusedMoE, MoERouter
from pagedlm.model_executor.models.llama import BlockOptions, LlamaMLP, MlpFactory
from pagedlm.model_executor.models.mixtral import num_experts
from pagedlm.model_executor.models.qwen3_moe import Qwen3MoeForCausalLM


class SharedExpertMoE(FusedMoE):
    """forward(x [T, hidden]) -> [T, hidden]: the routed experts' ``FusedMoE`` output plus
    ``sigmoid(shared_expert_gate(x)) * shared_expert(x)``.

    A subclass rather than a wrapper so the router and expert weights keep ``FusedMoE``'s
    names at the layer's ``mlp``. Under tensor parallelism the shared expert shards like
    any dense MLP, and its partial sum joins the routed experts' in one all-reduce.
    """

    def __init__(self, arch: ArchConfig, shared_intermediate_size: int, **moe_args) -> None:
        super().__init__(**moe_args)
        shared = dataclasses.replace(arch, intermediate_size=shared_intermediate_size)
        self.shared_expert = LlamaMLP(shared, bias=False, reduce_results=False)
        # [1, hidden], replicated: one gate logit per token.
        self.shared_expert_gate = MoERouter(arch.hidden_size, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return self.reduce(self.routed_partial(x) + shared)


class Qwen2MoeForCausalLM(Qwen3MoeForCausalLM):
    @classmethod
    def block_options(cls, arch: ArchConfig) -> BlockOptions:
        return BlockOptions(qkv_bias=bool(arch.raw.get("qkv_bias", True)))

    def mlp_factory(self, arch: ArchConfig) -> MlpFactory:
        shared_size = int(arch.raw.get("shared_expert_intermediate_size") or 0)

        def make(layer_idx: int) -> nn.Module | None:
            if not self.is_moe_layer(arch, layer_idx):
                return None
            moe_args = dict(
                num_experts=num_experts(arch),
                top_k=int(arch.raw.get("num_experts_per_tok", 4)),
                hidden_size=arch.hidden_size,
                intermediate_size=self.moe_intermediate_size(arch),
                renormalize=self.routing_renormalizes(arch),
                hidden_act=arch.hidden_act,
            )
            if shared_size == 0:
                return FusedMoE(**moe_args)
            return SharedExpertMoE(arch, shared_size, **moe_args)

        return make
