"""A sparse mixture-of-experts MLP: a top-k router and SwiGLU experts in stacked weights.

One component for every MoE architecture: Mixtral (top-2, always renormalized) and
Qwen3-MoE (top-k, renormalized when ``norm_topk_prob``) differ only in ``renormalize``
and in their checkpoints' tensor names, which the model maps to ``(expert_id, shard)``.
DeepSeek's routers choose differently (``ExpertRouting``): sigmoid scores, a per-expert
bias that only steers the choice, group-limited choice and a scaling of the weights.

Parallelism: each rank holds the experts ``expert_start .. expert_start +
num_local_experts - 1`` and, of each, a slice of the intermediate dimension. Without
expert parallelism every tensor-parallel rank holds every expert and slices each; with
it (``enable_expert_parallel``) rank ``r`` of ``tp`` holds experts ``r * E / tp ..``
whole. Either way a rank computes only its experts' contributions for its slice, so the
layer's output is a partial sum that one all-reduce over the TP group completes — the same
contract as a row-parallel linear.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from pagedlm.distributed import (
    divide,
    expert_parallel_enabled,
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    tensor_model_parallel_all_reduce,
)
from pagedlm.model_executor.layers.activation import get_act_and_mul
from pagedlm.model_executor.layers.linear_base import LinearBase
from pagedlm.model_executor.layers.row_tiles import in_row_tiles
from pagedlm.model_executor.loader.weight_utils import (
    copy_checked,
    set_weight_loader,
    shard_of,
)
from pagedlm.model_executor.quantization.fp8 import FP8_DTYPE, quantize_rows


class MoERouter(LinearBase):
    """Router logits, replicated on every rank: x [T, hidden] -> [T, num_experts]. Never
    quantized at load (``quantized_at_load``)."""

    quantized_at_load: ClassVar[bool] = False

    def __init__(self, hidden_size: int, num_experts: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.apply_linear(x)


@dataclass(frozen=True)
class ExpertGroups:
    """Group-limited choice (DeepSeek): the experts form ``num_groups`` equal groups in id
    order, and a token chooses only among the experts of its ``topk_groups`` best groups.
    A group scores its best expert (``score="max"``, DeepSeek-V2's ``group_limited_greedy``)
    or its best two summed (``"top2_sum"``, DeepSeek-V3's ``noaux_tc``)."""

    num_groups: int
    topk_groups: int
    score: str = "max"


@dataclass(frozen=True)
class ExpertRouting:
    """How a router's logits choose and weigh experts when it is not a plain softmax top-k.

    ``scoring``: "softmax" over all experts or an independent "sigmoid" per expert, in
    float32. ``correction_bias``: the layer holds ``e_score_correction_bias`` [num_experts]
    (float32), added to the scores to *choose* experts only; the weights are the unbiased
    scores of the chosen ones. ``groups``: group-limited choice (None: any expert).
    ``scaling_factor``: multiplies the final weights (DeepSeek's ``routed_scaling_factor``,
    after any renormalization).
    """

    scoring: str = "softmax"
    correction_bias: bool = False
    groups: ExpertGroups | None = None
    scaling_factor: float = 1.0

    def check(self, num_experts: int, top_k: int) -> None:
        """Refuse settings that cannot route ``top_k`` of ``num_experts`` experts."""
        if self.scoring not in ("softmax", "sigmoid"):
            raise ValueError(
                f"scoring_func={self.scoring!r} is not supported; use 'softmax' or 'sigmoid'."
            )
        groups = self.groups
        if groups is None:
            return
        if groups.score not in ("max", "top2_sum"):
            raise ValueError(f"unknown group score {groups.score!r}; use 'max' or 'top2_sum'.")
        if num_experts % groups.num_groups or not 1 <= groups.topk_groups <= groups.num_groups:
            raise ValueError(
                f"n_group={groups.num_groups} must divide the {num_experts} experts and "
                f"topk_group={groups.topk_groups} must be between 1 and n_group; check "
                "config.json."
            )
        per_group = num_experts // groups.num_groups
        if top_k > groups.topk_groups * per_group or (groups.score == "top2_sum" and per_group < 2):
            raise ValueError(
                f"num_experts_per_tok={top_k} cannot be chosen from topk_group="
                f"{groups.topk_groups} groups of {per_group} experts (a group scored by its top "
                "two needs two experts); check n_group, topk_group and num_experts_per_tok."
            )


def select_experts(
    router_logits: torch.Tensor,
    top_k: int,
    renormalize: bool,
    routing: ExpertRouting | None = None,
    correction_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, num_experts] -> (weights float32 [T, top_k], expert ids [T, top_k]).

    Without ``routing``: softmax over all experts in float32, then the ``top_k`` largest;
    with ``renormalize`` the chosen weights are divided by their sum (so they add up to
    1). With it, as ``ExpertRouting`` says; ``correction_bias`` [num_experts] is the
    layer's ``e_score_correction_bias`` when ``routing.correction_bias``.
    """
    if routing is None:
        probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
        weights, expert_ids = torch.topk(probs, top_k, dim=-1)
        if renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, expert_ids
    if routing.scoring == "sigmoid":
        scores = router_logits.float().sigmoid()
    else:
        scores = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    choice = scores if correction_bias is None else scores + correction_bias.float()
    if routing.groups is not None:
        choice = _best_groups_only(choice, routing.groups)
    expert_ids = torch.topk(choice, top_k, dim=-1).indices
    weights = scores.gather(1, expert_ids)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if routing.scaling_factor != 1.0:
        weights = weights * routing.scaling_factor
    return weights, expert_ids


def _best_groups_only(choice: torch.Tensor, groups: ExpertGroups) -> torch.Tensor:
    """choice [T, num_experts] with the experts outside each token's best groups at -inf."""
    num_tokens, num_experts = choice.shape
    grouped = choice.view(num_tokens, groups.num_groups, num_experts // groups.num_groups)
    if groups.score == "max":
        group_scores = grouped.max(dim=-1).values
    else:
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
    best = torch.topk(group_scores, groups.topk_groups, dim=-1).indices
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
    return grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(num_tokens, num_experts)


HOST_GROUPING = "its MoE layers group tokens by expert on the host"
"""Why a forward through ``expert_groups`` cannot be captured in a CUDA graph: it reads each
expert's token count back from the device (a wait, and shapes that change per step). The
layers that use it carry this as ``uncapturable``; a graph runner skips such models."""


def expert_groups(
    expert_ids: torch.Tensor, weights: torch.Tensor, num_experts: int, expert_start: int = 0
) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    """The (token, slot) pairs of a routing (``expert_ids``, ``weights``: [T, top_k]) sorted
    by expert, so each expert runs one matmul on its rows: ``(local expert, token rows,
    their routing weights)`` for experts ``expert_start`` on, in order, skipping experts no
    token chose. The caller stops at its last local expert. Reads the counts on the host
    (``HOST_GROUPING``)."""
    top_k = expert_ids.shape[-1]
    flat_ids = expert_ids.flatten()
    order = torch.argsort(flat_ids, stable=True)
    counts = torch.bincount(flat_ids, minlength=num_experts).tolist()
    token_rows = order // top_k
    flat_weights = weights.flatten()
    start = sum(counts[:expert_start])
    for expert in range(expert_start, num_experts):
        count = counts[expert]
        if count:
            picked = order[start : start + count]
            yield expert - expert_start, token_rows[start : start + count], flat_weights[picked]
        start += count


def _refuse_quantized_load(param: nn.Parameter, loaded: torch.Tensor, *args: object) -> None:
    raise ValueError(
        "these experts were quantized to FP8 at load; new float expert weights cannot be "
        "copied into their codes in place: reload the model (reload_weights / "
        "update_weights_from_disk) instead."
    )


MoEKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""(x [T, hidden], weights float32 [T, top_k], expert ids [T, top_k]) -> this rank's
routed-expert partial [T, hidden] in x's dtype, as ``FusedMoE.routed_partial`` computes it."""


class FusedMoE(nn.Module):
    """forward(x [T, hidden]) -> [T, hidden]: sum over each token's top-k experts of
    ``weight * down(act(gate(x)) * up(x))``.

    Parameters: ``gate.weight`` [num_experts, hidden] (the router), ``w13``
    [num_local_experts, 2 * intermediate / tp, hidden] (gate rows, then up rows) and
    ``w2`` [num_local_experts, hidden, intermediate / tp]. ``load_expert(name, tensor,
    expert_id, shard)`` fills them from per-expert checkpoint tensors, shard being
    "gate", "up" or "down"; experts of other ranks are skipped. ``routing`` (None: softmax
    top-k) chooses experts otherwise; with ``routing.correction_bias`` the layer also holds
    ``e_score_correction_bias`` [num_experts], float32 in any model dtype as the scores are.

    FP8 experts (``quantize_fp8``, with ``quantization="fp8"``): ``w13``/``w2`` hold E4M3
    codes and ``w13_scale`` [num_local_experts, 2 * intermediate / tp] / ``w2_scale``
    [num_local_experts, hidden] float32 per-row scales, so that ``codes[e, r] *
    scale[e, r]`` is row ``r`` of expert ``e``'s weight. They are weight-only: an expert's
    product is ``(x . codes[e, r]) * scale[e, r]`` accumulated in float32 from activations
    in the model's dtype (no activation quantization, unlike the FP8 linear layers), then
    rounded to that dtype as the float experts' products are.
    """

    uncapturable: ClassVar[str] = HOST_GROUPING
    kernel: MoEKernel | None = None
    row_tile: int = 0
    """Batch-invariant mode (``pagedlm.batch_invariant``): each expert's GEMMs take its
    rows in tiles of exactly this many (0: as many as chose it), and a ``kernel`` uses
    one configuration for every batch."""

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        renormalize: bool,
        hidden_act: str = "silu",
        expert_start: int = 0,
        num_local_experts: int | None = None,
        routing: ExpertRouting | None = None,
    ) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(
                f"num_experts_per_tok={top_k} must be between 1 and the number of experts "
                f"({num_experts}); check config.json."
            )
        if routing is not None:
            routing.check(num_experts, top_k)
        self.num_experts = num_experts
        self.top_k = top_k
        self.renormalize = renormalize
        self.routing = routing
        self.e_score_correction_bias: nn.Parameter | None = None
        if routing is not None and routing.correction_bias:
            self.e_score_correction_bias = nn.Parameter(
                torch.empty(num_experts, dtype=torch.float32), requires_grad=False
            )
        self.tp_rank = get_tensor_model_parallel_rank()
        self.tp_size = get_tensor_model_parallel_world_size()
        # (rank, ranks) among which each expert's intermediate dimension is sliced.
        self.slice_rank, self.slice_size = self.tp_rank, self.tp_size
        if expert_parallel_enabled() and num_local_experts is None:
            num_local_experts = divide(num_experts, self.tp_size)
            expert_start = self.tp_rank * num_local_experts
            self.slice_rank, self.slice_size = 0, 1
        self.expert_start = expert_start
        self.num_local_experts = num_experts if num_local_experts is None else num_local_experts
        self.intermediate_per_rank = divide(intermediate_size, self.slice_size)
        self.gate = MoERouter(hidden_size, num_experts)
        self.w13 = nn.Parameter(
            torch.empty(self.num_local_experts, 2 * self.intermediate_per_rank, hidden_size),
            requires_grad=False,
        )
        self.w2 = nn.Parameter(
            torch.empty(self.num_local_experts, hidden_size, self.intermediate_per_rank),
            requires_grad=False,
        )
        set_weight_loader(self.w13, self.weight_loader)
        set_weight_loader(self.w2, self.weight_loader)
        self.w13_scale: nn.Parameter | None
        self.w2_scale: nn.Parameter | None
        self.register_parameter("w13_scale", None)  # FP8 experts' scales (quantize_fp8)
        self.register_parameter("w2_scale", None)
        self.act_fn = get_act_and_mul(hidden_act)

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, expert_id: int, shard: str
    ) -> None:
        """Copy expert ``expert_id``'s full ``shard`` tensor into this rank's slice."""
        local = expert_id - self.expert_start
        if not 0 <= local < self.num_local_experts:
            return  # another rank's expert
        size = self.intermediate_per_rank
        if shard == "down":
            copy_checked(
                param.data[local], shard_of(loaded_weight, 1, self.slice_rank, size), "expert down"
            )
            return
        if shard not in ("gate", "up"):
            raise ValueError(f"unknown expert shard {shard!r}; use 'gate', 'up' or 'down'.")
        target = param.data[local].narrow(0, 0 if shard == "gate" else size, size)
        copy_checked(target, shard_of(loaded_weight, 0, self.slice_rank, size), f"expert {shard}")

    @property
    def is_fp8(self) -> bool:
        return self.w13_scale is not None

    def quantize_fp8(self) -> None:
        """Turn loaded float experts into E4M3 codes with per-row scales (see the class
        docstring), each float tensor dropped as soon as its codes exist."""
        if self.is_fp8:
            return
        for name in ("w13", "w2"):
            weight = getattr(self, name).data
            codes = torch.empty(weight.shape, dtype=FP8_DTYPE, device=weight.device)
            scales = torch.empty(weight.shape[:2], dtype=torch.float32, device=weight.device)
            for expert in range(weight.shape[0]):  # one expert's float32 copy at a time
                codes[expert], expert_scales = quantize_rows(weight[expert])
                scales[expert] = expert_scales[:, 0]
            del weight
            setattr(self, name, nn.Parameter(codes, requires_grad=False))
            set_weight_loader(getattr(self, name), _refuse_quantized_load)
            setattr(self, f"{name}_scale", nn.Parameter(scales, requires_grad=False))

    def expert_linear(self, x: torch.Tensor, name: str, local: int) -> torch.Tensor:
        """``x @ expert local's w13 or w2 ^T`` in x's dtype, from codes and scales when the
        experts are FP8 (float32 products, one rounding)."""
        weight = getattr(self, name)[local]
        scale = getattr(self, f"{name}_scale")
        if self.row_tile:
            return in_row_tiles(
                lambda tile: self._product(tile, weight, scale, local), x, self.row_tile
            )
        return self._product(x, weight, scale, local)

    @staticmethod
    def _product(
        x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None, local: int
    ) -> torch.Tensor:
        if scale is None:
            return F.linear(x, weight)
        return (F.linear(x.float(), weight.float()) * scale[local]).to(x.dtype)

    def set_kernel(self, kernel: MoEKernel | None, capturable: bool = False) -> None:
        """Compute the routed experts with ``kernel`` from now on (None: back to
        ``expert_groups``). ``capturable``: the kernel never waits for the device and its
        shapes follow x's alone, so this layer no longer keeps a graph runner from
        capturing the model (its ``uncapturable`` becomes None)."""
        self.kernel = kernel
        if kernel is not None and capturable:
            self.__dict__["uncapturable"] = None  # shadows the class's reason
        else:
            self.__dict__.pop("uncapturable", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.reduce(self.routed_partial(x))

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """Sum a per-rank partial output over the tensor-parallel ranks."""
        return tensor_model_parallel_all_reduce(partial) if self.tp_size > 1 else partial

    def routed_partial(self, x: torch.Tensor) -> torch.Tensor:
        """The routed experts' output from this rank's experts or expert slices; ``reduce``
        sums it over the ranks (subclasses add their shared experts' partial first)."""
        weights, expert_ids = select_experts(
            self.gate(x), self.top_k, self.renormalize, self.routing, self.e_score_correction_bias
        )
        if self.kernel is not None:
            return self.kernel(x, weights, expert_ids)
        out = torch.zeros_like(x)
        groups = expert_groups(expert_ids, weights, self.num_experts, self.expert_start)
        for local, rows, row_weights in groups:
            if local >= self.num_local_experts:
                break
            hidden = self.act_fn(self.expert_linear(x[rows], "w13", local))
            hidden = self.expert_linear(hidden, "w2", local)
            out.index_add_(0, rows, (hidden * row_weights[:, None]).to(out.dtype))
        return out

    def extra_repr(self) -> str:
        return (
            f"num_experts={self.num_experts}, top_k={self.top_k}, "
            + ("fp8, " if self.is_fp8 else "")
            + f"renormalize={self.renormalize}, local_experts={self.expert_start}.."
            f"{self.expert_start + self.num_local_experts - 1}, tp_size={self.tp_size}, "
            f"slices={self.slice_size}"
            + ("" if self.routing is None else f", routing={self.routing}")
        )
