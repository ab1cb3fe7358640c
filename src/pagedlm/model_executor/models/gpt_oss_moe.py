"""gpt-oss's mixture of experts: a router with a bias whose top-k logits are softmaxed, and
experts with biases and a clamped SwiGLU, loaded from stacked checkpoint tensors.

Every piece differs from ``layers/moe.py``'s ``FusedMoE`` (routing, activation, biases,
tensor layout), so it is a module of its own; the parallel scheme is the same. Per token:
``logits = x R^T + r``; the ``top_k`` largest, softmaxed among themselves, weight their
experts' outputs ``down(swiglu(gate_up(x) + b13)) + b2``, where

    gate = min(gate, limit); up = clamp(up, -limit, limit)
    swiglu = (up + 1) * gate * sigmoid(alpha * gate)

(``alpha`` 1.702, ``limit`` 7.0 in the released models: ``swiglu_alpha``,
``swiglu_limit``).

Checkpoint tensors (transformers' names and layout, as ``save_pretrained`` writes them and
the bf16 releases ship): ``router.weight`` [E, hidden], ``router.bias`` [E];
``experts.gate_up_proj`` [E, hidden, 2I] whose columns interleave gate and up (gate ``j``
at ``2j``, up ``j`` at ``2j + 1``), ``experts.gate_up_proj_bias`` [E, 2I];
``experts.down_proj`` [E, I, hidden], ``experts.down_proj_bias`` [E, hidden].

Parallelism: each rank holds experts ``expert_start ..`` and, of each, a slice of the
intermediate dimension (tensor parallelism: every expert, ``I / tp`` each; expert
parallelism: ``E / tp`` whole experts). A contiguous slice of the intermediate dimension
is a contiguous run of interleaved columns, so a rank reads only its own. The output is a
partial sum completed by one all-reduce; the down bias is added by the slice holding the
first part of each expert, so it counts once.
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from pagedlm.config import ArchConfig
from pagedlm.distributed import (
    divide,
    expert_parallel_enabled,
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    tensor_model_parallel_all_reduce,
)
from pagedlm.model_executor.layers.linear_base import LinearBase
from pagedlm.model_executor.layers.moe import HOST_GROUPING, expert_groups
from pagedlm.model_executor.loader.weight_utils import copy_checked, default_weight_loader

EXPERT_TENSORS = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")
"""The stacked expert tensors of one layer's checkpoint (``mlp.experts.<name>``)."""


class GptOssRouter(LinearBase):
    """Router logits with a bias, replicated on every rank: x [T, hidden] -> [T, E]. Never
    quantized at load (``quantized_at_load``)."""

    quantized_at_load: ClassVar[bool] = False

    def __init__(self, hidden_size: int, num_experts: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(num_experts), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.apply_linear(x)


def clamped_swiglu(
    gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float
) -> torch.Tensor:
    """gpt-oss's activation of [N, I] gate and up halves -> [N, I]."""
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


class GptOssMoE(nn.Module):
    """forward(x [T, hidden]) -> [T, hidden] (see the module's docstring).

    Parameters: ``router`` (``GptOssRouter``), ``w13`` [local experts, 2 * I / slices,
    hidden] (this slice's gate rows, then its up rows), ``b13`` [local experts, 2 * I /
    slices], ``w2`` [local experts, hidden, I / slices], ``b2`` [local experts, hidden].
    ``load_expert_tensor(name, tensor)`` fills them from a stacked checkpoint tensor.
    """

    uncapturable: ClassVar[str] = HOST_GROUPING

    def __init__(self, arch: ArchConfig) -> None:
        super().__init__()
        raw = arch.raw
        self.num_experts = int(raw.get("num_local_experts") or raw.get("num_experts") or 0)
        self.top_k = int(raw.get("num_experts_per_tok") or raw.get("experts_per_token") or 0)
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok={self.top_k} must be between 1 and num_local_experts="
                f"{self.num_experts}; check config.json."
            )
        self.alpha = float(raw.get("swiglu_alpha", 1.702))
        self.limit = float(raw.get("swiglu_limit", 7.0))
        hidden, intermediate = arch.hidden_size, arch.intermediate_size
        tp_rank = get_tensor_model_parallel_rank()
        self.tp_size = get_tensor_model_parallel_world_size()
        # (rank, ranks) among which each expert's intermediate dimension is sliced.
        self.slice_rank, self.slice_size = tp_rank, self.tp_size
        self.expert_start, self.num_local_experts = 0, self.num_experts
        if expert_parallel_enabled():
            self.num_local_experts = divide(self.num_experts, self.tp_size)
            self.expert_start = tp_rank * self.num_local_experts
            self.slice_rank, self.slice_size = 0, 1
        self.intermediate_per_rank = size = divide(intermediate, self.slice_size)
        experts = self.num_local_experts
        self.router = GptOssRouter(hidden, self.num_experts)
        self.w13 = nn.Parameter(torch.empty(experts, 2 * size, hidden), requires_grad=False)
        self.b13 = nn.Parameter(torch.empty(experts, 2 * size), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(experts, hidden, size), requires_grad=False)
        self.b2 = nn.Parameter(torch.empty(experts, hidden), requires_grad=False)

    def load_expert_tensor(self, name: str, tensor: torch.Tensor) -> str:
        """Copy this rank's part of stacked checkpoint tensor ``experts.<name>`` (one of
        ``EXPERT_TENSORS``) into its parameter; returns that parameter's name here."""
        experts = tensor.narrow(0, self.expert_start, self.num_local_experts)
        size = self.intermediate_per_rank
        first = self.slice_rank * size
        if name in ("gate_up_proj", "gate_up_proj_bias"):
            # This slice's columns 2 * first .. 2 * (first + size), then gate/up apart.
            columns = experts.narrow(-1, 2 * first, 2 * size)
            merged = torch.cat([columns[..., 0::2], columns[..., 1::2]], dim=-1)
            if name == "gate_up_proj":
                copy_checked(self.w13.data, merged.transpose(1, 2), f"experts.{name}")
                return "w13"
            copy_checked(self.b13.data, merged, f"experts.{name}")
            return "b13"
        if name == "down_proj":
            rows = experts.narrow(1, first, size)
            copy_checked(self.w2.data, rows.transpose(1, 2), f"experts.{name}")
            return "w2"
        if name == "down_proj_bias":
            default_weight_loader(self.b2, experts)
            return "b2"
        raise ValueError(
            f"unknown gpt-oss expert tensor experts.{name}; expected one of {EXPERT_TENSORS}."
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        top_logits, expert_ids = torch.topk(self.router(x), self.top_k, dim=-1)
        weights = torch.softmax(top_logits, dim=-1, dtype=torch.float32)
        out = torch.zeros_like(x)
        size = self.intermediate_per_rank
        for local, rows, row_weights in expert_groups(
            expert_ids, weights, self.num_experts, self.expert_start
        ):
            if local >= self.num_local_experts:
                break
            gate_up = F.linear(x[rows], self.w13[local], self.b13[local])
            hidden = clamped_swiglu(gate_up[:, :size], gate_up[:, size:], self.alpha, self.limit)
            bias = self.b2[local] if self.slice_rank == 0 else None
            hidden = F.linear(hidden, self.w2[local], bias)
            out.index_add_(0, rows, (hidden * row_weights[:, None]).to(out.dtype))
        return tensor_model_parallel_all_reduce(out) if self.tp_size > 1 else out

    def extra_repr(self) -> str:
        return (
            f"num_experts={self.num_experts}, top_k={self.top_k}, alpha={self.alpha}, "
            f"limit={self.limit}, local_experts={self.expert_start}.."
            f"{self.expert_start + self.num_local_experts - 1}, slices={self.slice_size}"
        )
