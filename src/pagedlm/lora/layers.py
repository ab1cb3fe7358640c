"""``LoRALinear``: the wrapper component over one linear layer that adds adapters.

It is installed as the layer's kernel (``LinearBase.set_kernel``), wrapping whatever kernel
the platform gave it, so models never ask whether LoRA is on: the layer computes
``base(x)`` as before, then the slots' batched delta is added in place. A row-parallel
layer's delta is computed from this rank's input shard (``B (A_shard x_shard)``), so the
layer's all-reduce sums it with the other ranks' into the full delta.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedlm.lora.ops import LoRAOps, LoRAStepState, SliceSpec
from pagedlm.lora.targets import layer_features, layer_slices
from pagedlm.model_executor.layers.linear import QKVParallelLinear, RowParallelLinear
from pagedlm.model_executor.layers.linear_base import LinearBase, LinearKernel
from pagedlm.model_executor.loader.weight_utils import shard_of


class LoRALinear:
    """Kernel of one adapted layer: ``base(x) + delta(x)``; holds the layer's device slots.

    ``lora_a [max_loras, num_slices * max_rank, in_per_rank]``, ``lora_b [max_loras,
    out_per_rank, max_rank]`` (see ``pagedlm.lora.ops``). Slot ``s`` is all zeros unless
    ``active[s]``.
    """

    def __init__(
        self,
        layer: LinearBase,
        max_loras: int,
        max_rank: int,
        state: LoRAStepState,
        ops: LoRAOps,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.layer = layer
        self.base_kernel: LinearKernel | None = layer.kernel
        self.state = state
        self.ops = ops
        sizes = layer_slices(layer)
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        self.slices = tuple(SliceSpec(s, n) for s, n in zip(starts, sizes, strict=True))
        self.max_rank = max_rank
        in_features, out_features = layer_features(layer)
        self.lora_a = torch.zeros(
            (max_loras, len(sizes) * max_rank, in_features), dtype=dtype, device=device
        )
        self.lora_b = torch.zeros((max_loras, out_features, max_rank), dtype=dtype, device=device)
        self.active = [False] * max_loras

    def clear(self, slot: int) -> None:
        if self.active[slot]:
            self.lora_a[slot].zero_()
            self.lora_b[slot].zero_()
            self.active[slot] = False

    def write(
        self, slot: int, slice_index: int, lora_a: torch.Tensor, lora_b: torch.Tensor
    ) -> None:
        """Slice ``slice_index``'s A [r, in_per_rank] and B [slice_size, r] into ``slot``."""
        rank = lora_a.shape[0]
        spec = self.slices[slice_index]
        base = slice_index * self.max_rank
        self.lora_a[slot, base : base + rank].copy_(lora_a)
        self.lora_b[slot, spec.start : spec.start + spec.size, :rank].copy_(lora_b)
        self.active[slot] = True

    def write_module(
        self, slot: int, slices: tuple[int, ...], lora_a: torch.Tensor, lora_b: torch.Tensor
    ) -> None:
        """One adapted HF module, whole (unsharded): A [r, in], B [out of ``slices``, r].

        B's rows split over ``slices`` by their full sizes (a fused HF module shares one A
        between them); this rank then takes its shard: B rows of a column-parallel layer
        (a replicated kv head's rank reads its source rank's rows), A columns of a
        row-parallel one."""
        layer = self.layer
        tp_size, tp_rank = layer.tp_size, layer.tp_rank  # type: ignore[attr-defined]
        replicas = getattr(layer, "kv_replicas", 1)
        is_qkv = isinstance(layer, QKVParallelLinear)
        row_parallel = isinstance(layer, RowParallelLinear)
        per_rank = [self.slices[i].size for i in slices]
        full = [
            size if row_parallel else size * tp_size // (replicas if is_qkv and i > 0 else 1)
            for i, size in zip(slices, per_rank, strict=True)
        ]
        if row_parallel:
            lora_a = shard_of(lora_a, 1, tp_rank, lora_a.shape[1] // tp_size)
        dtype = self.lora_a.dtype
        for i, size, part in zip(slices, per_rank, lora_b.split(full, dim=0), strict=True):
            if not row_parallel:
                source = tp_rank // replicas if is_qkv and i > 0 else tp_rank
                part = shard_of(part, 0, source, size)
            self.write(slot, i, lora_a.to(dtype), part.to(dtype))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        layer = self.layer
        fused = self.ops.linear_with_lora(
            layer, self.base_kernel, x, self.lora_a, self.lora_b, self.slices, self.state
        )
        if fused is not None:
            return fused
        if self.base_kernel is not None:
            out = self.base_kernel(x)
        else:
            out = F.linear(x, layer.weight, layer.linear_bias)
        self.ops.add_lora(out, x, self.lora_a, self.lora_b, self.slices, self.state, self.active)
        return out
