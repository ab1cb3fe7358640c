"""FusedMoE against a per-token loop, and its expert-parallel slicing."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedlm.model_executor.layers.moe import FusedMoE, select_experts

NUM_EXPERTS, TOP_K, HIDDEN, INTERMEDIATE = 6, 2, 16, 24


def _experts(seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) * 0.3

    return {
        "router": randn(NUM_EXPERTS, HIDDEN),
        "gate": randn(NUM_EXPERTS, INTERMEDIATE, HIDDEN),
        "up": randn(NUM_EXPERTS, INTERMEDIATE, HIDDEN),
        "down": randn(NUM_EXPERTS, HIDDEN, INTERMEDIATE),
    }


def _build(
    weights: dict[str, torch.Tensor], renormalize: bool, start: int = 0, count: int | None = None
) -> FusedMoE:
    moe = FusedMoE(
        NUM_EXPERTS,
        TOP_K,
        HIDDEN,
        INTERMEDIATE,
        renormalize,
        expert_start=start,
        num_local_experts=count,
    )
    moe.gate.weight.data.copy_(weights["router"])
    for expert in range(NUM_EXPERTS):  # every expert offered; other ranks' are skipped
        moe.weight_loader(moe.w13, weights["gate"][expert], expert, "gate")
        moe.weight_loader(moe.w13, weights["up"][expert], expert, "up")
        moe.weight_loader(moe.w2, weights["down"][expert], expert, "down")
    return moe


def _reference(x: torch.Tensor, weights: dict[str, torch.Tensor], renormalize: bool):
    out = torch.zeros_like(x, dtype=torch.float64)
    probs = torch.softmax(x.double() @ weights["router"].double().T, dim=-1)
    for t in range(x.shape[0]):
        top = torch.topk(probs[t], TOP_K)
        scale = top.values / top.values.sum() if renormalize else top.values
        for weight, expert in zip(scale, top.indices.tolist(), strict=True):
            xt = x[t].double()
            hidden = F.silu(weights["gate"][expert].double() @ xt)
            hidden = hidden * (weights["up"][expert].double() @ xt)
            out[t] += weight * (weights["down"][expert].double() @ hidden)
    return out


@pytest.mark.parametrize("renormalize", [True, False])
def test_matches_per_token_reference(renormalize: bool) -> None:
    weights = _experts()
    x = torch.randn(37, HIDDEN, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = _build(weights, renormalize)(x)
    torch.testing.assert_close(out.double(), _reference(x, weights, renormalize), atol=1e-5, rtol=0)


def test_expert_slices_sum_to_the_whole_layer() -> None:
    """Two 'ranks' holding experts 0-3 and 4-5 give partial sums adding up to the layer."""
    weights = _experts(2)
    x = torch.randn(23, HIDDEN, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        whole = _build(weights, True)(x)
        first = _build(weights, True, start=0, count=4)(x)
        second = _build(weights, True, start=4, count=2)(x)
    assert first.abs().sum() > 0 and second.abs().sum() > 0
    torch.testing.assert_close(first + second, whole, atol=1e-6, rtol=0)


def test_select_experts_renormalizes_only_when_asked() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    weights, ids = select_experts(logits, 2, renormalize=True)
    assert ids.tolist() == [[0, 1]]
    torch.testing.assert_close(weights.sum(-1), torch.ones(1))
    raw, _ = select_experts(logits, 2, renormalize=False)
    torch.testing.assert_close(raw, torch.softmax(logits, -1)[:, :2])


def test_bad_top_k_and_shard_are_explained() -> None:
    with pytest.raises(ValueError, match="num_experts_per_tok=7"):
        FusedMoE(NUM_EXPERTS, 7, HIDDEN, INTERMEDIATE, True)
    moe = FusedMoE(NUM_EXPERTS, TOP_K, HIDDEN, INTERMEDIATE, True)
    with pytest.raises(ValueError, match="unknown expert shard 'w4'"):
        moe.weight_loader(moe.w13, torch.zeros(INTERMEDIATE, HIDDEN), 0, "w4")
