"""Mixtral: a Mistral decoder whose MLP is a sparse mixture of experts (top-2, renormalized).

The attention half is Llama's; each layer's MLP is a ``FusedMoE``. Checkpoints name the
router ``block_sparse_moe.gate`` and expert ``e``'s projections
``block_sparse_moe.experts.{e}.w1`` (gate), ``w3`` (up) and ``w2`` (down); ``load_weights``
routes those to the stacked expert weights and hands everything else to Llama's loader.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import ClassVar

import torch
from torch import nn

from pagedlm.config import ArchConfig
from pagedlm.model_executor.layers.moe import FusedMoE
from pagedlm.model_executor.models.llama import BlockOptions, LlamaForCausalLM, MlpFactory


def num_experts(arch: ArchConfig) -> int:
    raw = arch.raw
    value = raw.get("num_local_experts") or raw.get("num_experts")
    if not value:
        raise ValueError(
            f"{arch.architecture} config.json has neither num_local_experts nor num_experts; "
            "add the number of experts."
        )
    return int(value)


class MoEForCausalLM(LlamaForCausalLM):
    """A Llama-family decoder with ``FusedMoE`` MLPs; subclasses say where and how."""

    moe_prefix: ClassVar[str] = "mlp"
    """What the checkpoint calls a layer's MoE module (``model.layers.{i}.<prefix>``)."""
    # Checkpoint expert projection name -> FusedMoE shard.
    expert_shards: ClassVar[dict[str, str]] = {
        "gate_proj": "gate",
        "up_proj": "up",
        "down_proj": "down",
    }

    def moe_intermediate_size(self, arch: ArchConfig) -> int:
        return arch.intermediate_size

    def is_moe_layer(self, arch: ArchConfig, layer_idx: int) -> bool:
        return True

    def routing_renormalizes(self, arch: ArchConfig) -> bool:
        """Whether the top-k weights are divided by their sum (Mixtral: always)."""
        return True

    def mlp_factory(self, arch: ArchConfig) -> MlpFactory:
        def make(layer_idx: int) -> nn.Module | None:
            if not self.is_moe_layer(arch, layer_idx):
                return None
            return FusedMoE(
                num_experts=num_experts(arch),
                top_k=int(arch.raw.get("num_experts_per_tok", 2)),
                hidden_size=arch.hidden_size,
                intermediate_size=self.moe_intermediate_size(arch),
                renormalize=self.routing_renormalizes(arch),
                hidden_act=arch.hidden_act,
            )

        return make

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        pattern = re.compile(
            rf"^(.*)\.{re.escape(self.moe_prefix)}\.experts\.(\d+)\.(\w+)\.weight$"
        )

        def non_expert(
            weights: Iterable[tuple[str, torch.Tensor]],
        ) -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                if self.is_other_stage(name):
                    continue
                match = pattern.match(name)
                if match is None:
                    # The router: <prefix>.gate.weight -> mlp.gate.weight.
                    yield name.replace(f".{self.moe_prefix}.gate.", ".mlp.gate."), tensor
                    continue
                layer, expert_id, projection = match.groups()
                shard = self.expert_shards.get(projection)
                if shard is None:
                    raise ValueError(
                        f"checkpoint tensor {name!r}: unknown expert projection "
                        f"{projection!r}; expected one of {sorted(self.expert_shards)}."
                    )
                param_name = f"{layer}.mlp.{'w2' if shard == 'down' else 'w13'}"
                param = self._param(params, param_name, name)
                param.weight_loader(param, tensor, int(expert_id), shard)
                loaded.add(param_name)

        return loaded | super().load_weights(non_expert(weights))


class MixtralForCausalLM(MoEForCausalLM):
    moe_prefix = "block_sparse_moe"
    expert_shards: ClassVar[dict[str, str]] = {"w1": "gate", "w3": "up", "w2": "down"}

    @classmethod
    def block_options(cls, arch: ArchConfig) -> BlockOptions:
        return BlockOptions()
