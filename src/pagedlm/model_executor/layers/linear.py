"""Linear layers that hold only this rank's tensor-parallel shard of their weight.

Column-parallel layers split the output features across ranks (each rank computes a slice
of the output, no communication); row-parallel layers split the input features (each rank
computes a partial sum, then an all-reduce). A column layer followed by a row layer — q/k/v
then o_proj, gate_up then down_proj — therefore needs one all-reduce per block.

Weights are ``[out_features, in_features]`` as in ``torch.nn.Linear`` and in HF files.
Parameters are created with ``torch.empty``: the loader overwrites every one of them, so
initializing them would only cost time. Each parameter carries a ``weight_loader`` that
slices this rank's shard out of a full checkpoint tensor.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from torch import nn

from pagedlm.distributed import (
    divide,
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
)
from pagedlm.model_executor.layers.linear_base import LinearBase, linear_weight
from pagedlm.model_executor.loader.weight_utils import (
    copy_checked,
    set_weight_loader,
    shard_of,
)


class _ShardedLinear(LinearBase, ABC):
    """Holds ``weight [out_per_rank, in_per_rank]`` and an optional bias."""

    def __init__(self, in_per_rank: int, out_per_rank: int, bias_size: int | None) -> None:
        super().__init__()
        self.tp_rank = get_tensor_model_parallel_rank()
        self.tp_size = get_tensor_model_parallel_world_size()
        # Kept apart from the weight's shape: a platform may release the weight.
        self.in_per_rank, self.out_per_rank = in_per_rank, out_per_rank
        self.weight = linear_weight(out_per_rank, in_per_rank)
        set_weight_loader(self.weight, self.weight_loader)
        self.bias: nn.Parameter | None = None
        if bias_size is not None:
            self.bias = nn.Parameter(torch.empty(bias_size), requires_grad=False)
            set_weight_loader(self.bias, self.weight_loader)

    @abstractmethod
    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        """Copy this rank's shard of a full checkpoint tensor into ``param``."""

    def extra_repr(self) -> str:
        return (
            f"in_per_rank={self.in_per_rank}, out_per_rank={self.out_per_rank}, "
            f"tp_size={self.tp_size}"
        )


class ColumnParallelLinear(_ShardedLinear):
    """``y = x W^T + b`` with W's output rows split across ranks.

    forward: x [num_tokens, input_size] -> [num_tokens, output_size / tp] (or the full
    [num_tokens, output_size] with ``gather_output``).
    """

    def __init__(
        self, input_size: int, output_size: int, bias: bool = False, gather_output: bool = False
    ) -> None:
        out_per_rank = divide(output_size, get_tensor_model_parallel_world_size())
        super().__init__(input_size, out_per_rank, out_per_rank if bias else None)
        self.input_size = input_size
        self.output_size = output_size
        self.gather_output = gather_output

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        shard_size = param.shape[0]
        copy_checked(param.data, shard_of(loaded_weight, 0, self.tp_rank, shard_size), "column")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.apply_linear(x)
        return tensor_model_parallel_all_gather(out) if self.gather_output else out


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input in one matmul (gate_up).

    Shard ``i`` of the checkpoint (e.g. 0 = gate_proj, 1 = up_proj) fills rows
    ``sum(output_sizes[:i]) / tp ..`` of this rank's weight, so each rank holds its slice of
    every projection, in order.
    """

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False) -> None:
        super().__init__(input_size, sum(output_sizes), bias=bias)
        tp_size = get_tensor_model_parallel_world_size()
        self.output_sizes = [divide(size, tp_size) for size in output_sizes]

    def weight_loader(  # type: ignore[override]
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: int
    ) -> None:
        offset = sum(self.output_sizes[:shard_id])
        size = self.output_sizes[shard_id]
        target = param.data.narrow(0, offset, size)
        copy_checked(target, shard_of(loaded_weight, 0, self.tp_rank, size), f"shard {shard_id}")


class QKVParallelLinear(ColumnParallelLinear):
    """The q, k and v projections in one matmul, split across ranks by attention head.

    Each rank gets ``num_heads / tp`` query heads. With fewer kv heads than ranks, each kv
    head is replicated on ``tp / num_kv_heads`` consecutive ranks.

    forward: x [num_tokens, hidden] -> [num_tokens, q_size + 2 * kv_size] (this rank's).
    """

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        total_num_heads: int,
        total_num_kv_heads: int,
        bias: bool = False,
    ) -> None:
        tp_size = get_tensor_model_parallel_world_size()
        self.head_dim = head_dim
        self.num_heads = divide(total_num_heads, tp_size)
        if tp_size >= total_num_kv_heads:
            self.num_kv_heads = 1
            self.kv_replicas = divide(tp_size, total_num_kv_heads)
        else:
            self.num_kv_heads = divide(total_num_kv_heads, tp_size)
            self.kv_replicas = 1
        output_size = (self.num_heads + 2 * self.num_kv_heads) * head_dim * tp_size
        super().__init__(hidden_size, output_size, bias=bias)
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim

    def weight_loader(  # type: ignore[override]
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: str
    ) -> None:
        if shard_id == "q":
            offset, size, source_rank = 0, self.q_size, self.tp_rank
        elif shard_id in ("k", "v"):
            offset = self.q_size if shard_id == "k" else self.q_size + self.kv_size
            size, source_rank = self.kv_size, self.tp_rank // self.kv_replicas
        else:
            raise ValueError(f"unknown qkv shard id {shard_id!r}; use 'q', 'k' or 'v'.")
        target = param.data.narrow(0, offset, size)
        copy_checked(target, shard_of(loaded_weight, 0, source_rank, size), f"{shard_id}_proj")

    def split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[num_tokens, q_size + 2 * kv_size] -> q [T, q_size], k [T, kv_size], v [T, kv_size]."""
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        return q, k, v


class RowParallelLinear(_ShardedLinear):
    """``y = x W^T + b`` with W's input columns split across ranks.

    forward: x [num_tokens, input_size / tp] (a column layer's output) ->
    [num_tokens, output_size], summed over ranks when ``reduce_results`` (otherwise the
    caller sums the partial results). The bias is replicated and added by rank 0 only.
    """

    def __init__(
        self, input_size: int, output_size: int, bias: bool = False, reduce_results: bool = True
    ) -> None:
        in_per_rank = divide(input_size, get_tensor_model_parallel_world_size())
        super().__init__(in_per_rank, output_size, output_size if bias else None)
        self.input_size = input_size
        self.output_size = output_size
        self.reduce_results = reduce_results

    @property
    def linear_bias(self) -> torch.Tensor | None:
        # Only rank 0 adds the bias, so it appears once in the sum over ranks.
        return self.bias if self.tp_rank == 0 else None

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        if param is self.bias:
            copy_checked(param.data, loaded_weight, "row bias")
            return
        shard_size = param.shape[1]
        copy_checked(param.data, shard_of(loaded_weight, 1, self.tp_rank, shard_size), "row")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.apply_linear(x)
        return tensor_model_parallel_all_reduce(out) if self.reduce_results else out
