"""The batched LoRA delta: ``out[t] += B[s] (A[s] x[t])`` for every token ``t`` whose
request runs adapter slot ``s``; tokens of base-model requests (slot -1) are untouched.

Per layer the slots hold ``lora_a [max_loras, num_slices * max_rank, in_features]`` and
``lora_b [max_loras, out_features, max_rank]``: slice ``i`` (q, k or v of a fused qkv
layer) reads columns ``i * max_rank ..`` of the shrunk activations and writes its own
output columns. Ranks below ``max_rank`` are zero-padded, so they add exact zeros.

``LoRAOps`` is what a platform provides (``Platform.lora_ops``); ``TorchLoRAOps`` is the
default: per adapter in the step, one gather, two matmuls per slice and an ``index_add_``
(batched over all of that adapter's tokens; no gather or scatter when one adapter has
every row). It reads the step's token groups, which are
host-built Python state, so it is not ``graph_safe``; a kernel that reads only the
fixed-address ``token_slots`` buffer is (``pagedlm_cuda.kernels.lora``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from pagedlm.model_executor.layers.linear_base import LinearBase, LinearKernel


@dataclass(frozen=True)
class SliceSpec:
    """Output columns ``[start, start + size)`` of a layer belong to one slice."""

    start: int
    size: int


@dataclass
class LoRAStepState:
    """The step's token -> slot map, shared by every LoRA layer of one model.

    Invariants: ``token_slots`` keeps its address (captured graphs read it); during a
    forward of ``num_tokens`` rows, ``token_slots[:num_tokens]`` holds each row's slot
    (-1: no adapter, padding rows included), and ``groups`` lists, per slot in use, the
    rows that use it (int64 on the device).
    """

    token_slots: torch.Tensor
    groups: list[tuple[int, torch.Tensor]] = field(default_factory=list)


class LoRAOps(Protocol):
    graph_safe: bool
    """Whether a CUDA graph captured over the ops replays later steps correctly."""

    def add_lora(
        self,
        out: torch.Tensor,
        x: torch.Tensor,
        lora_a: torch.Tensor,
        lora_b: torch.Tensor,
        slices: tuple[SliceSpec, ...],
        state: LoRAStepState,
        active_slots: list[bool],
    ) -> None:
        """Add the delta of ``x`` [T, in] into ``out`` [T, out] in place.
        ``active_slots[s]``: slot ``s`` holds weights for this layer (a hint a kernel may
        ignore: inactive slots are all zeros)."""

    def linear_with_lora(
        self,
        layer: LinearBase,
        base_kernel: LinearKernel | None,
        x: torch.Tensor,
        lora_a: torch.Tensor,
        lora_b: torch.Tensor,
        slices: tuple[SliceSpec, ...],
        state: LoRAStepState,
    ) -> torch.Tensor | None:
        """``base_kernel(x)`` plus the delta in one pass, where the ops have a kernel for
        this base kernel and shape (the choice a function of shapes only, never of the
        slots); None: the caller runs ``base_kernel`` and then ``add_lora``."""


class TorchLoRAOps:
    graph_safe = False

    def linear_with_lora(self, layer, base_kernel, x, lora_a, lora_b, slices, state) -> None:
        return None

    def add_lora(
        self,
        out: torch.Tensor,
        x: torch.Tensor,
        lora_a: torch.Tensor,
        lora_b: torch.Tensor,
        slices: tuple[SliceSpec, ...],
        state: LoRAStepState,
        active_slots: list[bool],
    ) -> None:
        max_rank = lora_b.shape[2]
        for slot, rows in state.groups:
            if not active_slots[slot]:
                continue
            every_row = rows.shape[0] == x.shape[0]  # one adapter for the whole step
            shrunk = (x if every_row else x.index_select(0, rows)) @ lora_a[slot].t()
            for index, spec in enumerate(slices):
                delta = shrunk[:, index * max_rank : (index + 1) * max_rank] @ (
                    lora_b[slot, spec.start : spec.start + spec.size].t()
                )
                columns = out[:, spec.start : spec.start + spec.size]
                if every_row:
                    columns.add_(delta)
                else:
                    columns.index_add_(0, rows, delta)


def reference_delta(
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    slices: tuple[SliceSpec, ...],
    token_slots: torch.Tensor,
) -> torch.Tensor:
    """The delta token by token in float64 (tests compare every implementation with it)."""
    max_rank = lora_b.shape[2]
    delta = torch.zeros(x.shape[0], lora_b.shape[1], dtype=torch.float64)
    for t, slot in enumerate(token_slots.tolist()):
        if slot < 0:
            continue
        shrunk = lora_a[slot].double().cpu() @ x[t].double().cpu()
        for index, spec in enumerate(slices):
            part = shrunk[index * max_rank : (index + 1) * max_rank]
            rows = lora_b[slot, spec.start : spec.start + spec.size].double().cpu()
            delta[t, spec.start : spec.start + spec.size] = rows @ part
    return delta
