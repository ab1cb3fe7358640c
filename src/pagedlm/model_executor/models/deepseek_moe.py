"""DeepSeek's mixture-of-experts MLP (V2, V2-Lite, V3, R1, Kimi-K2): routed experts plus
shared experts that every token goes through, and where in the stack the MoE layers are.

Layers ``first_k_dense_replace ..`` on the ``moe_layer_freq`` stride are MoE (the
reference's rule; transformers ignores the stride, which every released config sets to
1), the others a dense SwiGLU MLP of ``intermediate_size``. An MoE layer routes each
token to ``num_experts_per_tok`` of ``n_routed_experts`` SwiGLU experts of
``moe_intermediate_size`` and adds ``n_shared_experts`` shared ones, fused into one MLP
of ``n_shared_experts * moe_intermediate_size`` (unweighted).

Routing (``ExpertRouting`` in ``layers/moe.py``), from config.json:

- V2: softmax scores; ``topk_method`` "greedy" (plain top-k) or "group_limited_greedy"
  (only the ``topk_group`` of ``n_group`` groups with the best single expert).
- V3: sigmoid scores (``scoring_func``); ``topk_method`` "noaux_tc" adds
  ``e_score_correction_bias`` to choose (never to weigh) and ranks groups by the sum of
  their top two biased scores.
- Both: ``norm_topk_prob`` renormalizes the chosen weights, then they are multiplied by
  ``routed_scaling_factor``. (transformers' V2 never renormalizes; every released V2
  config has ``norm_topk_prob`` false, and vLLM renormalizes when it is true, as here.)
"""

from __future__ import annotations

import dataclasses

import torch

from pagedlm.config import ArchConfig
from pagedlm.model_executor.layers.moe import ExpertGroups, ExpertRouting, FusedMoE
from pagedlm.model_executor.models.llama import LlamaMLP

V2_ARCHITECTURE = "DeepseekV2ForCausalLM"
TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")


def is_moe_layer(arch: ArchConfig, layer_idx: int) -> bool:
    raw = arch.raw
    frequency = int(raw.get("moe_layer_freq") or 1)
    return (
        bool(raw.get("n_routed_experts"))
        and layer_idx >= int(raw.get("first_k_dense_replace") or 0)
        and layer_idx % frequency == 0
    )


def expert_routing(arch: ArchConfig) -> ExpertRouting:
    """The routing config.json asks for (V2's defaults: softmax, greedy; V3's: sigmoid,
    noaux_tc)."""
    raw = arch.raw
    is_v2 = arch.architecture == V2_ARCHITECTURE
    method = raw.get("topk_method") or ("greedy" if is_v2 else "noaux_tc")
    if method not in TOPK_METHODS:
        raise ValueError(
            f"topk_method={method!r} is not supported; use one of {list(TOPK_METHODS)}."
        )
    groups = None
    if method != "greedy" and raw.get("n_group"):
        groups = ExpertGroups(
            num_groups=int(raw["n_group"]),
            topk_groups=int(raw.get("topk_group") or raw["n_group"]),
            score="top2_sum" if method == "noaux_tc" else "max",
        )
    return ExpertRouting(
        scoring=raw.get("scoring_func") or ("softmax" if is_v2 else "sigmoid"),
        correction_bias=method == "noaux_tc",
        groups=groups,
        scaling_factor=float(raw.get("routed_scaling_factor") or 1.0),
    )


class DeepseekMoE(FusedMoE):
    """forward(x [T, hidden]) -> [T, hidden]: the routed experts' ``FusedMoE`` output plus
    the shared experts' (one dense SwiGLU MLP, no gate).

    A subclass so the router, expert weights and ``e_score_correction_bias`` keep
    ``FusedMoE``'s names at the layer's ``mlp``; the shared experts are ``shared_experts``
    as in the checkpoint, sharded like any dense MLP under tensor parallelism (one
    all-reduce for both partial sums).
    """

    def __init__(self, arch: ArchConfig) -> None:
        raw = arch.raw
        intermediate = int(raw["moe_intermediate_size"])
        super().__init__(
            num_experts=int(raw["n_routed_experts"]),
            top_k=int(raw["num_experts_per_tok"]),
            hidden_size=arch.hidden_size,
            intermediate_size=intermediate,
            renormalize=bool(raw.get("norm_topk_prob", False)),
            hidden_act=arch.hidden_act,
            routing=expert_routing(arch),
        )
        num_shared = int(raw.get("n_shared_experts") or 0)
        self.shared_experts: LlamaMLP | None = None
        if num_shared:
            shared = dataclasses.replace(arch, intermediate_size=num_shared * intermediate)
            self.shared_experts = LlamaMLP(
                shared, bias=bool(raw.get("mlp_bias", False)), reduce_results=False
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        routed = self.routed_partial(x)
        if self.shared_experts is not None:
            routed = routed + self.shared_experts(x)
        return self.reduce(routed)


def split_stacked_experts(
    name: str, tensor: torch.Tensor
) -> list[tuple[int, str, torch.Tensor]] | None:
    """A stacked expert tensor as transformers holds it in memory (``experts.gate_up_proj``
    [E, 2 * I, hidden], gate rows first; ``experts.down_proj`` [E, hidden, I]) ->
    (expert id, shard, 2-D tensor) per expert; None for any other tensor."""
    if name.endswith(".experts.gate_up_proj"):
        gate, up = tensor.chunk(2, dim=1)
        return [(e, "gate", gate[e]) for e in range(len(tensor))] + [
            (e, "up", up[e]) for e in range(len(tensor))
        ]
    if name.endswith(".experts.down_proj"):
        return [(e, "down", tensor[e]) for e in range(len(tensor))]
    return None
