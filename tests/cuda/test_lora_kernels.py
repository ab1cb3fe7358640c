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


# The one-row GEMV with its LoRA delta in the same launch (``lora_fused``).
FUSED_CASES = {
    # name: (in_features, slice sizes, max_loras, max_rank, shrink_k, bias)
    # q/k/v-shaped; the 24-row slice ends inside a 16-row GEMV block.
    "qkv": (100, [24, 8, 8], 3, 8, None, True),
    # 10 splits of 32 features, more work items than the 5 programs: claims loop.
    "gate_up": (300, [40, 40], 2, 16, 32, False),
    # 96 shrunk rows: two row blocks of 64 (the second short), 5 splits each.
    "rank32": (80, [16, 16, 16], 2, 32, 16, True),
    "single": (64, [48], 4, 4, None, False),
}


def _fused_case(name: str, dtype: torch.dtype):
    in_features, sizes, max_loras, max_rank, _, bias = FUSED_CASES[name]
    gen = torch.Generator().manual_seed(100 + len(name))
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    slices = tuple(SliceSpec(s, n) for s, n in zip(starts, sizes, strict=True))
    lora_a = torch.randn(max_loras, len(sizes) * max_rank, in_features, generator=gen)
    lora_a[:, max_rank - 1 :: max_rank] = 0.0  # each slice's last rank: zero padding
    lora_b = torch.randn(max_loras, sum(sizes), max_rank, generator=gen)
    weight = torch.randn(sum(sizes), in_features, generator=gen) * in_features**-0.5
    b = torch.randn(sum(sizes), generator=gen) if bias else None
    xs = [torch.randn(1, in_features, generator=gen) for _ in range(4)]
    move = [t.to(dtype).to(DEVICE) if t is not None else None for t in (lora_a, lora_b, weight, b)]
    return move, [x.to(dtype).to(DEVICE) for x in xs], slices


@pytest.mark.parametrize("name", list(FUSED_CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fused_gemv_lora_matches_gemv_plus_reference_call_after_call(name, dtype):
    """Four calls on one scratch (the counters' epochs advance), adapters and the base
    model in turn: a base-model call gives gemv's bits; an adapter call gemv's result
    plus the delta (and the two-launch ops' result within rounding)."""
    from pagedlm_cuda.kernels.gemv import gemv
    from pagedlm_cuda.kernels.lora_fused import FusedScratch, base_config, gemv_lora

    (lora_a, lora_b, weight, bias), xs, slices = _fused_case(name, dtype)
    shrink_k = FUSED_CASES[name][4]
    n = weight.shape[0]
    scratch = FusedScratch(lora_a.shape[1], lora_a.shape[2], base_config(n)[2], DEVICE, shrink_k)
    num_programs = -(-n // base_config(n)[0])
    unfused = TritonLoRAOps(fuse_single_row=False)
    for call, (x, slot) in enumerate(zip(xs, [1, -1, 0, 1], strict=True)):
        token_slots = torch.tensor([slot], dtype=torch.int32)
        out = gemv_lora(x, weight, bias, lora_a, lora_b, token_slots.to(DEVICE), slices, scratch)
        base = gemv(x, weight, bias)
        if slot < 0:
            assert torch.equal(out, base)
        else:
            delta = reference_delta(x, lora_a, lora_b, slices, token_slots)
            expected = base.double().cpu() + delta
            assert rel_error(out.cpu(), expected) < tolerance(dtype)
            two_launches = base.clone()
            state = LoRAStepState(token_slots.to(DEVICE))
            unfused.add_lora(two_launches, x, lora_a, lora_b, slices, state, [True] * 4)
            assert rel_error(out.cpu(), two_launches.double().cpu()) < tolerance(dtype)
        items = scratch.plan.items
        assert scratch.counters.tolist() == [
            (call + 1) * (items + num_programs),
            (call + 1) * items,
            call + 1,
        ]
    if shrink_k is not None:
        assert scratch.plan.items > 1


def test_ops_fuse_only_one_row_behind_the_gemv_kernel():
    """The routing is a function of the row count and the base kernel: one row behind
    ``SingleRowLinear`` fuses; two rows, or another base kernel, take the two launches."""
    from pagedlm.model_executor.layers.linear import ColumnParallelLinear
    from pagedlm_cuda.fused_layers import SingleRowLinear

    (lora_a, lora_b, weight, _), xs, slices = _fused_case("single", torch.float32)
    layer = ColumnParallelLinear(weight.shape[1], weight.shape[0]).to(DEVICE)
    with torch.no_grad():
        layer.weight.copy_(weight)
    state = LoRAStepState(torch.tensor([2, 3], dtype=torch.int32, device=DEVICE))
    ops = TritonLoRAOps()
    kernel = SingleRowLinear(layer)
    one_row = ops.linear_with_lora(layer, kernel, xs[0], lora_a, lora_b, slices, state)
    assert one_row is not None
    expected = kernel(xs[0]).double().cpu()
    expected += reference_delta(xs[0], lora_a, lora_b, slices, state.token_slots[:1].cpu())
    assert rel_error(one_row.cpu(), expected) < tolerance(torch.float32)
    two_rows = torch.cat(xs[:2])
    assert ops.linear_with_lora(layer, kernel, two_rows, lora_a, lora_b, slices, state) is None
    assert ops.linear_with_lora(layer, None, xs[0], lora_a, lora_b, slices, state) is None
    assert (
        TritonLoRAOps(fuse_single_row=False).linear_with_lora(
            layer, kernel, xs[0], lora_a, lora_b, slices, state
        )
        is None
    )


@pytest.mark.cuda
def test_fused_gemv_lora_in_a_cuda_graph_replays_any_slot():
    """Captured once, replayed with the adapter, the base model and another adapter in
    the slots buffer (the counters grow across replays)."""
    if not ON_GPU:
        pytest.skip("CUDA graphs need a GPU")
    from pagedlm_cuda.kernels.gemv import gemv
    from pagedlm_cuda.kernels.lora_fused import FusedScratch, base_config, gemv_lora

    (lora_a, lora_b, weight, bias), xs, slices = _fused_case("qkv", torch.bfloat16)
    n = weight.shape[0]
    scratch = FusedScratch(lora_a.shape[1], lora_a.shape[2], base_config(n)[2], DEVICE)
    slots = torch.tensor([0], dtype=torch.int32, device=DEVICE)
    x = xs[0].clone()
    out = gemv_lora(x, weight, bias, lora_a, lora_b, slots, slices, scratch)  # compile
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gemv_lora(x, weight, bias, lora_a, lora_b, slots, slices, scratch)
    for step, slot in enumerate([1, -1, 2, 0]):
        slots.fill_(slot)
        x.copy_(xs[step])
        graph.replay()
        base = gemv(x, weight, bias)
        if slot < 0:
            assert torch.equal(out, base)
            continue
        expected = base.double().cpu() + reference_delta(x, lora_a, lora_b, slices, slots.cpu())
        assert rel_error(out.cpu(), expected) < tolerance(torch.bfloat16)
