"""The Triton LoRA shrink/expand against the float64 token-by-token reference and the
torch ops the CPU platform uses (interpreted on CPU, on the GPU with ``-m cuda``).

Every case mixes adapter slots and base-model tokens (slot -1), uses ranks below the
slots' width (zero padding) and fused layers of three slices (q/k/v-shaped) and two
(gate/up-shaped); base-model rows of the output must come back bit-identical.
"""

from __future__ import annotations

import pytest
import torch
from triton_env import DEVICE, ON_GPU, rel_error, tolerance

from pagedlm.lora.ops import LoRAStepState, SliceSpec, TorchLoRAOps, reference_delta
from pagedlm_cuda.kernels.lora import TritonLoRAOps

CASES = {
    # name: (tokens, in_features, slice sizes, max_loras, max_rank, slot per token)
    "qkv": (7, 48, [32, 16, 16], 3, 8, [0, -1, 2, 2, 1, -1, 0]),
    "gate_up": (5, 40, [24, 24], 2, 4, [1, 1, -1, 0, 1]),
    "single": (4, 96, [40], 4, 16, [3, -1, -1, 3]),
    "one_adapter": (3, 32, [16, 8], 2, 4, [1, 1, 1]),  # every row: the torch ops skip gathers
    # 48 shrunk rows over 1,100 features: the shrink's 512-wide splits walk several tiles
    # after the one read before the PDL wait, and the last split is short.
    "wide": (3, 1100, [16, 16, 16], 2, 16, [1, -1, 0]),
}


def _case(name: str, dtype: torch.dtype):
    num_tokens, in_features, sizes, max_loras, max_rank, slots = CASES[name]
    gen = torch.Generator().manual_seed(len(name))
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    slices = tuple(SliceSpec(s, n) for s, n in zip(starts, sizes, strict=True))
    lora_a = torch.zeros(max_loras, len(sizes) * max_rank, in_features)
    lora_b = torch.zeros(max_loras, sum(sizes), max_rank)
    for slot in range(max_loras):
        rank = max(1, max_rank - 2 * slot)  # narrower than the slot: zero padding
        for i, spec in enumerate(slices):
            lora_a[slot, i * max_rank : i * max_rank + rank] = torch.randn(
                rank, in_features, generator=gen
            )
            lora_b[slot, spec.start : spec.start + spec.size, :rank] = torch.randn(
                spec.size, rank, generator=gen
            )
    x = torch.randn(num_tokens, in_features, generator=gen)
    out = torch.randn(num_tokens, sum(sizes), generator=gen)
    token_slots = torch.tensor(slots, dtype=torch.int32)
    return [t.to(dtype).to(DEVICE) for t in (x, lora_a, lora_b, out)], token_slots, slices


def _state(token_slots: torch.Tensor) -> LoRAStepState:
    groups = [
        (slot, torch.nonzero(token_slots == slot).flatten().to(DEVICE))
        for slot in sorted(set(token_slots.tolist()) - {-1})
    ]
    return LoRAStepState(token_slots.to(DEVICE), groups)


@pytest.mark.parametrize("split_k", [None, 16])  # 16: 2-6 partial sums, the last one short
@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_lora_matches_reference_and_torch_ops(name, dtype, split_k):
    (x, lora_a, lora_b, out), token_slots, slices = _case(name, dtype)
    state = _state(token_slots)
    active = [True] * lora_a.shape[0]
    expected = out.double().cpu() + reference_delta(x, lora_a, lora_b, slices, token_slots)

    triton_out = out.clone()
    TritonLoRAOps(split_k).add_lora(triton_out, x, lora_a, lora_b, slices, state, active)
    torch_out = out.clone()
    TorchLoRAOps().add_lora(torch_out, x, lora_a, lora_b, slices, state, active)

    base_rows = token_slots.to(DEVICE) < 0
    assert torch.equal(triton_out[base_rows], out[base_rows])  # untouched, to the bit
    assert torch.equal(torch_out[base_rows], out[base_rows])
    lora_rows = ~base_rows.cpu()
    for got in (triton_out, torch_out):
        assert rel_error(got.cpu()[lora_rows], expected[lora_rows]) < tolerance(dtype)


@pytest.mark.cuda
def test_triton_lora_in_a_cuda_graph_follows_the_slots_buffer():
    if not ON_GPU:
        pytest.skip("CUDA graphs need a GPU")
    (x, lora_a, lora_b, out), token_slots, slices = _case("qkv", torch.bfloat16)
    state = LoRAStepState(torch.full_like(token_slots, -1).to(DEVICE))
    ops, active = TritonLoRAOps(), [True] * lora_a.shape[0]
    static_out = out.clone()
    ops.add_lora(static_out, x, lora_a, lora_b, slices, state, active)  # warm-up compile
    graph = torch.cuda.CUDAGraph()
    static_out.copy_(out)
    with torch.cuda.graph(graph):
        ops.add_lora(static_out, x, lora_a, lora_b, slices, state, active)
    state.token_slots.copy_(token_slots)
    static_out.copy_(out)
    graph.replay()
    expected = out.double().cpu() + reference_delta(x, lora_a, lora_b, slices, token_slots)
    assert rel_error(static_out.cpu(), expected) < tolerance(torch.bfloat16)
